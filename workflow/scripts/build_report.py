import sys

sys.stderr = open(snakemake.log[0], "w")

from stagereplay.report import build_report

build_report(dict(zip(snakemake.params.revisions, snakemake.input.ledgers)), snakemake.output.report,
             snakemake.output.stats, snakemake.params.run, snakemake.params.seed,
             transplants=dict(zip(snakemake.params.transplant_revisions, snakemake.input.transplants)),
             bridges=dict(zip(snakemake.params.revisions, snakemake.input.bridges)),
             audits=dict(zip(snakemake.params.revisions, snakemake.input.audits)),
             reference_precision=snakemake.params.reference_precision)
