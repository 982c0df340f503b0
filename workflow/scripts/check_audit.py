import sys

from stagereplay.experiments.audit import AuditFailedError
from stagereplay.stages.gather import check_audit

# The failure goes to the terminal as well as to the log: the rows that did not reproduce must be seen.
with open(snakemake.log[0], "w") as log:
    try:
        print(check_audit(snakemake.input.audit, snakemake.input.ledger, snakemake.output.check), file=log)
    except AuditFailedError as exc:
        print(f"AUDIT FAILED: {exc}", file=log)
        print(f"AUDIT FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
