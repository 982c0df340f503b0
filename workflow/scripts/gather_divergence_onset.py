import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.gather import gather_divergence_onset

gather_divergence_onset(list(snakemake.input.onset), snakemake.output.onset)
