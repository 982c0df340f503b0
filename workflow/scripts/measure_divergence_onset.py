from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.divergence_onset import measure_divergence_onset
from stagereplay.stages.settings import OnsetSettings, from_params

measure_divergence_onset(snakemake.input.baseline, snakemake.output.onset,
                         from_params(OnsetSettings, snakemake.params.kwargs))
