from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.reconstruct import reconstruct_prefixes
from stagereplay.stages.settings import ReconstructSettings, from_params

reconstruct_prefixes(snakemake.input.selection, snakemake.output.ledger, snakemake.output.prefixes,
                     snakemake.output.bridge, from_params(ReconstructSettings, snakemake.params.kwargs))
