from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from pathlib import Path

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
