from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.controls import batch_invariance
from stagereplay.stages.settings import BatchInvarianceSettings, from_params

batch_invariance(snakemake.input.selection, snakemake.input.ledger, snakemake.output.table,
                 from_params(BatchInvarianceSettings, snakemake.params.kwargs))
