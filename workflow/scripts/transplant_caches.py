from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.settings import TransplantSettings, from_params
from stagereplay.stages.transplant import transplant_caches

transplant_caches(snakemake.input.selection, snakemake.input.baseline, snakemake.output.transplant,
                  from_params(TransplantSettings, snakemake.params.kwargs))
