# Helpers of the cache-dump and transplant stages (kept apart from their rules, as common.smk keeps its own).
# Transplants run at each of transplant.revisions on the primary revision's prefix ids: the primary's constructions
# and continuations come from its ledger, any other revision's from its own replay_baseline.parquet.
PRIMARY = revision_slug(config["revisions"][0])
# .get: a transplant block given on the command line lacks the keys whose default is null.
TRANSPLANT_PRECISION = config["transplant"].get("precision") or config["precisions"][0]
if TRANSPLANT_PRECISION not in config["precisions"]:
    raise ValueError(
        f"transplant.precision: {TRANSPLANT_PRECISION!r} is not among precisions {config['precisions']}; "
        "the fixed prefixes exist only at those precisions"
    )
TRANSPLANT_REVISIONS = {
    revision_slug(r): r
    for r in (config["transplant"].get("revisions") or config["revisions"][:1])
}
ALL_REVISIONS = dict(REVISIONS)
for _slug, _name in TRANSPLANT_REVISIONS.items():
    if ALL_REVISIONS.setdefault(_slug, _name) != _name:
        raise ValueError(
            f"transplant.revisions: {_name!r} and {ALL_REVISIONS[_slug]!r} share the folder name {_slug!r}; rename one"
        )
if config["batch_size"] > 1 and set(TRANSPLANT_REVISIONS) != {PRIMARY}:
    raise ValueError(
        f"transplant.revisions: {sorted(TRANSPLANT_REVISIONS)} with batch_size: {config['batch_size']}: at a "
        "revision other than the primary the transplants replay the primary's prefixes, which is not batched yet; "
        "transplant at the primary revision only, or run with batch_size: 1"
    )
REPORT_INPUTS["transplant"] = f"{RESULTS}/{{revision}}/transplant.parquet"
REPORT_REVISIONS["transplant"] = list(TRANSPLANT_REVISIONS)


def revision_name(wildcards):
    return ALL_REVISIONS[wildcards.revision]


def transplant_baseline(wildcards):
    """The file holding both constructions of the fixed prefixes at this revision, with their continuations."""
    if wildcards.revision == PRIMARY:
        return f"{RESULTS}/{PRIMARY}/ledger.parquet"
    return f"{RESULTS}/{wildcards.revision}/replay_baseline.parquet"


def replay_model_kwargs(wildcards):
    """Model settings of the dump and transplant stages: the generation's, without items, shards or budgets."""
    return dict(
        model=resolve_path(config["model"]),
        revision=ALL_REVISIONS[wildcards.revision],
        device=config["device"],
        attn_implementation=config["attn_implementation"],
        threads=config["threads"],
        trust_remote_code=config["trust_remote_code"],
        allow_pickle=config["allow_pickle"],
        offline=config["offline"],
    )


def dump_kwargs(wildcards):
    """A batched baseline's rows are rebuilt in their batch, which continues them: the suffix budget too."""
    return dict(replay_model_kwargs(wildcards), max_new_tokens=config["max_new_tokens"])


def baseline_kwargs(wildcards):
    return dict(
        replay_model_kwargs(wildcards),
        precision=TRANSPLANT_PRECISION,
        max_new_tokens=config["max_new_tokens"],
        answer_format=config["answer_format"],
        stage_end=config["stage_end"],
    )


def transplant_kwargs(wildcards):
    return dict(
        replay_model_kwargs(wildcards),
        precision=TRANSPLANT_PRECISION,
        max_new_tokens=config["max_new_tokens"],
        sweeps=config["transplant"]["sweeps"],
    )


def transplants():
    return expand(
        f"{RESULTS}/{{revision}}/transplant.parquet", revision=TRANSPLANT_REVISIONS
    )
