import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.control_stages import generate_fixed_prefix

generate_fixed_prefix(snakemake.input.selection, snakemake.input.prefixes, snakemake.output.ledger,
                      **snakemake.params.kwargs)
