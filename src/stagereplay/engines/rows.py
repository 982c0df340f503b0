"""Ledger rows of any engine (:mod:`stagereplay.engines.protocol`): per item, each of the engine's constructions run
once per replica from scratch, the replicas checked bit for bit, and the rows in the ledger's schema with the stage's
columns (whose stage ids, the engine) and the engine's own (its provenance).

Two kinds of stage ids (the rows' ``stage_source``):

- ``engine``: the engine's own stage, which its generating construction (``live``) generates from the prompt with
  the pipeline's stage rule; the other constructions rebuild the state from those ids (experiment
  ``<engine>_own_stage``), and are compared with the generating one;
- ``reference``: the pipeline's stage ids (experiment ``<engine>_reference_stage``), with no generating construction;
  the one that runs the generating construction's forwards over given ids (``incremental``) is the reference there.

The constructions are the catalogue's (:class:`stagereplay.catalogue.EngineConstruction`). Knows nothing of files,
Snakemake or the report, and nothing of any one engine.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stagereplay import catalogue
from stagereplay.catalogue import EngineConstruction
from stagereplay.decode.greedy import BoundaryMatcher, RowResult
from stagereplay.decode.plans import Batch
from stagereplay.experiments import recipe
from stagereplay.experiments.recipe import ReplicaMismatchError
from stagereplay.experiments.rows import LEDGER_SCHEMA, RunSettings, ledger_row

# Whose stage ids a row's boundary state is built over.
STAGE_SOURCES = ("engine", "reference")
# The engine's own stage against the pipeline's, per item (the rows' stage_comparison)
STAGE_COMPARISONS = ("same", "differs", "engine_missing", "reference_missing", "both_missing")
# Per row, beside the ledger's columns and before the engine's own (Engine.fields).
STAGE_FIELDS = [
    ("stage_source", pa.string()),  # engine: the engine's own greedy stage; reference: the pipeline's stage ids
    ("stage_comparison", pa.string()),  # the engine's own stage vs the pipeline's (STAGE_COMPARISONS); null: not run
    ("engine", pa.string()),
]


def ledger_schema(engine_class: type) -> pa.Schema:
    """An engine's rows: the ledger's columns, the stage's (:data:`STAGE_FIELDS`), then the engine's own."""
    return pa.schema([*LEDGER_SCHEMA, *STAGE_FIELDS, *engine_class.fields])


def context_fields(engine_class: type) -> list[str]:
    """The columns the audit compares beside the ledger's: whose stage ids, and the engine and its context."""
    return [name for name, _ in (*STAGE_FIELDS, *engine_class.fields)]


def experiment(engine: str, source: str) -> str:
    """The ledger's experiment of a source's rows: one per source keeps a row's key unique."""
    return f"{engine}_{'own' if source == 'engine' else source}_stage"


def get(engine: str, name: str) -> EngineConstruction:
    """The engine's construction ``name``, as the catalogue declares it."""
    for c in catalogue.engine(engine).constructions:
        if c.name == name:
            return c
    raise ValueError(f"unknown {engine} construction {name!r}; known: "
                     f"{sorted(c.name for c in catalogue.engine(engine).constructions)}")


def constructions_for(engine: str, source: str, names) -> tuple[str, ...]:
    """The constructions of ``names`` that run over ``source``'s stage ids (the generating one over the engine's own
    stage only)."""
    if source not in STAGE_SOURCES:
        raise ValueError(f"stage source {source!r}: known {list(STAGE_SOURCES)}")
    return tuple(n for n in names if source == "engine" or not get(engine, n).generates)


def reference_of(engine: str, source: str) -> str:
    """What a source's other constructions are compared with: over the engine's own stage its generating
    construction; over the pipeline's, the one that runs the generating one's forwards over given ids."""
    own = [c for c in catalogue.engine(engine).constructions if c.generates]
    if source == "engine":
        return own[0].name
    return next(c.name for c in catalogue.engine(engine).constructions
                if not c.generates and c.forwards_of == own[0].forwards_of)


def compare_stages(own: list[int] | None, reference: list[int] | None) -> str:
    """The engine's own stage ids against the pipeline's (None or empty: that generation missed the boundary)."""
    if not own and not reference:
        return "both_missing"
    if not own:
        return "engine_missing"
    if not reference:
        return "reference_missing"
    return "same" if list(own) == list(reference) else "differs"


