from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.cache_differences import measure_cache_differences
from stagereplay.stages.settings import CacheDifferenceSettings, from_params

measure_cache_differences(snakemake.input.prefixes, snakemake.output.differences,
                          from_params(CacheDifferenceSettings, snakemake.params.kwargs))
