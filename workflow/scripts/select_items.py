from stagereplay.stages.rule_job import start_job

start_job(snakemake)

from stagereplay.stages.select import select_items

select_items(snakemake.params.dataset, snakemake.params.n_items, snakemake.params.seed, snakemake.output.selection,
             answer_format=snakemake.params.answer_format, offline=snakemake.params.offline,
             dataset_file=snakemake.params.dataset_file)
