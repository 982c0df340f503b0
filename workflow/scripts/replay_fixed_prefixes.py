from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.settings import ReplaySettings, from_params
from stagereplay.stages.transplant import replay_fixed_prefixes

replay_fixed_prefixes(snakemake.input.prefixes, snakemake.input.selection, snakemake.output.baseline,
                      from_params(ReplaySettings, snakemake.params.kwargs))
