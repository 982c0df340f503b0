from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.divergence_onset import measure_divergence_onset
from stagereplay.stages.settings import OnsetSettings, from_params

measure_divergence_onset(snakemake.input.baseline, snakemake.output.onset,
                         from_params(OnsetSettings, snakemake.params.kwargs))
