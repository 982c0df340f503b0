from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.controls import batch_invariance
from stagereplay.stages.settings import BatchInvarianceSettings, from_params

batch_invariance(snakemake.input.selection, snakemake.input.ledger, snakemake.output.table,
                 from_params(BatchInvarianceSettings, snakemake.params.kwargs))
