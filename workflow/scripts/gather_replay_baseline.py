from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_ledger  # a replayed baseline is ledger rows

gather_ledger(list(snakemake.input.baseline), snakemake.output.baseline)
