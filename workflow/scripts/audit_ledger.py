from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.controls import audit_ledger
from stagereplay.stages.settings import ControlSettings, from_params

audit_ledger(snakemake.input.selection, snakemake.input.ledger, snakemake.output.audit,
             from_params(ControlSettings, snakemake.params.kwargs))
