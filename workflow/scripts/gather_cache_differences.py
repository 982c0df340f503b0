import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.gather import gather_cache_differences

gather_cache_differences(list(snakemake.input.differences), snakemake.output.differences)
