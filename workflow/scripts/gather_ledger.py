import sys

sys.stderr = open(snakemake.log[0], "w")

from stagereplay.stages import gather_ledger, gather_prefixes

gather_ledger(list(snakemake.input.ledger), snakemake.output.ledger)
gather_prefixes(list(snakemake.input.prefixes), snakemake.output.prefixes)
