from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.controls import generate_fixed_prefix
from stagereplay.stages.settings import ControlSettings, from_params

generate_fixed_prefix(snakemake.input.selection, snakemake.input.prefixes, snakemake.output.ledger,
                      from_params(ControlSettings, snakemake.params.kwargs))
