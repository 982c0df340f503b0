"""Ledger rows of the llama.cpp engine (:mod:`stagereplay.engines.llama_cpp`): per item, each construction run once
per replica from scratch, the replicas checked bit for bit, and the rows in the ledger's schema with the engine's
columns (whose stage ids, the engine's context).

Knows nothing of files, Snakemake or the report.
"""

from __future__ import annotations

import numpy as np

from stagereplay.decode.greedy import BoundaryMatcher, RowResult
from stagereplay.decode.plans import Batch
from stagereplay.engines.llama_cpp import (
    CONSTRUCTIONS,
    EXPERIMENTS,
    LlamaCppEngine,
    compare_stages,
    get,
    precision_of,
)
from stagereplay.experiments.recipe import ReplicaMismatchError
from stagereplay.experiments.rows import RunSettings, ledger_row


def replica_difference(a: RowResult, b: RowResult) -> str | None:
    """What two runs of one row differ in (stage ids, suffix ids, margins as float32 bytes, boundary cache, stop),
    or None."""
    if a.stage_ids != b.stage_ids:
        return "stage_ids"
    if a.suffix_ids != b.suffix_ids:
        return "suffix_ids"
    if np.asarray(a.margins, "<f4").tobytes() != np.asarray(b.margins, "<f4").tobytes():
        return "margins"
    if a.fingerprints != b.fingerprints:
        layer = next((i for i, (x, y) in enumerate(zip(*(f[1] if f else [] for f in (a.fingerprints, b.fingerprints))))
                      if x != y), "?")
        return f"cache_fingerprint (K differs from layer {layer})"
    if a.stop_reason != b.stop_reason:
        return "stop_reason"
    return None


class Detokenizer:
    """llama.cpp's own detokenizer in the shape ledger rows decode with (``decode(ids) -> str``)."""

    def __init__(self, engine: LlamaCppEngine):
        self.engine = engine

    def decode(self, ids) -> str:
        return self.engine.llm.detokenize(list(ids), special=True).decode("utf-8", "replace")


def _replicated(engine: LlamaCppEngine, item: dict, settings: RunSettings, name: str, source: str, run,
                replicas) -> list[RowResult]:
    """``run()`` once per replica, each from scratch, every one bit-identical to the first or
    :class:`ReplicaMismatchError`."""
    runs = [run() for _ in replicas]
    for replica, res in zip(replicas[1:], runs[1:]):
        differs = replica_difference(runs[0], res)
        if differs:
            raise ReplicaMismatchError(
                f"item {item['item_id']!r}: llama.cpp {name} over the {source}'s stage ids, replicas {replicas[0]} "
                f"and {replica} at {settings.precision} differ in {differs}. Replicas must be bit-exact; the rows "
                "record the llama.cpp build (system_info) and context that did not make them so")
    return runs


def _rows_of(engine: LlamaCppEngine, item: dict, settings: RunSettings, name: str, source: str, comparison,
             prompt_ids: list[int], runs: list[RowResult], replicas) -> list[dict]:
    extra = dict(engine.provenance(), stage_source=source, stage_comparison=comparison)
    return [dict(ledger_row(item, settings, EXPERIMENTS[source], name, replica, prompt_ids, res, Detokenizer(engine),
                            Batch(None, (item,)), 0), **extra)
            for replica, res in zip(replicas, runs)]


def _check_precision(engine: LlamaCppEngine, settings: RunSettings) -> None:
    if settings.precision != precision_of(engine.settings.kv_type):
        raise ValueError(f"settings.precision {settings.precision!r} is not the engine's "
                         f"{precision_of(engine.settings.kv_type)!r}")


def engine_rows(engine: LlamaCppEngine, item: dict, prompt_ids: list[int], stage_ids: list[int],
                settings: RunSettings, constructions=("incremental", "prefill", "prompt_cache", "chunked"),
                replicas=(1, 2), source: str = "reference", comparison: str | None = None) -> list[dict]:
    """Ledger rows of one item for each construction over given stage ids (``source``: whose they are), each
    replica a run from scratch, bit-identical to replica 1 or :class:`ReplicaMismatchError`.
    ``settings.precision`` must be the engine's KV type's."""
    _check_precision(engine, settings)
    rows = []
    for name in constructions:
        if get(name).generates:
            raise ValueError(f"{name} generates its own stage: own_stage_rows() runs it")
        runs = _replicated(engine, item, settings, name, source,
                           lambda n=name: engine.replay(n, prompt_ids, stage_ids, settings.max_new_tokens), replicas)
        rows += _rows_of(engine, item, settings, name, source, comparison, prompt_ids, runs, replicas)
    return rows


def own_stage_rows(engine: LlamaCppEngine, item: dict, prompt_ids: list[int], matcher: BoundaryMatcher,
                   max_stage_tokens: int, settings: RunSettings, constructions=tuple(CONSTRUCTIONS),
                   replicas=(1, 2), reference_stage: list[int] | None = None) -> tuple[list[dict], list[int]]:
    """Ledger rows of one item over llama.cpp's own stage: ``live`` generates it (replicas from scratch, stage ids
    included; its rows are written whatever ``constructions`` holds), then each other construction rebuilds its
    boundary state from those ids. A ``live`` that misses the boundary gives its rows (status ``boundary_missing``)
    and no others. Also returns the stage ids (empty: none). ``reference_stage`` (the pipeline's; None: it missed
    the boundary) fills each row's ``stage_comparison``."""
    _check_precision(engine, settings)
    runs = _replicated(engine, item, settings, "live", "engine", lambda: engine.generate(
        prompt_ids, matcher, max_stage_tokens, settings.max_new_tokens), replicas)
    stage = list(runs[0].stage_ids)
    comparison = compare_stages(stage, reference_stage)
    rows = _rows_of(engine, item, settings, "live", "engine", comparison, prompt_ids, runs, replicas)
    if stage:
        rows += engine_rows(engine, item, prompt_ids, stage, settings,
                            [n for n in constructions if not get(n).generates], replicas, "engine", comparison)
    return rows, stage
