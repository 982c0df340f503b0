from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.settings import DumpSettings, from_params
from stagereplay.stages.transplant import dump_caches

dump_caches(snakemake.input.baseline, snakemake.output.caches, snakemake.output.manifest,
            from_params(DumpSettings, snakemake.params.kwargs))
