from stagereplay.stages.rule_job import start_job

start_job(snakemake)

import sys
from pathlib import Path

from stagereplay.stages.compare import CompareError, compare_runs

# A refused run is named on the terminal as well as in the log.
try:
    compare_runs(snakemake.wildcards.name, snakemake.params.runs, snakemake.output.report, snakemake.output.stats,
                 str(Path(snakemake.output.report).parent / "figures"))
except CompareError as exc:
    for stream in (sys.stderr, sys.__stderr__):
        print(f"COMPARISON REFUSED: {exc}", file=stream)
    sys.exit(1)
