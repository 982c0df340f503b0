# The input functions: what each job reads, by its wildcards. The model-store records a model-loading job takes
# as input are at the precisions it loads (its *_precisions function, also its params.snapshots: settings.smk); the
# per-shard parts a gather joins; the transplant baselines; the report's per-revision inputs.


# ---- Prepared models: the record of a revision's store entries, where a job loads the model at all ---------------
def job_precision(wildcards):
    return [wildcards.precision]


def generated_precisions(wildcards):
    return list(config["precisions"])


def transplant_precision(wildcards):
    return [TRANSPLANT_PRECISION]


def prepared(revision, precisions):
    return [prepared_folder(revision)] if precisions else []


def prepared_at_precision(wildcards):
    """The generation, the fixed-prefix 2x2 and the audit: the job's own precision."""
    return prepared(wildcards.revision, [wildcards.precision])


def prepared_at_all_precisions(wildcards):
    """Batch invariance: every precision of the generation."""
    return prepared(wildcards.revision, config["precisions"])


def dump_precisions(wildcards):
    """Every precision of the baseline: the primary's ledger holds all, a replayed baseline the transplant's."""
    if config["dump"]["items"] == "none":
        return []
    return config["precisions"] if wildcards.revision == PRIMARY else [TRANSPLANT_PRECISION]


def prepared_for_dumps(wildcards):
    return prepared(wildcards.revision, dump_precisions(wildcards))


def prepared_at_transplant_precision(wildcards):
    return prepared(wildcards.revision, [TRANSPLANT_PRECISION])


def minimal_transplant_precisions(wildcards):
    """None with the search off (budget 0: no model is loaded)."""
    return [] if config["transplant"]["minimal"]["budget"] == 0 else [TRANSPLANT_PRECISION]


def prepared_for_minimal_transplants(wildcards):
    return prepared(wildcards.revision, minimal_transplant_precisions(wildcards))


def baseline_precisions(wildcards):
    """Every precision of the transplant baseline: the primary's ledger holds all, a replayed baseline one."""
    return config["precisions"] if wildcards.revision == PRIMARY else [TRANSPLANT_PRECISION]


def prepared_at_baseline_precisions(wildcards):
    return prepared(wildcards.revision, baseline_precisions(wildcards))


def cache_difference_precisions(wildcards):
    settings = config["cache_differences"]
    return settings["precisions"] if settings["n_items"] > 0 else []


def prepared_for_cache_differences(wildcards):
    return prepared(wildcards.revision, cache_difference_precisions(wildcards))


# ---- Parts, baselines and the report's inputs ----------------------------------------------------------------------
_checked_in_dry_run = False


def preflight_in_dry_run(wildcards):
    """No file: select_items's input function, so that a dry run runs the preflight (preflight.smk) too. onstart
    runs in no dry run; input functions run while the DAG is built, dry runs included. Once per planning process:
    a job's own process (a cluster job parses the workflow again) is never a dry run."""
    global _checked_in_dry_run
    if workflow.dryrun and not workflow.execution_settings.no_hooks and not _checked_in_dry_run:
        _checked_in_dry_run = True
        logger.info("Dry run: checking the inputs as a run does before its first job (--no-hooks skips this)")
        try:
            check_results(dry_run=True)
            preflight()
        except Exception as exc:
            # Snakemake drops an input function's exception when the rule's output exists already (it needs no
            # producer then), so the dry run would plan on as if nothing were wrong: say it and stop here instead.
            logger.error(f"{type(exc).__name__}: {exc}")
            raise SystemExit(1) from exc
    return []


def shard_parts(wildcards, kind):
    """A revision's parts/<kind>_<precision>_<shard>.parquet, one per precision and shard of its generation."""
    return expand(
        f"{RESULTS}/{wildcards.revision}/parts/{kind}_{{precision}}_{{shard}}.parquet",
        precision=config["precisions"],
        shard=SHARDS,
    )


def shard_files(kind, suffix=".parquet"):
    """An input function: a revision's parts/<kind>_<shard><suffix>, one per shard (of a stage that splits by shard
    only, every precision in one job)."""

    def parts(wildcards):
        return expand(f"{RESULTS}/{wildcards.revision}/parts/{kind}_{{shard}}{suffix}", shard=SHARDS)

    return parts


def ledger_parts(wildcards):
    """The ledger's parts that gather_ledger joins: the matched experiment's rows, then the fixed-prefix 2x2's."""
    return shard_parts(wildcards, "matched") + shard_parts(wildcards, "fixed_prefix")


def prefix_parts(wildcards):
    return shard_parts(wildcards, "prefixes")


def bridge_parts(wildcards):
    return shard_parts(wildcards, "bridge")


def audit_parts(wildcards):
    return shard_parts(wildcards, "audit")


def fidelity_parts(wildcards):
    return shard_parts(wildcards, "fidelity")


def transplant_baseline(wildcards):
    """The file holding both constructions of the fixed prefixes at this revision, with their continuations, at
    every precision the revision ran (the dumps and the onset read each)."""
    if wildcards.revision == PRIMARY:
        return f"{RESULTS}/{PRIMARY}/ledger.parquet"
    return f"{RESULTS}/{wildcards.revision}/replay_baseline.parquet"


def transplant_baseline_at_precision(wildcards):
    """The transplant baseline's rows at the transplant precision, all that the selection, the transplants and the
    minimal search read: at the primary revision the ledger's rows at that precision (gather_transplant_baseline),
    so that they wait for that precision's generation and 2x2 only, not for every precision's."""
    if wildcards.revision == PRIMARY:
        return f"{RESULTS}/{PRIMARY}/parts/ledger_{TRANSPLANT_PRECISION}.parquet"
    return f"{RESULTS}/{wildcards.revision}/replay_baseline.parquet"


def ledger_parts_at_precision(wildcards):
    """The ledger's parts at one precision, in gather_ledger's order: the matched experiment's, then the 2x2's."""
    return [
        f"{RESULTS}/{wildcards.revision}/parts/{kind}_{wildcards.precision}_{shard}.parquet"
        for kind in ("matched", "fixed_prefix")
        for shard in SHARDS
    ]


def report_inputs(wildcards):
    """Per-revision files the report and the figures read, by kind: results/<run>/<revision>/<kind>.parquet."""
    return {
        kind: expand(f"{RESULTS}/{{revision}}/{kind}.parquet", revision=revisions)
        for kind, revisions in report_revisions().items()
    }
