import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.transplant_stages import transplant_items

transplant_items(snakemake.input.selection, snakemake.input.baseline, snakemake.output.transplant,
                 **snakemake.params.kwargs)
