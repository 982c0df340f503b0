from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_ledger, gather_prefixes

gather_ledger(list(snakemake.input.ledger), snakemake.output.ledger)
gather_prefixes(list(snakemake.input.prefixes), snakemake.output.prefixes)
