# Config validation and checks, the constants derived from the config, the model settings and input functions shared
# by the rules, and the workflow's targets: all defined here, so no stage's .smk depends on the order of the includes.
import copy
import os
from pathlib import Path
from types import SimpleNamespace

import yaml
from snakemake.utils import update_config, validate

import stagereplay
from stagereplay.config import (
    canonical,
    check_boundary,
    check_boundary_set,
    check_transplant_pair,
    typed_command_line_values,
)
from stagereplay.data.prompts import check_template
from stagereplay.analysis.captions import CAPTIONS
from stagereplay.models.sources import revision_slug
from stagereplay.models.sources import ModelLoadError, resolve_source
from stagereplay.models.store import ModelStore, planned_keys, read_record, resolve_root
from stagereplay.stages.preflight import check_decode_settings, check_prefix_precision
from stagereplay.stages.prepare import prepare_again
from stagereplay.stages.settings import PrepareSettings, from_params
from stagereplay.io.file_hashes import HashCache
from stagereplay.stages.input_fingerprints import dataset_file_fingerprint, model_fingerprint
from stagereplay.analysis.compare import FIGURES as COMPARE_FIGURES
from stagereplay.stages.compare import COMPARE_FOLDER, FORMATS as COMPARE_FORMATS, run_folders, run_state

# ---- Config: validation, checks across keys, constants ---------------------------------------------------------------
# Snakemake leaves the scalars of a nested --config value strings (bridge={n_rows: 2}): typed by the schema first.
SCHEMA = yaml.safe_load((Path(workflow.basedir) / "workflow/schemas/config.schema.yaml").read_text())
_command_line = typed_command_line_values(dict(workflow.config_settings.config), SCHEMA)
update_config(config, _command_line)
# The values the user gave (--configfile, --config): once defaults are filled in, a key set cannot be told apart.
_given = copy.deepcopy(dict(workflow.config_settings.overwrite_config))
update_config(_given, _command_line)
check_boundary(_given.get("boundary"))
validate(config, schema="../schemas/config.schema.yaml", set_default=True)
check_template(config["prompt"].get("template"))
# Params are compared by their repr: every mapping in sorted key order, whatever order the config files give.
for _key in list(config):
    config[_key] = canonical(config[_key])

RUN = config["run"]
RESULTS = f"results/{RUN}"
LOGS = f"logs/{RUN}"
BENCH = f"benchmarks/{RUN}"
REPO = Path(workflow.basedir)
# Results depend on the package as much as on the adapter scripts; its version in params reruns jobs on upgrade.
CODE_VERSION = stagereplay.__version__

REVISIONS = {revision_slug(r): r for r in config["revisions"]}
if len(REVISIONS) != len(config["revisions"]):
    raise ValueError(f"revisions: {config['revisions']} map to clashing folder names {sorted(REVISIONS)}; rename them")
SHARDS = list(range(config["shards"]))
check_decode_settings(
    config["batch_size"],
    config["decode_regime"],
    config["decode_attention"],
    config["decode_prefill_group"],
    config["decode_kernels"],
)
if config["boundary"].get("token_id") is not None:
    # The user gave no marker with it (check_boundary): the default's marker does not apply.
    config["boundary"]["marker"] = None
check_boundary_set(config["boundary"])
if config["reference_precision"] not in config["precisions"]:
    raise ValueError(
        f"reference_precision: {config['reference_precision']!r} is not one of precisions "
        f"{config['precisions']}; the fixed-prefix 2x2 takes its prefixes from that precision's generation"
    )
check_prefix_precision(config["cache_differences"].get("prefix_precision"), config["precisions"])

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
TRANSPLANT_REVISIONS = {revision_slug(r): r for r in (config["transplant"].get("revisions") or config["revisions"][:1])}
if PRIMARY in TRANSPLANT_REVISIONS:  # its transplant baseline is its ledger: the pair must be among what ran
    check_transplant_pair(config["transplant"]["constructions"], config["fixed_prefix"]["constructions"])
