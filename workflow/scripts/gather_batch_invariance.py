from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_batch_invariance

gather_batch_invariance(list(snakemake.input.table), snakemake.output.table)
