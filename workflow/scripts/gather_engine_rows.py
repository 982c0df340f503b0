from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.engine import gather_engine_rows

gather_engine_rows(snakemake.wildcards.engine, list(snakemake.input.parts), snakemake.output.ledger)
