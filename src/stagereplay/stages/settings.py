"""The typed settings every stage takes: one frozen dataclass per stage, built from the rule's params.

Each field says where its value comes from, once: :func:`config_field` names the config key (its default is the
schema's, which the workflow's validation fills in too), :func:`job_field` marks a value of the job itself (its
revision, precision, shard, the files planned for it). The workflow builds a rule's params from these fields
(:func:`config_kwargs`, workflow/rules/common/settings.smk), so a key is spelled in the schema and here, nowhere else.
A key that a rule passes and a stage does not know is an error naming it, not a silently ignored value
(:func:`from_params`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from stagereplay.config import schema_default
from stagereplay.models.sources import PlannedSource


def config_field(key: str, *, required: bool = False, param: bool = True, only_with: str | None = None):
    """A field read from the config key ``key`` (dotted: ``transplant.minimal.budget``), its default the schema's.

    ``required``: no default; the caller gives the value, which the workflow derives from the key (a resolved path).
    ``param``: False for a key that changes no result, kept out of the rule's params so that changing it reruns
    nothing. ``only_with``: the field is passed only where one of the job's constructions is this one (chunk_size:
    elsewhere it changes no result, and in the params it would rerun the job).
    """
    metadata = {"config": key, "param": param, "only_with": only_with}
    if required:
        schema_default(key)  # the key exists, and so does its default, which the workflow reads
        return dataclasses.field(metadata=metadata)
    default = schema_default(key)
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    if isinstance(default, list):  # a frozen dataclass's default is immutable
        default = tuple(default)
    return dataclasses.field(default=default, metadata=metadata)


def job_field(default=dataclasses.MISSING):
    """A field of the job itself (which revision, precision or shard, which files), not a config key."""
    return dataclasses.field(default=default, metadata={"job": True})


def config_kwargs(cls, config: dict, omit=(), **given) -> dict:
    """A rule's params for ``cls``: every config field of it read from ``config`` (a missing nested key is the
    schema's default, as validation would fill it in), except ``omit`` and those not ``param``, and ``given``, the
    job's values and values the workflow derives from the config, which replace the config's."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise TypeError(f"{cls.__name__} does not take {unknown}")
    kwargs = {}
    for name, f in fields.items():
        if "config" in f.metadata and f.metadata["param"] and name not in omit and name not in given:
            kwargs[name] = _config_value(config, f)
    kwargs.update(given)
    constructions = {c for name, value in kwargs.items() if name.endswith("constructions") for c in value}
    for name, f in fields.items():
        if f.metadata.get("only_with") and f.metadata["only_with"] not in constructions:
            kwargs.pop(name, None)
    return kwargs


def _config_value(config: dict, f: dataclasses.Field):
    value = config
    for part in f.metadata["config"].split("."):
        if part not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise KeyError(f"config key {f.metadata['config']!r} is not set")
            return schema_default(f.metadata["config"])
        value = value[part]
    return value


def from_params(cls, params: dict):
    """``cls(**params)``, refusing unknown keys by name (dataclasses would say only 'unexpected keyword')."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise TypeError(f"{cls.__name__} does not take {unknown}; it takes {sorted(known)}")
    return cls(**params)


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """How a job loads the model."""

    model: str = config_field("model", required=True)  # the workflow gives the path resolved (common/settings.smk)
    revision: str | None = job_field()
    threads: int = config_field("threads")
    device: str = config_field("device")
    attn_implementation: str = config_field("attn_implementation")
    trust_remote_code: bool = config_field("trust_remote_code")
    allow_pickle: bool = config_field("allow_pickle")
    offline: bool = config_field("offline")
    base_dir: str = job_field(".")
    progress: bool = job_field(True)
    # {"source", "sha256", "files"} of the revision's model files, taken when the workflow planned the job
    # (stagereplay.stages.input_fingerprints); None outside the workflow or for a hub model not cached yet.
    model_fingerprint: dict | None = job_field(None)
    # The run's record of the revision's prepared snapshots in the model store (rule prepare_model,
    # stagereplay.stages.prepare); None: the job loads the model source itself.
    prepared_models: str | None = job_field(None)
    # The model store's folder (stagereplay.models.store); None: the default. Where a run's record names one, the
    # jobs load from that. Not a param: where the store is changes no result.
    model_store: str | None = config_field("model_store", param=False)

    @property
    def planned_source(self) -> PlannedSource:
        return PlannedSource(self.model, self.revision, self.base_dir, self.model_fingerprint, self.trust_remote_code,
                             self.allow_pickle, self.offline)


@dataclass(frozen=True, kw_only=True)
class PrepareSettings(ModelSettings):
    """The model source at the precisions the run needs, prepared once in the model store for every later job."""

    precisions: list = job_field()


@dataclass(frozen=True, kw_only=True)
class GenerationSettings(ModelSettings):
    """The generation's settings, shared by every stage that runs the model as it did."""

    boundary: dict = config_field("boundary")
    max_stage_tokens: int = config_field("max_stage_tokens")
    max_new_tokens: int = config_field("max_new_tokens")
    decode_regime: str = config_field("decode_regime")
    decode_attention: str = config_field("decode_attention")
    decode_prefill_group: int | None = config_field("decode_prefill_group")
    decode_kernels: str = config_field("decode_kernels")
    batch_size: int = config_field("batch_size")
    batch_seed: int | None = config_field("batch_seed")
    numerics: str = config_field("numerics")
    answer_format: str = config_field("answer_format")
    stage_end: str | None = config_field("stage_end")
    prompt: dict = config_field("prompt")
    seed: int = config_field("seed")
    chunk_size: int = config_field("chunk_size", only_with="chunked")


