from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.reconstruct import reconstruct_prefixes
from stagereplay.stages.settings import ReconstructSettings, from_params

reconstruct_prefixes(snakemake.input.selection, snakemake.output.ledger, snakemake.output.prefixes,
                     snakemake.output.bridge, from_params(ReconstructSettings, snakemake.params.kwargs))
