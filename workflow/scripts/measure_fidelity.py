from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.fidelity import measure_fidelity
from stagereplay.stages.settings import FidelitySettings, from_params

measure_fidelity(snakemake.input.selection, snakemake.input.ledger, snakemake.output.fidelity,
                 from_params(FidelitySettings, snakemake.params.kwargs))
