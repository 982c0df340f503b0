from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from stagereplay.stages.controls import generate_fixed_prefix
from stagereplay.stages.settings import ControlSettings, from_params

generate_fixed_prefix(snakemake.input.selection, snakemake.input.prefixes, snakemake.output.ledger,
                      from_params(ControlSettings, snakemake.params.kwargs))
