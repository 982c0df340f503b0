from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_transplants

gather_transplants(list(snakemake.input.transplant), snakemake.output.transplant)
