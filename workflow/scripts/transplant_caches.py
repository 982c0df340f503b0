from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.settings import TransplantSettings, from_params
from stagereplay.stages.transplant import transplant_caches

transplant_caches(snakemake.input.selection, snakemake.input.baseline, snakemake.output.transplant,
                  from_params(TransplantSettings, snakemake.params.kwargs))
