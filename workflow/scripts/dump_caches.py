import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.transplant_stages import dump_caches

dump_caches(snakemake.input.baseline, snakemake.output.caches, snakemake.output.manifest,
            items=snakemake.params.dump_items, **snakemake.params.kwargs)
