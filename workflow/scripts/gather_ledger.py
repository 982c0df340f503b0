import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.gather import gather_ledger, gather_prefixes

gather_ledger(list(snakemake.input.ledger), snakemake.output.ledger)
gather_prefixes(list(snakemake.input.prefixes), snakemake.output.prefixes)
