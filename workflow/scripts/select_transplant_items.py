from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.transplant_selection import select_transplant_items

select_transplant_items(snakemake.input.baseline, snakemake.output.selection, revision=snakemake.params.revision,
                        precision=snakemake.params.precision, select=snakemake.params.select,
                        seed=snakemake.params.seed, constructions=tuple(snakemake.params.constructions))
