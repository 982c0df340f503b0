import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages import reconstruct_prefixes

reconstruct_prefixes(snakemake.input.selection, snakemake.output.ledger, snakemake.output.prefixes,
                     bridge_path=snakemake.output.bridge, bridge=snakemake.params.bridge, **snakemake.params.kwargs)
