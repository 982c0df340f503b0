# Before the first job (only when there is work to do): every check of the inputs that needs no weights, so that a
# bad input fails before Snakemake deletes any old output. See stagereplay.stages.preflight.
from stagereplay.stages.preflight import check_run


def preflight():
    checked = dict(
        config,
        model=resolve_path(config["model"]),
        dataset=dataset_config(),
        revisions=list(ALL_REVISIONS.values()),  # transplant-only revisions too
    )
    summary = check_run(checked)
    logger.info(f"Inputs checked: {summary['n_items']} items, revisions {sorted(summary['revisions'])}")


onstart:
    preflight()
