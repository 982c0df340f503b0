import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.prepare import prepare_model
from stagereplay.stages.settings import PrepareSettings, from_params

prepare_model(snakemake.output.model, from_params(PrepareSettings, snakemake.params.kwargs))
