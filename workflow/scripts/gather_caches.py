import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.gather import gather_caches

gather_caches(list(snakemake.input.manifests), list(snakemake.input.folders), snakemake.output.caches,
              snakemake.output.manifest)
