import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.gather import gather_batch_invariance

gather_batch_invariance(list(snakemake.input.table), snakemake.output.table)