def replica_difference(a: RowResult, b: RowResult) -> str | None:
    """What two runs of one row differ in, as the pipeline's replicas are checked
    (:func:`stagereplay.experiments.recipe.replica_difference`), and the margins as float32 bytes, which an engine's
    own greedy loop computes itself; None when bit-identical."""
    differs = recipe.replica_difference(a, b)
    if differs:
        return differs
    if np.asarray(a.margins, "<f4").tobytes() != np.asarray(b.margins, "<f4").tobytes():
        return "margins"
    return None


def _replicated(engine, item: dict, settings: RunSettings, name: str, source: str, run,
                replicas) -> list[RowResult]:
    """``run()`` once per replica, each from scratch, every one bit-identical to the first or
    :class:`ReplicaMismatchError`."""
    runs = [run() for _ in replicas]
    for replica, res in zip(replicas[1:], runs[1:]):
        differs = replica_difference(runs[0], res)
        if differs:
            raise ReplicaMismatchError(
                f"item {item['item_id']!r}: {engine.label} {name} over the {source}'s stage ids, replicas "
                f"{replicas[0]} and {replica} at {settings.precision} differ in {differs}. Replicas must be "
                "bit-exact; the rows record the engine's build and context that did not make them so")
    return runs


def _rows_of(engine, item: dict, settings: RunSettings, name: str, source: str, comparison,
             prompt_ids: list[int], runs: list[RowResult], replicas) -> list[dict]:
    extra = dict(engine.provenance(), engine=engine.name, stage_source=source, stage_comparison=comparison)
    return [dict(ledger_row(item, settings, experiment(engine.name, source), name, replica, prompt_ids, res, engine,
                            Batch(None, (item,)), 0), **extra)
            for replica, res in zip(replicas, runs)]


def _check_precision(engine, settings: RunSettings) -> None:
    if settings.precision != engine.precision:
        raise ValueError(f"settings.precision {settings.precision!r} is not the engine's {engine.precision!r}")


def engine_rows(engine, item: dict, prompt_ids: list[int], stage_ids: list[int], settings: RunSettings,
                constructions=None, replicas=(1, 2), source: str = "reference",
                comparison: str | None = None) -> list[dict]:
    """Ledger rows of one item for each construction over given stage ids (``source``: whose they are; None: every
    construction of the engine's that does not generate), each replica a run from scratch, bit-identical to
    replica 1 or :class:`ReplicaMismatchError`. ``settings.precision`` must be the engine context's."""
    _check_precision(engine, settings)
    if constructions is None:  # every construction of the engine's over given ids
        constructions = [c.name for c in catalogue.engine(engine.name).constructions if not c.generates]
    rows = []
    for name in constructions:
        if get(engine.name, name).generates:
            raise ValueError(f"{name} generates its own stage: own_stage_rows() runs it")
        runs = _replicated(engine, item, settings, name, source,
                           lambda n=name: engine.replay(n, prompt_ids, stage_ids, settings.max_new_tokens), replicas)
        rows += _rows_of(engine, item, settings, name, source, comparison, prompt_ids, runs, replicas)
    return rows


def own_stage_rows(engine, item: dict, prompt_ids: list[int], matcher: BoundaryMatcher, max_stage_tokens: int,
                   settings: RunSettings, constructions, replicas=(1, 2),
                   reference_stage: list[int] | None = None) -> tuple[list[dict], list[int]]:
    """Ledger rows of one item over the engine's own stage: the generating construction generates it (replicas from
    scratch, stage ids included; its rows are written whatever ``constructions`` holds), then each other
    construction rebuilds its boundary state from those ids. A generation that misses the boundary gives its rows
    (status ``boundary_missing``) and no others. Also returns the stage ids (empty: none). ``reference_stage`` (the
    pipeline's; None: it missed the boundary) fills each row's ``stage_comparison``."""
    _check_precision(engine, settings)
    own = reference_of(engine.name, "engine")
    runs = _replicated(engine, item, settings, own, "engine", lambda: engine.generate(
        prompt_ids, matcher, max_stage_tokens, settings.max_new_tokens), replicas)
    stage = list(runs[0].stage_ids)
    comparison = compare_stages(stage, reference_stage)
    rows = _rows_of(engine, item, settings, own, "engine", comparison, prompt_ids, runs, replicas)
    if stage:
        rows += engine_rows(engine, item, prompt_ids, stage, settings,
                            [n for n in constructions if not get(engine.name, n).generates], replicas, "engine",
                            comparison)
    return rows, stage
