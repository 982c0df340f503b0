from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.settings import ReplaySettings, from_params
from stagereplay.stages.transplant import replay_fixed_prefixes

replay_fixed_prefixes(snakemake.input.prefixes, snakemake.input.selection, snakemake.output.baseline,
                      from_params(ReplaySettings, snakemake.params.kwargs))
