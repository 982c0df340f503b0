"""The typed settings every stage takes: one frozen dataclass per stage, built from the rule's params.

Fields are exactly the keys the workflow passes (workflow/rules/common.smk), so a key that a rule passes and a
stage does not know is an error naming it, not a silently ignored value (:func:`from_params`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stagereplay.models.sources import PlannedSource


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

    model: str
    revision: str | None
    threads: int = 1
    device: str = "auto"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    offline: bool = True
    base_dir: str = "."
    progress: bool = True
    # {"source", "sha256", "files"} of the revision's model files, taken when the workflow planned the job
    # (stagereplay.stages.input_fingerprints); None outside the workflow or for a hub model not cached yet.
    model_fingerprint: dict | None = None
    # The run's record of the revision's prepared snapshots in the model store (rule prepare_model,
    # stagereplay.stages.prepare); None: the job loads the model source itself.
    prepared_models: str | None = None
    # The model store's folder (stagereplay.models.store); None: the default. Where a run's record names one, the
    # jobs load from that.
    model_store: str | None = None

    @property
    def planned_source(self) -> PlannedSource:
        return PlannedSource(self.model, self.revision, self.base_dir, self.model_fingerprint, self.trust_remote_code,
                             self.allow_pickle, self.offline)


@dataclass(frozen=True, kw_only=True)
class PrepareSettings(ModelSettings):
    """The model source at the precisions the run needs, prepared once in the model store for every later job."""

    precisions: list


@dataclass(frozen=True, kw_only=True)
class GenerationSettings(ModelSettings):
    """The generation's settings, shared by every stage that runs the model as it did."""

    boundary: dict
    max_stage_tokens: int
    max_new_tokens: int
    decode_regime: str = "eager"
    decode_attention: str = "masked"
    decode_prefill_group: int | None = None
    decode_kernels: str = "library"
    batch_size: int = 1
    batch_seed: int | None = None
    numerics: str = "default"
    answer_format: str = "last_number"
    stage_end: str | None = "</think>"
    prompt: dict | None = None
    seed: int = 0
    chunk_size: int = 16


@dataclass(frozen=True, kw_only=True)
class ReconstructSettings(GenerationSettings):
    precision: str
    shard: int = 0
    n_shards: int = 1
    bridge: dict | None = None  # {n_rows, seed}: the bridge rows, drawn from the selection


@dataclass(frozen=True, kw_only=True)
class ControlSettings(GenerationSettings):
    """The fixed-prefix 2x2 and the audit."""

    precision: str
    shard: int = 0
    n_shards: int = 1
    reference_precision: str
    fixed_prefix_constructions: tuple[str, ...] = ("incremental", "prefill")


@dataclass(frozen=True, kw_only=True)
class BatchInvarianceSettings(GenerationSettings):
    precisions: tuple[str, ...]
    sample: int
    sample_seed: int
    shard: int = 0
    n_shards: int = 1


@dataclass(frozen=True, kw_only=True)
class CacheDifferenceSettings(ModelSettings):
    revision_slug: str
    precisions: tuple[str, ...]
    prefix_precision: str | None = None
    n_items: int = 50
    seed: int = 0
    chunk_size: int = 16
    constructions: tuple[str, ...] = ("incremental", "prefill")
    shard: int = 0
    n_shards: int = 1


@dataclass(frozen=True, kw_only=True)
class ReplaySettings(ModelSettings):
    """A later revision's transplant baseline: the transplant pair on the primary revision's prefix ids."""

    precision: str
    max_new_tokens: int
    answer_format: str = "last_number"
    stage_end: str | None = "</think>"
    shard: int = 0
    n_shards: int = 1
    chunk_size: int = 16
    constructions: tuple[str, ...] = ("live", "prefill")


@dataclass(frozen=True, kw_only=True)
class DumpSettings(ModelSettings):
    items: str = "divergent"  # divergent | all | none
    shard: int = 0
    n_shards: int = 1
    max_new_tokens: int
    chunk_size: int = 16
    constructions: tuple[str, ...] = ("live", "prefill")


@dataclass(frozen=True, kw_only=True)
class TransplantSettings(ModelSettings):
    precision: str
    max_new_tokens: int
    sweeps: tuple[str, ...] = ("all",)
    shard: int = 0
    n_shards: int = 1
    chunk_size: int = 16
    constructions: tuple[str, ...] = ("live", "prefill")


@dataclass(frozen=True, kw_only=True)
class MinimalTransplantSettings(ModelSettings):
    """The minimal sufficient transplant search: ``budget`` transplant runs per item and direction (0: off)."""

    precision: str
    max_new_tokens: int
    budget: int = 24
    shard: int = 0
    n_shards: int = 1
    chunk_size: int = 16
    constructions: tuple[str, ...] = ("live", "prefill")


@dataclass(frozen=True, kw_only=True)
class OnsetSettings(ModelSettings):
    """The divergence onset: both transplant constructions' boundary caches of every divergent item, compared."""

    max_new_tokens: int
    chunk_size: int = 16
    shard: int = 0
    n_shards: int = 1
    constructions: tuple[str, ...] = ("live", "prefill")


@dataclass(frozen=True, kw_only=True)
class FidelitySettings(GenerationSettings):
    """Fidelity along the suffix: the live reference regenerated, each construction teacher-forced through it."""

    precision: str
    shard: int = 0
    n_shards: int = 1
    constructions: tuple[str, ...] = ("prefill", "chunked", "prefix_cached")
    items: str | int = "all"  # all, or the size of a seeded sample of the selection
    items_seed: int = 0
