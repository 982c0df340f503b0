from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_minimal_transplants

gather_minimal_transplants(list(snakemake.input.minimal), snakemake.output.minimal)