# Fidelity along the suffix runs at every generated revision, unless fidelity.constructions is empty.
FIDELITY_REVISIONS = dict(REVISIONS) if config["fidelity"]["constructions"] else {}
# Every revision some stage runs at: the generated ones, then transplant-only ones.
ALL_REVISIONS = dict(REVISIONS)
for _slug, _name in TRANSPLANT_REVISIONS.items():
    if ALL_REVISIONS.setdefault(_slug, _name) != _name:
        raise ValueError(
            f"transplant.revisions: {_name!r} and {ALL_REVISIONS[_slug]!r} share the folder name {_slug!r}; rename one"
        )


wildcard_constraints:
    revision="[A-Za-z0-9._-]+",
    precision="bf16|fp32|fp16",
    shard=r"\d+",


# ---- Paths and the dataset -------------------------------------------------------------------------------------------
def resolve_path(path):
    """A config path, relative to the working directory, else to the repository (where data/ ships)."""
    if path is None or os.path.isabs(path) or os.path.exists(path):
        return path
    shipped = REPO / path
    return str(shipped) if shipped.exists() else path


def dataset_config():
    dataset = dict(config["dataset"])
    if dataset.get("path"):
        dataset["path"] = resolve_path(dataset["path"])
    return dataset


# ---- The inputs by content: a changed dataset file or model file changes the params of the jobs that read it, so
# Snakemake reruns them (a file only touched changes nothing). Digests are remembered by size and mtime.
FILE_HASHES = HashCache()
_MODEL_FINGERPRINTS = {}


def dataset_file():
    fingerprint = dataset_file_fingerprint(dataset_config(), cache=FILE_HASHES)
    FILE_HASHES.save()
    return fingerprint


def model_files(revision_name):
    """The fingerprint of one revision's model files, taken once per workflow run."""
    if revision_name not in _MODEL_FINGERPRINTS:
        _MODEL_FINGERPRINTS[revision_name] = model_fingerprint(
            resolve_path(config["model"]), revision_name, cache=FILE_HASHES
        )
        FILE_HASHES.save()
    return _MODEL_FINGERPRINTS[revision_name]


