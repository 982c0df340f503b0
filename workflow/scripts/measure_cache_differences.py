from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.cache_differences import measure_cache_differences
from stagereplay.stages.settings import CacheDifferenceSettings, from_params

measure_cache_differences(snakemake.input.prefixes, snakemake.output.differences,
                          from_params(CacheDifferenceSettings, snakemake.params.kwargs))
