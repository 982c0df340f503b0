from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.prepare import prepare_model
from stagereplay.stages.settings import PrepareSettings, from_params

# The store's folder is read from the config, not the params: where the store is changes no result.
settings = from_params(PrepareSettings, dict(snakemake.params.kwargs, model_store=snakemake.config.get("model_store")))
prepare_model(snakemake.output.record, settings)
