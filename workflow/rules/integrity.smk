# Before the first job: every results file of the run still has the bytes it was written with. A damaged file has a
# new mtime, so Snakemake would rerun (and first delete the outputs of) every job downstream of it, each failing on
# the damaged input; this stops the run instead, naming the file. See stagereplay.stages.integrity.
from stagereplay.stages.integrity import store_entries, summary, verify_results


def check_results(dry_run=False):
    """A dry run only reads: it leaves the records of touched files as they are."""
    checked = verify_results(RESULTS, refresh=not dry_run)
    logger.info(summary(RESULTS, checked))
    for line in store_entries(RESULTS):
        logger.warning(line)
