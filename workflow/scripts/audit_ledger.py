import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.control_stages import audit_ledger

audit_ledger(snakemake.input.selection, snakemake.input.ledger, snakemake.output.audit, **snakemake.params.kwargs)
