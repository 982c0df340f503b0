from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.engine import gather_engine_llama_cpp_audit

gather_engine_llama_cpp_audit(list(snakemake.input.parts), snakemake.output.audit)
