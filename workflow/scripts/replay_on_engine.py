from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.engine import EngineReplaySettings, replay_on_engine
from stagereplay.stages.settings import from_params

replay_on_engine(snakemake.input.selection, snakemake.input.prefixes, snakemake.output.ledger,
                 from_params(EngineReplaySettings, snakemake.params.kwargs))
