from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.gather import gather_caches

gather_caches(list(snakemake.input.manifests), list(snakemake.input.folders), snakemake.output.caches,
              snakemake.output.manifest)
