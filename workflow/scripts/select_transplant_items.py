import logging
import sys

sys.stderr = open(snakemake.log[0], "w")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

from stagereplay.stages.transplant_selection import select_transplant_items

select_transplant_items(snakemake.input.baseline, snakemake.output.selection, revision=snakemake.params.revision,
                        precision=snakemake.params.precision, select=snakemake.params.select,
                        seed=snakemake.params.seed, constructions=tuple(snakemake.params.constructions))
