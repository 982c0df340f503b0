from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from pathlib import Path

from stagereplay.analysis.inputs import by_revision, merge_inputs
from stagereplay.stages.token_texts import build_item_browser

# Each input file's revision is the folder it lies in (results/<run>/<revision>/<file>); transplant files of the
# run found on disk but not declared (an earlier invocation's other revision) are shown too, as in the report.
results_dir = Path(snakemake.output.html).parent.parent
merged, _ = merge_inputs({"transplant": by_revision(snakemake.input.transplant)}, results_dir)
build_item_browser(snakemake.output.html, by_revision(snakemake.input.ledger), snakemake.params.tokenizers,
                   transplants=merged.get("transplant", {}), selection=snakemake.input.selection,
                   run=snakemake.params.run)
