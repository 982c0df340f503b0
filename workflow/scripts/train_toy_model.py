from stagereplay.stages.rule_job import start_job

start_job(snakemake)

import json
import sys
from pathlib import Path

from stagereplay.io.parquet import write_text_atomic
from stagereplay.data.toy import check_reproduced, reproduce_revision

root = Path(snakemake.output.weights).parent.parent
reproduce_revision(snakemake.wildcards.toy_revision, root)
# Raises, failing the job, when the weights are not the shipped ones: fingerprint_check.json exists only for a match.
result = check_reproduced(snakemake.wildcards.toy_revision, root, snakemake.params.shipped)
write_text_atomic(snakemake.output.check, json.dumps(result, indent=2) + "\n")
print(json.dumps(result), file=sys.stderr)
