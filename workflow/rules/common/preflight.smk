# Before the first job (only when there is work to do, and in a dry run): every check of the inputs that needs no
# weights, so that a bad input fails before Snakemake deletes any old output. See stagereplay.stages.preflight.
from stagereplay.models.store import ModelStore
from stagereplay.runtime.bytecode import uncompiled_note
from stagereplay.stages.preflight import PassedChecks, check_model_store, check_output_folders, check_run_once
from stagereplay.stages.rule_job import start_job_server, starts_warm

# A file where the run's folders go would fail Snakemake's own listing of them (NotADirectoryError), before any hook.
check_output_folders(RESULTS, LOGS, BENCH)


def jobs_run_here():
    """Whether the jobs run on this machine, so that the device they ask for must be here. A dry run runs with its
    own executor; Snakemake turns use_threads on where the executor asked for runs jobs elsewhere (snakemake.api)."""
    if workflow.dryrun:
        return not workflow.execution_settings.use_threads
    return workflow.local_exec


def preflight():
    note = uncompiled_note("torch")
    if note:
        logger.warning(note)
    checked = dict(
        config,
        model=resolve_path(config["model"]),
        dataset=dataset_config(),
        revisions=list(ALL_REVISIONS.values()),  # transplant-only revisions too
    )
    # A GGUF source is checked through a current snapshot of it in the model store where an earlier run left one
    # (seconds instead of reading the GGUF's metadata again; stagereplay.models.snapshot.checked_stand_in).
    store = ModelStore(STORE_ROOT)
    prepared = {
        name: [store.path(key) for key in snapshot_keys(slug, revision_precisions(slug)).values() if key]
        for slug, name in ALL_REVISIONS.items()
    }
    fingerprints = {name: model_files(name) for name in ALL_REVISIONS.values()}
    # every time, as the device: the store is the machine's, not the inputs'
    check_model_store(
        store, [key for slug in ALL_REVISIONS for key in snapshot_keys(slug, revision_precisions(slug)).values()]
    )
    # A check that passed on the very same inputs (by content) is not made again (stagereplay.stages.preflight,
    # inputs_key); the device is checked every time.
    summary = check_run_once(
        checked,
        jobs_run_here=jobs_run_here(),
        prepared=prepared,
        fingerprints=fingerprints,
        dataset_fingerprint=dataset_file(),
        passed=PassedChecks(),
    )
    stand_ins = [
        f"{name} through {info['checked_from']}"
        for name, info in summary["revisions"].items()
        if info["checked_from"] != "source"
    ]
    logger.info(
        f"Inputs checked: {summary['n_items']} items, revisions {sorted(summary['revisions'])}"
        + (f" (model {'; '.join(stand_ins)}, its prepared snapshot)" if stand_ins else "")
        + (
            f" (these same inputs passed the check at {summary['passed_at']}: not read again)"
            if "passed_at" in summary
            else ""
        )
    )


def runs_warm(job):
    """Whether ``job`` runs in the job server: its rule's script starts warm (stagereplay.stages.rule_job)."""
    script = job.rule.script
    return bool(script) and starts_warm(Path(job.rule.snakefile).parent / script)


def only_comparisons():
    """Whether this invocation builds comparisons alone (target compare, or files under results/compare/): those
    check the runs they read themselves (compare.smk), and the config's own run is none of them."""
    targets = workflow.dag_settings.targets
    return bool(targets) and all(
        t in ("compare", "compare_runs") or t.startswith(f"results/{COMPARE_FOLDER}/") for t in targets
    )


onstart:
    if not only_comparisons():
        check_results()
        preflight()
        prepare_entries_again()
        if not workflow.dryrun and jobs_run_here() and any(map(runs_warm, workflow.dag.needrun_jobs())):
            started = start_job_server(config)
            if started:
                logger.log(*started)
