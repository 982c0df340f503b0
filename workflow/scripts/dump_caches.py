from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.settings import DumpSettings, from_params
from stagereplay.stages.transplant import dump_caches

dump_caches(snakemake.input.baseline, snakemake.output.caches, snakemake.output.manifest,
            from_params(DumpSettings, snakemake.params.kwargs))
