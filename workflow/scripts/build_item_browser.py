from stagereplay.runtime.job_server import hand_over

hand_over(snakemake.config)  # job_server: true runs the rest in a warm server's child

import sys
from pathlib import Path

sys.stderr = open(snakemake.log[0], "w")

from stagereplay.analysis.inputs import by_revision, merge_inputs
from stagereplay.stages.token_texts import build_item_browser

# Each input file's revision is the folder it lies in (results/<run>/<revision>/<file>); transplant files of the
# run found on disk but not declared (an earlier invocation's other revision) are shown too, as in the report.
results_dir = Path(snakemake.output.html).parent.parent
merged, _ = merge_inputs({"transplant": by_revision(snakemake.input.transplant)}, results_dir)
build_item_browser(snakemake.output.html, by_revision(snakemake.input.ledger), snakemake.params.tokenizers,
                   transplants=merged.get("transplant", {}), selection=snakemake.input.selection,
                   run=snakemake.params.run)
