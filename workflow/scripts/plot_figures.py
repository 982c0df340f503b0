from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import sys
from pathlib import Path

sys.stderr = open(snakemake.log[0], "w")

from stagereplay.analysis.figures import plot_figures
from stagereplay.analysis.inputs import by_revision

# Each input file's revision is the folder it lies in (results/<run>/<revision>/<file>); every other results file
# of the run on disk is drawn too (results_dir), so a figure never loses a result that exists.
inputs = {kind: by_revision(getattr(snakemake.input, kind)) for kind in snakemake.input.keys()}
# Outputs are named <figure>_<format>.
outputs = {}
for key, path in snakemake.output.items():
    name, fmt = key.rsplit("_", 1)
    outputs.setdefault(name, {})[fmt] = path
results_dir = Path(next(iter(snakemake.output))).parent.parent.parent
plot_figures(inputs, outputs, snakemake.params.seed, results_dir=str(results_dir))
