import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.gather import gather_ledger  # a replayed baseline is ledger rows

gather_ledger(list(snakemake.input.baseline), snakemake.output.baseline)
