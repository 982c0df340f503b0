"""THE recipe every experiment and the audit call: build a construction's boundary caches for a batch of rows,
fingerprint them, continue them, make ledger rows, and check the replicas.

Rows of one batch are decoded together in one layout whatever the construction
(:func:`stagereplay.decode.greedy.decode_rows`), so two constructions compared on an item differ only in how its
boundary cache was built.
"""

from __future__ import annotations

from stagereplay.decode.greedy import BoundaryMatcher, RowResult, decode_rows
from stagereplay.decode.plans import Batch
from stagereplay.decode.protocol import Decoder
from stagereplay.experiments import constructions
from stagereplay.experiments.rows import RunSettings, check_replicas, ledger_row


def run(decoder: Decoder, construction: str, prompts: list[list[int]], settings: RunSettings, *,
        stages: list[list[int] | None] | None = None, matcher: BoundaryMatcher | None = None, edit=None,
        keep=frozenset(), max_new_tokens: int | None = None, suffixes=None, observe=None) -> list[RowResult]:
    """One construction over one batch: ``live`` generates (``matcher``); the others rebuild from ``stages``.
    ``suffixes`` and ``observe`` (teacher-forced suffix ids, each step's logits) go to the greedy loop as they are."""
    c = constructions.get(construction)
    budget = settings.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not c.rebuildable:
        if stages is not None:
            raise ValueError("the live construction generates its own stage; it cannot be given stage ids")
        return decode_rows(decoder, prompts, matcher=matcher, max_stage_tokens=settings.max_stage_tokens,
                           max_new_tokens=budget, edit=edit, keep=keep, suffixes=suffixes, observe=observe)
    return decode_rows(decoder, prompts, stages=stages, build=c.cache_build(settings.chunk_size),
                       max_new_tokens=budget, edit=edit, keep=keep, suffixes=suffixes, observe=observe)


def replicated(decoder: Decoder, experiment: str, construction: str, batch: Batch, prompts: list[list[int]],
               settings: RunSettings, tokenizer, *, replicas=(1, 2), stages=None, matcher=None,
               keep=frozenset()) -> tuple[list[dict], list[RowResult]]:
    """Ledger rows of ``construction`` for every row of ``batch`` with something to decode, each replica run
    from scratch and checked bit for bit; and replica 1's results (its kept caches included)."""
    runs = [run(decoder, construction, prompts, settings, stages=stages, matcher=matcher,
                keep=keep if i == 0 else frozenset()) for i, _ in enumerate(replicas)]
    rows = []
    for r, item in enumerate(batch.items):
        if stages is not None and stages[r] is None:
            continue
        cell = [ledger_row(item, settings, experiment, construction, replica, prompts[r], res[r], tokenizer, batch, r)
                for replica, res in zip(replicas, runs)]
        check_replicas(cell, item["item_id"])
        rows += cell
    return rows, runs[0]
