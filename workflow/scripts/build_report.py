import sys

sys.stderr = open(snakemake.log[0], "w")

from stagereplay.analysis.report import build_report

revisions = snakemake.params.revisions
inputs = {kind: dict(zip(revisions[kind], getattr(snakemake.input, kind))) for kind in snakemake.input.keys()
          if kind != "figures"}
build_report(inputs.pop("ledger"), snakemake.output.report, snakemake.output.stats, snakemake.params.run,
             snakemake.params.seed, inputs=inputs,
             figures=dict(zip(snakemake.params.figure_names, snakemake.input.figures)))
