import sys

sys.stderr = open(snakemake.log[0], "w")

from stagereplay.analysis.figures import plot_figures

revisions = snakemake.params.revisions
inputs = {kind: dict(zip(revisions[kind], getattr(snakemake.input, kind))) for kind in snakemake.input.keys()}
# Outputs are named <figure>_<format>.
outputs = {}
for key, path in snakemake.output.items():
    name, fmt = key.rsplit("_", 1)
    outputs.setdefault(name, {})[fmt] = path
plot_figures(inputs, outputs, snakemake.params.seed)
