# The params of the jobs that load a model: their settings (params.kwargs), built from the fields of the stage's
# settings dataclass (stagereplay.stages.settings: each field names its config key, its default the schema's), with
# the values of the job itself; the fingerprints of the input files; the keys of the model-store snapshots a job
# loads (params.snapshots). Every mapping in sorted key order: Snakemake compares params by their repr.
from types import SimpleNamespace

from stagereplay.io.file_hashes import HashCache
from stagereplay.models.sources import ModelLoadError, resolve_source
from stagereplay.models.store import planned_keys, read_record, resolve_root
from stagereplay.stages.input_fingerprints import dataset_file_fingerprint, model_fingerprint
from stagereplay.stages.prepare import prepare_again
from stagereplay.stages.settings import (
    BatchInvarianceSettings,
    CacheDifferenceSettings,
    ControlSettings,
    DumpSettings,
    FidelitySettings,
    MinimalTransplantSettings,
    OnsetSettings,
    PrepareSettings,
    ReconstructSettings,
    ReplaySettings,
    TransplantSettings,
    config_kwargs,
    from_params,
)

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


# ---- params.kwargs: the config's values of the settings' fields, and the job's own -----------------------------------
def model_job(revision, revisions=ALL_REVISIONS):
    """What a model-loading job gives for itself: the model's path resolved, the revision, the fingerprint of its
    files and the run's record of its prepared snapshots. The generation's stages run at generated revisions only."""
    name = revisions[revision]
    return dict(
        model=resolve_path(config["model"]),
        revision=name,
        model_fingerprint=model_files(name),
        prepared_models=prepared_folder(revision),
    )


def job_kwargs(cls, omit=(), **given):
    return canonical(config_kwargs(cls, config, omit, **given))


def model_kwargs(wildcards):
    """reconstruct_prefixes: the generation's settings at one precision and shard, and the bridge rows."""
    return job_kwargs(
        ReconstructSettings,
        **model_job(wildcards.revision, REVISIONS),
        precision=wildcards.precision,
        shard=int(wildcards.shard),
    )


def fixed_prefix_kwargs(wildcards):
    """The fixed-prefix 2x2 and the audit."""
    return job_kwargs(
        ControlSettings,
        **model_job(wildcards.revision, REVISIONS),
        precision=wildcards.precision,
        shard=int(wildcards.shard),
    )


def fidelity_kwargs(wildcards):
    """The generation's settings at one precision and shard (the live reference is regenerated as it ran), and the
    constructions and items compared."""
    return job_kwargs(
        FidelitySettings,
        **model_job(wildcards.revision, REVISIONS),
        precision=wildcards.precision,
        shard=int(wildcards.shard),
    )


def batch_invariance_kwargs(wildcards):
    """The generation's settings (every precision in one job), and the control's sample."""
    return job_kwargs(BatchInvarianceSettings, **model_job(wildcards.revision, REVISIONS), shard=int(wildcards.shard))


def cache_difference_kwargs(wildcards):
    return job_kwargs(
        CacheDifferenceSettings,
        **model_job(wildcards.revision, REVISIONS),
        revision_slug=wildcards.revision,
        prefix_precision=config["cache_differences"].get("prefix_precision") or config["precisions"][0],
        shard=int(wildcards.shard),
    )


def dump_kwargs(wildcards):
    """A batched baseline's rows are rebuilt in their batch, which continues them: the suffix budget too."""
    return job_kwargs(DumpSettings, **model_job(wildcards.revision), shard=int(wildcards.shard))


def baseline_kwargs(wildcards):
    return job_kwargs(
        ReplaySettings, **model_job(wildcards.revision), precision=TRANSPLANT_PRECISION, shard=int(wildcards.shard)
    )


def transplant_kwargs(wildcards):
    return job_kwargs(
        TransplantSettings, **model_job(wildcards.revision), precision=TRANSPLANT_PRECISION, shard=int(wildcards.shard)
    )


def minimal_transplant_kwargs(wildcards):
    return job_kwargs(
        MinimalTransplantSettings,
        **model_job(wildcards.revision),
        precision=TRANSPLANT_PRECISION,
        shard=int(wildcards.shard),
    )


def onset_kwargs(wildcards):
    """Both transplant constructions of every divergent item, rebuilt in their batch (which continues them)."""
    return job_kwargs(OnsetSettings, **model_job(wildcards.revision), shard=int(wildcards.shard))


def revision_name(wildcards):
    return ALL_REVISIONS[wildcards.revision]


def prepare_kwargs(wildcards):
    """Preparing runs no forward: the device and the attention change no prepared byte, and stay out."""
    name = ALL_REVISIONS[wildcards.revision]
    return job_kwargs(
        PrepareSettings,
        omit=("device", "attn_implementation"),
        model=resolve_path(config["model"]),
        revision=name,
        model_fingerprint=model_files(name),
        precisions=revision_precisions(wildcards.revision),
    )


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


def snapshots_of(precisions_of):
    """A params function: {precision: store key} of the snapshots a job loads, at ``precisions_of(wildcards)``
    (inputs.smk)."""

    def keys(wildcards):
        return canonical(snapshot_keys(wildcards.revision, precisions_of(wildcards)))

    return keys


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
