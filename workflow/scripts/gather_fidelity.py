from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_fidelity

gather_fidelity(list(snakemake.input.fidelity), snakemake.output.fidelity)
