"""The engine protocol: what a serving engine offers the engine stage (:mod:`stagereplay.stages.engine`), and nothing
more.

An engine is a class that drives one model file in one context of a serving engine at one precision. The stage knows
nothing else of it: it finds the class by the engine's name in the catalogue (:class:`stagereplay.catalogue.Engine`,
its ``engine_class``), reads the engine's config block into the class's :attr:`Engine.config_class`, opens one context
per precision that block names, and asks each context for its rows' boundary states. Items, replicas and their check,
the ledger rows, shards, the audit and the gathers are the stage's (:mod:`stagereplay.engines.rows`), the same for
every engine.

The contract, for each construction the catalogue declares for the engine (:class:`stagereplay.catalogue.
EngineConstruction`):

- :meth:`Engine.replay` builds the boundary state of given stage ids from scratch, in the forwards of the pipeline's
  construction it names (``forwards_of``), fingerprints it and continues greedily (argmax, lowest id on ties) from the
  pending token, one token per forward, with the top-2 margin of each step's float32 logits;
- :meth:`Engine.generate` is the construction that ``generates``: the engine's own greedy stage from the prompt,
  ended by the pipeline's stage rule (:func:`stagereplay.decode.greedy.stage_end`), its state continued in place;
- every run from scratch is bit-identical to the last one of the same arguments (the stage checks two replicas);
- :meth:`Engine.provenance` gives the engine's columns of every row (:attr:`Engine.fields`), the same for every row
  of one context.

The ledger's ``decode_regime`` of an engine's rows is its name: its kernels are part of the construction.

Modelled on :mod:`stagereplay.decode.protocol` and lm-eval's ``LM``: a small declared interface, checked by
``isinstance`` against :class:`Engine` in the tests (tests/test_engine_protocol.py adds a dummy engine).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from stagereplay.config import schema_default

if TYPE_CHECKING:
    from stagereplay.decode.greedy import BoundaryMatcher, RowResult


class EngineConfig(Protocol):
    """An engine's config block (``config[<engine>]``) beyond the stage's own keys (``stage_sources``,
    ``constructions``, ``shards``, ``contexts``): a frozen dataclass whose fields are the block's keys, each a
    :func:`block_field` of ``<engine>.<key>`` (its default the schema's) or one of :attr:`inherited`, so that the
    workflow builds a job's params from the fields (workflow/rules/common/engines.smk) and the schema's block holds
    the defaults."""

    inherited: ClassVar[tuple[str, ...]]  # keys that take the config's own key of that name where null

    def precisions(self) -> tuple[str, ...]:
        """The ledger's precision of each context a job opens, in the order the job runs them."""

    def gpus(self) -> int:
        """GPUs a job of this config claims: 0 or 1 (the rule's ``resources: gpu``)."""


def block_field(key: str):
    """A field of an engine's config block read from the config key ``key`` (``<engine>.<name>``), its default the
    schema's (a list as a tuple: the dataclass is frozen), as :func:`stagereplay.stages.settings.config_field`."""
    default = schema_default(key)
    return dataclasses.field(default=tuple(default) if isinstance(default, list) else default,
                             metadata={"config": key})


@dataclass(frozen=True)
class PlannedPrefix:
    """A boundary state a job will build: the constructions over a prompt of ``prompt_len`` ids and ``n_cached``
    stage ids beyond it (at most), and what it is, for an error that names it."""

    constructions: tuple[str, ...]
    prompt_len: int
    n_cached: int
    what: str


@runtime_checkable
class Engine(Protocol):
    name: ClassVar[str]  # the catalogue's engine
    label: ClassVar[str]  # how a reader names it ("llama.cpp")
    config_class: ClassVar[type]  # its config block (:class:`EngineConfig`)
    fields: ClassVar[list]  # (column, pyarrow type) of its provenance on every row, after the stage's columns
    precision: str  # the ledger's precision of this context

    @classmethod
    def require(cls) -> None:
        """Refuse, naming the install command, where the engine's library is missing (before any job)."""

    @classmethod
    def model_file(cls, model: str, revision: str | None, base_dir: str) -> str:
        """The file (or folder) this engine opens of the config's ``model`` at ``revision``, or a ValueError naming
        why it cannot (a :class:`stagereplay.models.sources.ModelLoadError` where the source does not resolve)."""

    @classmethod
    def open(cls, path: str, config: Any, precision: str, n_ctx: int, main_gpu: int | None) -> Engine:
        """A context of ``config`` at ``precision`` holding at least ``n_ctx`` positions; ``main_gpu``: the visible
        GPU this job claimed (None: no claim)."""

    @classmethod
    def visible_gpus(cls) -> int:
        """How many GPUs the engine sees (the stage claims one of them per job where the config offloads)."""

    def sibling(self) -> Engine:
        """A further context of this one's settings over this one's model, not loaded again (the stage's
        ``contexts``: one copy of the weights for all); closed before this one."""

    def provenance(self) -> dict:
        """The engine's columns of every row (:attr:`fields`): its versions, build and context."""

    def decode(self, ids) -> str:
        """Token ids as text, the engine's own detokenizer (the rows' ``suffix_text``, the boundary's marker)."""

    def check_prefixes(self, prefixes: list[PlannedPrefix]) -> None:
        """Refuse, before any row, a planned prefix this context cannot build as its constructions say, naming the
        one that needs the most (so that the value it names holds every prefix)."""

    def replay(self, construction: str, prompt_ids: list[int], stage_ids: list[int],
               max_new_tokens: int) -> RowResult:
        """One run from scratch over given stage ids (the boundary token last): build, fingerprint, continue."""

    def generate(self, prompt_ids: list[int], matcher: BoundaryMatcher, max_stage_tokens: int,
                 max_new_tokens: int) -> RowResult:
        """The generating construction, from scratch: the engine's own greedy stage, its state continued in place;
        without a boundary, status ``boundary_missing`` and the ids generated."""

    def close(self) -> None: ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc) -> None: ...


def engine_class(name: str) -> type:
    """The class of the catalogue's engine ``name`` (imported on first use)."""
    import importlib

    from stagereplay import catalogue

    module, _, attribute = catalogue.engine(name).engine_class.rpartition(".")
    return getattr(importlib.import_module(module), attribute)
