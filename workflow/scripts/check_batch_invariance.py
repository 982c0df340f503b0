import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.control_stages import batch_invariance

batch_invariance(snakemake.input.selection, snakemake.input.ledger, snakemake.output.table, **snakemake.params.kwargs)
