from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.fidelity import measure_fidelity
from stagereplay.stages.settings import FidelitySettings, from_params

measure_fidelity(snakemake.input.selection, snakemake.input.ledger, snakemake.output.fidelity,
                 from_params(FidelitySettings, snakemake.params.kwargs))
