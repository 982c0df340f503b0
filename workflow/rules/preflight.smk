# Before the first job (only when there is work to do, and in a dry run): every check of the inputs that needs no
# weights, so that a bad input fails before Snakemake deletes any old output. See stagereplay.stages.preflight.
from stagereplay.stages.preflight import check_output_folders, check_run

# A file where the run's folders go would fail Snakemake's own listing of them (NotADirectoryError), before any hook.
check_output_folders(RESULTS, LOGS, BENCH)


def jobs_run_here():
    """Whether the jobs run on this machine, so that the device they ask for must be here. A dry run runs with its
    own executor; Snakemake turns use_threads on where the executor asked for runs jobs elsewhere (snakemake.api)."""
    if workflow.dryrun:
        return not workflow.execution_settings.use_threads
    return workflow.local_exec


def preflight():
    checked = dict(
        config,
        model=resolve_path(config["model"]),
        dataset=dataset_config(),
        revisions=list(ALL_REVISIONS.values()),  # transplant-only revisions too
    )
    summary = check_run(checked, jobs_run_here=jobs_run_here())
    logger.info(f"Inputs checked: {summary['n_items']} items, revisions {sorted(summary['revisions'])}")


onstart:
    check_results()
    preflight()
