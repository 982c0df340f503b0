from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.minimal_transplant import find_minimal_transplants
from stagereplay.stages.settings import MinimalTransplantSettings, from_params

find_minimal_transplants(snakemake.input.selection, snakemake.input.baseline, snakemake.output.minimal,
                         from_params(MinimalTransplantSettings, snakemake.params.kwargs))
