import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.cache_differences import measure_cache_differences

measure_cache_differences(snakemake.input.prefixes, snakemake.output.differences, **snakemake.params.kwargs)
