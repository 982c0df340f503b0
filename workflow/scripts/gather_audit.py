from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_audit

gather_audit(list(snakemake.input.audit), snakemake.output.audit)
