import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.gather import gather_minimal_transplants

gather_minimal_transplants(list(snakemake.input.minimal), snakemake.output.minimal)
