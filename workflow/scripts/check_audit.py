from stagereplay.stages.rule_job import start_job

start_job(snakemake)

import sys

from stagereplay.experiments.audit import AuditFailedError
from stagereplay.stages.gather import check_audit

# The failure goes to the terminal as well as to the log: the rows that did not reproduce must be seen.
try:
    print(check_audit(snakemake.input.audit, snakemake.input.ledger, snakemake.output.check), file=sys.stderr)
except AuditFailedError as exc:
    for stream in (sys.stderr, sys.__stderr__):
        print(f"AUDIT FAILED: {exc}", file=stream)
    sys.exit(1)
