import sys

sys.stderr = open(snakemake.log[0], "w")

from stagereplay.control_stages import gather_audit

gather_audit(list(snakemake.input.audit), snakemake.output.audit)