@dataclass(frozen=True, kw_only=True)
class ReconstructSettings(GenerationSettings):
    precision: str = job_field()
    shard: int = job_field(0)
    n_shards: int = config_field("shards")
    bridge: dict | None = config_field("bridge")  # {n_rows, seed}: the bridge rows, drawn from the selection


@dataclass(frozen=True, kw_only=True)
class ControlSettings(GenerationSettings):
    """The fixed-prefix 2x2 and the audit."""

    precision: str = job_field()
    shard: int = job_field(0)
    n_shards: int = config_field("shards")
    reference_precision: str = config_field("reference_precision")
    fixed_prefix_constructions: tuple[str, ...] = config_field("fixed_prefix.constructions")


@dataclass(frozen=True, kw_only=True)
class BatchInvarianceSettings(GenerationSettings):
    precisions: tuple[str, ...] = config_field("precisions")
    sample: int = config_field("batch_invariance.sample")
    sample_seed: int = config_field("batch_invariance.seed")
    shard: int = job_field(0)
    n_shards: int = config_field("shards")


@dataclass(frozen=True, kw_only=True)
class CacheDifferenceSettings(ModelSettings):
    revision_slug: str = job_field()
    precisions: tuple[str, ...] = config_field("cache_differences.precisions")
    # null takes the first of precisions: the workflow gives the precision it stands for
    prefix_precision: str | None = config_field("cache_differences.prefix_precision")
    n_items: int = config_field("cache_differences.n_items")
    seed: int = config_field("seed")
    chunk_size: int = config_field("chunk_size", only_with="chunked")
    constructions: tuple[str, ...] = job_field(("incremental", "prefill"))  # figure 4's pair, not a setting
    shard: int = job_field(0)
    n_shards: int = config_field("shards")


@dataclass(frozen=True, kw_only=True)
class ReplaySettings(ModelSettings):
    """A later revision's transplant baseline: the transplant pair on the primary revision's prefix ids."""

    precision: str = job_field()  # the transplant's (transplant.precision, else the first of precisions)
    max_new_tokens: int = config_field("max_new_tokens")
    answer_format: str = config_field("answer_format")
    stage_end: str | None = config_field("stage_end")
    shard: int = job_field(0)
    n_shards: int = config_field("shards")
    chunk_size: int = config_field("chunk_size", only_with="chunked")
    constructions: tuple[str, ...] = config_field("transplant.constructions")


@dataclass(frozen=True, kw_only=True)
class DumpSettings(ModelSettings):
    items: str = config_field("dump.items")  # divergent | all | none
    shard: int = job_field(0)
    n_shards: int = config_field("shards")
    max_new_tokens: int = config_field("max_new_tokens")
    chunk_size: int = config_field("chunk_size", only_with="chunked")
    constructions: tuple[str, ...] = config_field("transplant.constructions")


@dataclass(frozen=True, kw_only=True)
class TransplantSettings(ModelSettings):
    precision: str = job_field()
    max_new_tokens: int = config_field("max_new_tokens")
    sweeps: tuple[str, ...] = config_field("transplant.sweeps")
    shard: int = job_field(0)
    n_shards: int = config_field("shards")
    chunk_size: int = config_field("chunk_size", only_with="chunked")
    constructions: tuple[str, ...] = config_field("transplant.constructions")
    pack: bool = config_field("transplant.pack")


@dataclass(frozen=True, kw_only=True)
class MinimalTransplantSettings(ModelSettings):
    """The minimal sufficient transplant search: ``budget`` transplant runs per item and direction (0: off)."""

    precision: str = job_field()
    max_new_tokens: int = config_field("max_new_tokens")
    budget: int = config_field("transplant.minimal.budget")
    shard: int = job_field(0)
    n_shards: int = config_field("shards")
    chunk_size: int = config_field("chunk_size", only_with="chunked")
    constructions: tuple[str, ...] = config_field("transplant.constructions")
    pack: bool = config_field("transplant.pack")


@dataclass(frozen=True, kw_only=True)
class OnsetSettings(ModelSettings):
    """The divergence onset: both transplant constructions' boundary caches of every divergent item, compared."""

    max_new_tokens: int = config_field("max_new_tokens")
    chunk_size: int = config_field("chunk_size", only_with="chunked")
    shard: int = job_field(0)
    n_shards: int = config_field("shards")
    constructions: tuple[str, ...] = config_field("transplant.constructions")


@dataclass(frozen=True, kw_only=True)
class FidelitySettings(GenerationSettings):
    """Fidelity along the suffix: the live reference regenerated, each construction teacher-forced through it."""

    precision: str = job_field()
    shard: int = job_field(0)
    n_shards: int = config_field("shards")
    constructions: tuple[str, ...] = config_field("fidelity.constructions")
    items: str | int = config_field("fidelity.items")  # all, or the size of a seeded sample of the selection
    items_seed: int = config_field("fidelity.seed")
