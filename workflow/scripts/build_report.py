from stagereplay.stages.rule_job import start_job

start_job(snakemake, warm=True)

from pathlib import Path

from stagereplay.analysis.inputs import by_revision
from stagereplay.analysis.report import build_report

# Each input file's revision is the folder it lies in (results/<run>/<revision>/<file>). Besides these declared
# inputs, build_report covers every results file of the run on disk (results_dir), so no result that exists is lost.
inputs = {kind: by_revision(getattr(snakemake.input, kind)) for kind in snakemake.input.keys()
          if kind not in ("figures", "item_browser")}
results_dir = Path(snakemake.output.report).parent.parent
build_report(inputs.pop("ledger", {}), snakemake.output.report, snakemake.output.stats, snakemake.params.run,
             snakemake.params.seed, inputs=inputs,
             figures=dict(zip(snakemake.params.figure_names, snakemake.input.figures)),
             results_dir=str(results_dir), item_browser=snakemake.input.item_browser,
             out_html=snakemake.output.report_html, not_run=snakemake.params.not_run,
             equivalence_margin=snakemake.params.equivalence_margin)
