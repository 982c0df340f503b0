from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.engine import gather_engine_audit

gather_engine_audit(list(snakemake.input.parts), snakemake.output.audit)
