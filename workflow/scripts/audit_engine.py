from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.engine import EngineReplaySettings, audit_engine
from stagereplay.stages.settings import from_params

audit_engine(snakemake.input.selection, snakemake.input.prefixes, snakemake.input.ledger, snakemake.output.audit,
             from_params(EngineReplaySettings, snakemake.params.kwargs))