# ---- Model settings: the params.kwargs of the stages that load a model -----------------------------------------------
def generation_kwargs(revision):
    """The generation's settings at one revision, for every stage that runs the model as it did."""
    return dict(
        model=resolve_path(config["model"]),
        revision=REVISIONS[revision],
        model_fingerprint=model_files(REVISIONS[revision]),
        prepared_models=prepared_folder(revision),
        boundary=config["boundary"],
        max_stage_tokens=config["max_stage_tokens"],
        max_new_tokens=config["max_new_tokens"],
        threads=config["threads"],
        device=config["device"],
        attn_implementation=config["attn_implementation"],
        decode_regime=config["decode_regime"],
        decode_attention=config["decode_attention"],
        decode_prefill_group=config["decode_prefill_group"],
        decode_kernels=config["decode_kernels"],
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


def shard_of(wildcards):
    """A later model stage's shard: it takes every n_shards-th batch of the recorded plan, as the generation does."""
    return {"shard": int(wildcards.shard), "n_shards": config["shards"]}


def chunked(constructions):
    """chunk_size, where one of a job's constructions is chunked: elsewhere it changes no result, and in the job's
    params it would rerun the job."""
    return {"chunk_size": config["chunk_size"]} if "chunked" in constructions else {}


def model_kwargs(wildcards):
    """reconstruct_prefixes: the generation's settings at one precision and shard, and the bridge rows."""
    return canonical(
        dict(
            generation_kwargs(wildcards.revision),
            precision=wildcards.precision,
            shard=int(wildcards.shard),
            n_shards=config["shards"],
            bridge=config["bridge"],
        )
    )


def fixed_prefix_kwargs(wildcards):
    """The fixed-prefix 2x2 and the audit."""
    return canonical(
        dict(
            generation_kwargs(wildcards.revision),
            precision=wildcards.precision,
            shard=int(wildcards.shard),
            n_shards=config["shards"],
            reference_precision=config["reference_precision"],
            fixed_prefix_constructions=list(config["fixed_prefix"]["constructions"]),
            **chunked(config["fixed_prefix"]["constructions"]),
        )
    )


def fidelity_kwargs(wildcards):
    """The generation's settings at one precision and shard (the live reference is regenerated as it ran), and the
    constructions and items compared."""
    settings = config["fidelity"]
    return canonical(
        dict(
            generation_kwargs(wildcards.revision),
            precision=wildcards.precision,
            shard=int(wildcards.shard),
            n_shards=config["shards"],
            constructions=list(settings["constructions"]),
            items=settings["items"],
            items_seed=settings["seed"],
            **chunked(settings["constructions"]),
        )
    )


def batch_invariance_kwargs(wildcards):
    """Model settings of the generation (every precision in one job), and the control's sample."""
    return canonical(
        dict(
            generation_kwargs(wildcards.revision),
            precisions=config["precisions"],
            sample=config["batch_invariance"]["sample"],
            sample_seed=config["batch_invariance"]["seed"],
            **shard_of(wildcards),
        )
    )


def cache_difference_kwargs(wildcards):
    settings = config["cache_differences"]
    return canonical(
        dict(
            model=resolve_path(config["model"]),
            revision=REVISIONS[wildcards.revision],
            model_fingerprint=model_files(REVISIONS[wildcards.revision]),
            prepared_models=prepared_folder(wildcards.revision),
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
            **shard_of(wildcards),
        )
    )


def replay_model_kwargs(wildcards):
    """Model settings of the dump and transplant stages: the generation's, without items, shards or budgets."""
    return canonical(
        dict(
            model=resolve_path(config["model"]),
            revision=ALL_REVISIONS[wildcards.revision],
            model_fingerprint=model_files(ALL_REVISIONS[wildcards.revision]),
            prepared_models=prepared_folder(wildcards.revision),
            device=config["device"],
            attn_implementation=config["attn_implementation"],
            threads=config["threads"],
            trust_remote_code=config["trust_remote_code"],
            allow_pickle=config["allow_pickle"],
            offline=config["offline"],
        )
    )


def dump_kwargs(wildcards):
    """A batched baseline's rows are rebuilt in their batch, which continues them: the suffix budget too."""
    return canonical(
        dict(
            replay_model_kwargs(wildcards),
            items=config["dump"]["items"],
            max_new_tokens=config["max_new_tokens"],
            constructions=list(config["transplant"]["constructions"]),
            **shard_of(wildcards),
            **chunked(config["transplant"]["constructions"]),
        )
    )


def baseline_kwargs(wildcards):
    return canonical(
        dict(
            replay_model_kwargs(wildcards),
            precision=TRANSPLANT_PRECISION,
            max_new_tokens=config["max_new_tokens"],
            answer_format=config["answer_format"],
            stage_end=config["stage_end"],
            constructions=list(config["transplant"]["constructions"]),
            **shard_of(wildcards),
            **chunked(config["transplant"]["constructions"]),
        )
    )


def transplant_kwargs(wildcards):
    return canonical(
        dict(
            replay_model_kwargs(wildcards),
            precision=TRANSPLANT_PRECISION,
            max_new_tokens=config["max_new_tokens"],
            sweeps=config["transplant"]["sweeps"],
            constructions=list(config["transplant"]["constructions"]),
            **shard_of(wildcards),
            **chunked(config["transplant"]["constructions"]),
        )
    )


def minimal_transplant_kwargs(wildcards):
    return canonical(
        dict(
            replay_model_kwargs(wildcards),
            precision=TRANSPLANT_PRECISION,
            max_new_tokens=config["max_new_tokens"],
            budget=config["transplant"]["minimal"]["budget"],
            constructions=list(config["transplant"]["constructions"]),
            **shard_of(wildcards),
            **chunked(config["transplant"]["constructions"]),
        )
    )


def onset_kwargs(wildcards):
    """Both transplant constructions of every divergent item, rebuilt in their batch (which continues them)."""
    return canonical(
        dict(
            replay_model_kwargs(wildcards),
            max_new_tokens=config["max_new_tokens"],
            constructions=list(config["transplant"]["constructions"]),
            **shard_of(wildcards),
            **chunked(config["transplant"]["constructions"]),
        )
    )


def revision_name(wildcards):
    return ALL_REVISIONS[wildcards.revision]


# ---- Prepared models: each revision's model source kept prepared in the model store, shared by runs
# (stagereplay.models.store); rule prepare_model writes the run's record of the entries it uses
# (results/<run>/models/<revision>.json), which a model-loading job takes as input and finds under its
# params.kwargs.prepared_models. An entry removed from the store plans nothing (the run prepares it again before its
# first job, byte for byte the recorded snapshot: prepare.smk); a new record (another source, converter or set of
# precisions) reruns what loaded the old one. The record is not ancient(): Snakemake masks a job whose input is
# produced by a job that reruns, so an ancient record would hide the job's own changed params (the entries' keys) and
# keep stale results.
STORE_ROOT = resolve_root(config.get("model_store"))


def prepared_folder(revision):
    """The run's record of the revision's store entries."""
    return f"{RESULTS}/models/{revision}.json"


def revision_precisions(revision):
    """Every precision some stage loads the revision at: the generated revisions at every precision (and the cache
    differences'), a transplant-only revision at the transplant's."""
    if revision in REVISIONS:
        precisions = list(config["precisions"])
        precisions += [p for p in config["cache_differences"]["precisions"] if p not in precisions]
        return precisions
    return [TRANSPLANT_PRECISION]


def source_kind(revision_name):
    try:
        return resolve_source(resolve_path(config["model"]), revision_name).kind
    except ModelLoadError:
        return None  # the preflight names why


_SNAPSHOT_KEYS = {}


def snapshot_keys(revision, precisions):
    """{precision: store key} of what a job at ``precisions`` loads: its params, so that another source or another
    converter reruns it (and only it). Taken once per revision and precisions in a workflow run (each key reads the
    converters' installed versions)."""
    if (revision, tuple(precisions)) not in _SNAPSHOT_KEYS:
        name = ALL_REVISIONS[revision]
        _SNAPSHOT_KEYS[revision, tuple(precisions)] = planned_keys(model_files(name), source_kind(name), precisions)
    return dict(_SNAPSHOT_KEYS[revision, tuple(precisions)])


def prepare_kwargs(wildcards):
    return canonical(
        dict(
            model=resolve_path(config["model"]),
            revision=ALL_REVISIONS[wildcards.revision],
            model_fingerprint=model_files(ALL_REVISIONS[wildcards.revision]),
            precisions=revision_precisions(wildcards.revision),
            threads=config["threads"],
            trust_remote_code=config["trust_remote_code"],
            allow_pickle=config["allow_pickle"],
            offline=config["offline"],
        )
    )


def prepare_keys(wildcards):
    return canonical(snapshot_keys(wildcards.revision, revision_precisions(wildcards.revision)))


def prepare_entries_again():
    """Before the first job (onstart): the store entries of the run's records that are gone or damaged, prepared
    again by the prepare stage and refused unless each is the recorded snapshot. No job is planned for them: a rerun
    of prepare_model would rerun every job that loads the model. A record whose keys are not the planned ones is
    left to prepare_model, which reruns for it (its params changed)."""
    for revision in ALL_REVISIONS:
        record = prepared_folder(revision)
        if not os.path.isfile(record):
            continue
        wildcards = SimpleNamespace(revision=revision)
        recorded = {precision: entry["key"] for precision, entry in read_record(record).get("snapshots", {}).items()}
        if recorded != prepare_keys(wildcards):
            continue
        settings = from_params(PrepareSettings, dict(prepare_kwargs(wildcards), model_store=config.get("model_store")))
        again = prepare_again(record, settings, FILE_HASHES)
        if again:
            logger.info(f"Store entries of {revision} at {', '.join(again)} prepared again, each the recorded snapshot")


def job_precision(wildcards):
    return [wildcards.precision]


def generated_precisions(wildcards):
    return list(config["precisions"])


def transplant_precision(wildcards):
    return [TRANSPLANT_PRECISION]


def snapshots_of(precisions_of):
    """A params function: {precision: store key} of the snapshots a job loads, at ``precisions_of(wildcards)``."""

    def keys(wildcards):
        return canonical(snapshot_keys(wildcards.revision, precisions_of(wildcards)))

    return keys


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


# ---- Input functions -------------------------------------------------------------------------------------------------
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


# Snakemake's priority of the transplant rules (transplant.smk says why); the others have 0.
TRANSPLANT_PRIORITY = 1


def ledger_parts_at_precision(wildcards):
    """The ledger's parts at one precision, in gather_ledger's order: the matched experiment's, then the 2x2's."""
    return [
        f"{RESULTS}/{wildcards.revision}/parts/{kind}_{wildcards.precision}_{shard}.parquet"
        for kind in ("matched", "fixed_prefix")
        for shard in SHARDS
    ]


# ---- Targets: everything `rule all` asks for -------------------------------------------------------------------------
def all_outputs():
    return [
        f"{RESULTS}/selection/items.parquet",
        *expand(
            f"{RESULTS}/{{revision}}/{{name}}",
            revision=REVISIONS,
            name=[
                "prefixes.parquet",
                "ledger.parquet",
                "bridge.parquet",
                "audit.parquet",
                "audit_check.json",
                "batch_invariance.parquet",
                "cache_differences.parquet",
            ],
        ),
        *expand(f"{RESULTS}/{{revision}}/fidelity.parquet", revision=FIDELITY_REVISIONS),
        *expand(
            f"{RESULTS}/{{revision}}/{{name}}",
            revision=TRANSPLANT_REVISIONS,
            name=[
                "transplant.parquet",
                "caches.parquet",
                "minimal_transplant.parquet",
                "divergence_onset.parquet",
            ],
        ),
        f"{RESULTS}/report/report.md",
        f"{RESULTS}/report/stats.json",
        f"{RESULTS}/report/items.html",
        *figure_files("pdf"),
        *figure_files("png"),
    ]


# ---- Report: its per-revision inputs, by kind, and its figures -------------------------------------------------------
FIGURE_NAMES = [
    "fig1_disagreement",
    "fig2_first_divergence",
    "fig3_margins",
    "fig4_cache_differences",
    "fig5_transplant",
    "fig6_accuracy",
    "fig7_minimal_transplant",
    "fig8_divergence_onset",
    "fig9_fidelity",
    "fig10_split_predictors",
]


def figure_title(name):
    """A figure's name in the Snakemake report: its number and title, as the report's captions give them."""
    title = CAPTIONS[name][0]
    return f"{FIGURE_NAMES.index(name) + 1}. {title}"


def report_revisions():
    """Revisions each kind of the report's inputs exists at: every generated revision, the transplant at its own."""
    generated = list(REVISIONS)
    return {
        "ledger": generated,
        "transplant": list(TRANSPLANT_REVISIONS),
        "minimal_transplant": list(TRANSPLANT_REVISIONS),
        "divergence_onset": list(TRANSPLANT_REVISIONS),
        "bridge": generated,
        "audit": generated,
        "batch_invariance": generated,
        "cache_differences": generated,
        "fidelity": list(FIDELITY_REVISIONS),
    }


def report_inputs(wildcards):
    """Per-revision files the report and the figures read, by kind: results/<run>/<revision>/<kind>.parquet."""
    return {
        kind: expand(f"{RESULTS}/{{revision}}/{kind}.parquet", revision=revisions)
        for kind, revisions in report_revisions().items()
    }


def figure_files(fmt):
    return [f"{RESULTS}/report/figures/{name}.{fmt}" for name in FIGURE_NAMES]


# ---- Comparisons of runs (compare.smk) -------------------------------------------------------------------------------
COMPARED = f"results/{COMPARE_FOLDER}/{{name}}"


def compare_settings():
    settings = config["compare"]
    if not settings["runs"]:
        raise ValueError(
            "compare.runs is empty: give the comparison's name and the finished runs to compare, e.g. "
            "--config 'compare={name: numerics, runs: [default, invariant]}' (README, \"Several runs side by side\")"
        )
    return settings


def comparison_outputs(wildcards):
    name = compare_settings()["name"]
    return [f"results/{COMPARE_FOLDER}/{name}/report.md", f"results/{COMPARE_FOLDER}/{name}/stats.json"]


def compared_runs(wildcards):
    """The runs, refused before any job when fewer than two, one listed twice or one without a results folder."""
    settings = compare_settings()
    if wildcards.name != settings["name"]:
        raise ValueError(
            f"results/{COMPARE_FOLDER}/{wildcards.name}/ is not the comparison the config names "
            f"({settings['name']}); set compare.name to build it"
        )
    return run_folders(settings["runs"])


def compared_run_names(wildcards):
    return list(compared_runs(wildcards))


def compared_states(wildcards):
    """Per run, a digest of the files the comparison reads: a run whose files change is compared again. They are no
    inputs of the rule: a compared run named as the config's own run would then be rebuilt with this config."""
    return {label: run_state(folder) for label, folder in compared_runs(wildcards).items()}
