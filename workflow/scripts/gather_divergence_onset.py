from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_divergence_onset

gather_divergence_onset(list(snakemake.input.onset), snakemake.output.onset)
