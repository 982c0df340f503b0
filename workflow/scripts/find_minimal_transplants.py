from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.minimal_transplant import find_minimal_transplants
from stagereplay.stages.settings import MinimalTransplantSettings, from_params

find_minimal_transplants(snakemake.input.selection, snakemake.input.baseline, snakemake.output.minimal,
                         from_params(MinimalTransplantSettings, snakemake.params.kwargs))
