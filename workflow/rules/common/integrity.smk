# Before the first job: every results file of the run still has the bytes it was written with, and was made by this
# run's jobs from this run's inputs. A damaged file has a new mtime, so Snakemake would rerun (and first delete the
# outputs of) every job downstream of it, each failing on the damaged input; a file copied in from another run (with
# its record: cp -a, rsync) would be read as this run's by every job downstream of it. This stops the run instead,
# naming the file. See stagereplay.stages.integrity and stagereplay.io.bindings.
from stagereplay.stages.integrity import (
    PlannedJob,
    foreign_files,
    foreign_inputs,
    refresh_records,
    refuse_foreign,
    store_entries,
    summary,
    verify_results,
)


def planned_jobs():
    """The jobs Snakemake will not run: their outputs are read as this run's (a job that reruns writes its own)."""
    dag = workflow.dag
    return [
        PlannedJob(job.rule.name, dict(job.params.items()), list(job.input), list(job.output))
        for job in dag.jobs
        if not dag.needrun(job)
    ]


def check_results(dry_run=False):
    """A dry run only reads: it leaves the records of touched files as they are. It plans before any hook could see
    the jobs, so it compares each file's recorded inputs alone; the run compares settings too."""
    checked = verify_results(RESULTS, refresh=False)
    refuse_foreign(foreign_inputs(RESULTS) if dry_run else foreign_files(planned_jobs(), RESULTS))
    if not dry_run:  # only once every file passed: a refused run changes nothing
        refresh_records(checked)
    logger.info(summary(RESULTS, checked))
    for line in store_entries(RESULTS):
        logger.warning(line)
