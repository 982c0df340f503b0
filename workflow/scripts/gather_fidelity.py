import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.gather import gather_fidelity

gather_fidelity(list(snakemake.input.fidelity), snakemake.output.fidelity)
