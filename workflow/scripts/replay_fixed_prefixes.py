import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.transplant_stages import replay_fixed_prefixes

replay_fixed_prefixes(snakemake.input.prefixes, snakemake.output.baseline, **snakemake.params.kwargs)
