"""The matched experiment and the fixed-prefix 2x2, both over one batch of rows.

Matched, per item: ``live`` replicas 1 and 2 are two greedy generations from scratch, each continued from its
retained cache; ``prefill`` replicas 1 and 2 rebuild the boundary cache from replica 1's prefix ids. Fixed-prefix
2x2: two or more rebuildable constructions (``incremental`` and ``prefill`` by default; ``fixed_prefix.constructions``)
over the reference generation's prefix ids, in the same batch and layout, at every precision, so every precision
and construction continues from the same token state. Replicas must be
bit-exact (token ids, cache bytes and layout), else :class:`~stagereplay.experiments.recipe.ReplicaMismatchError`
names the item.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagereplay.decode.greedy import BoundaryMatcher, RowResult
from stagereplay.decode.plans import Batch
from stagereplay.decode.protocol import Decoder
from stagereplay.experiments import constructions
from stagereplay.experiments.rows import RunSettings, replicated

FIXED_PREFIX_CONSTRUCTIONS = ("incremental", "prefill")


@dataclass
class Matched:
    rows: list[dict]  # ledger rows
    prefix_rows: list[dict]  # one per item: its prompt and stage ids (the reference prefix at this precision)
    live: list[RowResult]  # replica 1 of each construction, per row of the batch
    prefill: list[RowResult]

    def stages(self) -> list[list[int] | None]:
        return [res.stage_ids or None for res in self.live]


def matched(decoder: Decoder, batch: Batch, prompts: list[list[int]], settings: RunSettings, tokenizer,
            matcher: BoundaryMatcher, *, replicas=(1, 2), keep=frozenset()) -> Matched:
    """Ledger rows of the matched experiment for one batch; ``keep`` names rows whose caches replica 1 keeps."""
    live_rows, live = replicated(decoder, "matched", "live", batch, prompts, settings, tokenizer, replicas=replicas,
                                 matcher=matcher, keep=keep)
    prefix_rows = []
    for r, item in enumerate(batch.items):
        reference = next(row for row in live_rows if row["item_index"] == int(item["item_index"]))
        prefix_rows.append({"item_index": int(item["item_index"]), "item_id": item["item_id"],
                            "revision": settings.revision, "precision": settings.precision,
                            "status": reference["status"], "prompt_ids": list(prompts[r]),
                            "stage_ids": reference["stage_ids"], "prefix_fingerprint": reference["prefix_fingerprint"],
                            "gold_answer": item["gold_answer"]})
    stages = [res.stage_ids or None for res in live]
    prefill_rows, prefill = replicated(decoder, "matched", "prefill", batch, prompts, settings, tokenizer,
                                       replicas=replicas, stages=stages, keep=keep)
    return Matched(live_rows + prefill_rows, prefix_rows, live, prefill)


def fixed_prefix(decoder: Decoder, batch: Batch, prompts: list[list[int]], stages: list[list[int] | None],
                 settings: RunSettings, tokenizer, *, pair=FIXED_PREFIX_CONSTRUCTIONS, replicas=(1, 2),
                 experiment: str = "fixed_prefix") -> list[dict]:
    """Ledger rows of the 2x2 at ``settings.precision`` for one batch: each construction of ``pair`` over the fixed
    prefixes ``stages`` (None: an item without one), replicas checked."""
    rows = []
    for name in pair:
        if not constructions.get(name).rebuildable:
            raise ValueError(f"fixed_prefix.constructions: {name!r} cannot be rebuilt from fixed prefix ids")
        rows += replicated(decoder, experiment, name, batch, prompts, settings, tokenizer, replicas=replicas,
                           stages=stages)[0]
    return rows
