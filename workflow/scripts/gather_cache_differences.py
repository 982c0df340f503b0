from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_cache_differences

gather_cache_differences(list(snakemake.input.differences), snakemake.output.differences)
