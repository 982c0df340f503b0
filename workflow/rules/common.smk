# Helpers, config validation and input functions shared by every rule.
import os
from pathlib import Path

from snakemake.utils import validate

import stagereplay
from stagereplay.models.loading import revision_slug
from stagereplay.preflight import check_decode_settings

validate(config, schema="../schemas/config.schema.yaml", set_default=True)

RUN = config["run"]
RESULTS = f"results/{RUN}"
LOGS = f"logs/{RUN}"
BENCH = f"benchmarks/{RUN}"
REPO = Path(workflow.basedir)
# Results depend on the package as much as on the adapter scripts; its version in params reruns jobs on upgrade.
CODE_VERSION = stagereplay.__version__

REVISIONS = {revision_slug(r): r for r in config["revisions"]}
if len(REVISIONS) != len(config["revisions"]):
    raise ValueError(
        f"revisions: {config['revisions']} map to clashing folder names {sorted(REVISIONS)}; rename them"
    )
SHARDS = list(range(config["shards"]))
check_decode_settings(
    config["batch_size"],
    config["decode_regime"],
    config["decode_attention"],
    config["decode_prefill_group"],
)
if (
    config["boundary"].get("token_id") is not None
    and config["boundary"].get("marker") == "</think>"
):
    config["boundary"][
        "marker"
    ] = None  # the token id was given: the schema's default marker does not apply


def resolve_path(path):
    """A config path, relative to the working directory, else to the repository (where data/ ships)."""
    if path is None or os.path.isabs(path) or os.path.exists(path):
        return path
    shipped = REPO / path
    return str(shipped) if shipped.exists() else path


def generation_kwargs(revision):
    """The generation's settings at one revision, for every stage that runs the model as it did."""
    return dict(
        model=resolve_path(config["model"]),
        revision=REVISIONS[revision],
        boundary=config["boundary"],
        max_stage_tokens=config["max_stage_tokens"],
        max_new_tokens=config["max_new_tokens"],
        threads=config["threads"],
        device=config["device"],
        attn_implementation=config["attn_implementation"],
        decode_regime=config["decode_regime"],
        decode_attention=config["decode_attention"],
        decode_prefill_group=config["decode_prefill_group"],
        batch_size=config["batch_size"],
        batch_seed=config["batch_seed"],
        numerics=config["numerics"],
        answer_format=config["answer_format"],
        stage_end=config["stage_end"],
        prompt=config["prompt"],
        trust_remote_code=config["trust_remote_code"],
        allow_pickle=config["allow_pickle"],
        offline=config["offline"],
        seed=config["seed"],
    )


def model_kwargs(wildcards):
    return dict(
        generation_kwargs(wildcards.revision),
        precision=wildcards.precision,
        shard=int(wildcards.shard),
        n_shards=config["shards"],
    )


def dataset_config():
    dataset = dict(config["dataset"])
    if dataset.get("path"):
        dataset["path"] = resolve_path(dataset["path"])
    return dataset


# Ledger parts that gather_ledger joins into ledger.parquet; a stage that adds ledger rows appends its pattern
# (with {revision}, {precision}, {shard} placeholders) in its own .smk file.
LEDGER_PARTS = [f"{RESULTS}/{{revision}}/parts/matched_{{precision}}_{{shard}}.parquet"]
# Files of every stage that `rule all` asks for; each stage's .smk appends its own.
TARGETS = []


def ledger_parts(wildcards):
    return [
        part.format(revision=wildcards.revision, precision=precision, shard=shard)
        for part in LEDGER_PARTS
        for precision in config["precisions"]
        for shard in SHARDS
    ]


def prefix_parts(wildcards):
    return expand(
        f"{RESULTS}/{wildcards.revision}/parts/prefixes_{{precision}}_{{shard}}.parquet",
        precision=config["precisions"],
        shard=SHARDS,
    )


def ledgers():
    return expand(f"{RESULTS}/{{revision}}/ledger.parquet", revision=REVISIONS)


def all_outputs():
    return [
        f"{RESULTS}/selection/items.parquet",
        *expand(f"{RESULTS}/{{revision}}/prefixes.parquet", revision=REVISIONS),
        *ledgers(),
        f"{RESULTS}/report/report.md",
        f"{RESULTS}/report/stats.json",
        *TARGETS,
    ]


# Per-revision files the report and the figures read, by kind. A stage whose output they should show registers its
# pattern from its own .smk, e.g. REPORT_INPUTS["bridge"] = f"{RESULTS}/{{revision}}/bridge.parquet"; the report
# skips, with a note, the sections of a kind that is not registered.
REPORT_INPUTS = {"ledger": f"{RESULTS}/{{revision}}/ledger.parquet"}
# Revisions each kind exists for (default: every generated revision); transplants may run at more revisions.
REPORT_REVISIONS = {}
FIGURE_NAMES = [
    "fig1_disagreement",
    "fig2_first_divergence",
    "fig3_margins",
    "fig4_cache_differences",
    "fig5_transplant",
    "fig6_accuracy",
]


def report_inputs(wildcards):
    return {
        kind: expand(pattern, revision=REPORT_REVISIONS.get(kind, REVISIONS))
        for kind, pattern in REPORT_INPUTS.items()
    }


def report_revisions():
    return {kind: list(REPORT_REVISIONS.get(kind, REVISIONS)) for kind in REPORT_INPUTS}


def figure_files(fmt):
    return [f"{RESULTS}/report/figures/{name}.{fmt}" for name in FIGURE_NAMES]


def cache_difference_kwargs(wildcards):
    settings = config["cache_differences"]
    return dict(
        model=resolve_path(config["model"]),
        revision=REVISIONS[wildcards.revision],
        revision_slug=wildcards.revision,
        precisions=settings["precisions"],
        prefix_precision=settings.get("prefix_precision") or config["precisions"][0],  # null defaults go unset
        n_items=settings["n_items"],
        seed=config["seed"],
        threads=config["threads"],
        device=config["device"],
        attn_implementation=config["attn_implementation"],
        trust_remote_code=config["trust_remote_code"],
        allow_pickle=config["allow_pickle"],
        offline=config["offline"],
    )
