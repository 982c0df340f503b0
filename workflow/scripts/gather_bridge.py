from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_bridge

gather_bridge(list(snakemake.input.bridge), snakemake.output.bridge)
