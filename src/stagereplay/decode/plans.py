"""Batch plans: which items are decoded together, in which rows. Batch composition is a construction factor (a
row's bits may depend on its batch's layout), so the plan is fixed by a seed, recorded in provenance and rebuilt
by every later stage. At ``batch_size`` 1 there is no plan: every item is a batch of one row, in item order."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """``batches[j]`` lists item ids in row order. Fixed by ``seed``."""

    seed: int
    batch_size: int
    batches: tuple[tuple[str, ...], ...]

    def record(self) -> dict:
        """The plan as provenance records it."""
        return {"seed": self.seed, "batch_size": self.batch_size, "batches": [list(b) for b in self.batches]}

    @classmethod
    def from_record(cls, record: dict | None) -> "BatchPlan | None":
        if record is None:
            return None
        return cls(int(record["seed"]), int(record["batch_size"]), tuple(tuple(b) for b in record["batches"]))


def batch_plan(item_ids: list[str], batch_size: int, seed: int) -> BatchPlan | None:
    """A seeded shuffle of the items cut into batches of ``batch_size`` (the last may be smaller); None at 1."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if len(set(item_ids)) != len(item_ids):
        raise ValueError("batch_plan: item ids must be unique")
    if batch_size == 1:
        return None
    order = list(item_ids)
    random.Random(seed).shuffle(order)
    return BatchPlan(seed, batch_size, tuple(tuple(order[i:i + batch_size]) for i in range(0, len(order), batch_size)))


@dataclass(frozen=True)
class Batch:
    """One batch of a run: its index in the plan (None without a plan) and its items in row order."""

    index: int | None
    items: tuple[dict, ...]

    def layout_fields(self, row: int) -> dict:
        """The ledger's batch columns of a row (null without a plan)."""
        if self.index is None:
            return {"batch_index": None, "batch_row": None, "batch_rows": None}
        return {"batch_index": self.index, "batch_row": row, "batch_rows": len(self.items)}


def batches_of(items: list[dict], plan: BatchPlan | None, shard: int = 0, n_shards: int = 1,
               source: str = "the selection") -> list[Batch]:
    """This shard's batches: the plan's (shards take whole batches, so an item's batch and bits do not depend on
    the shard count), or without a plan each of ``items`` of this shard alone, in item order."""
    if plan is None:
        mine = [item for item in items if int(item["item_index"]) % n_shards == shard]
        return [Batch(None, (item,)) for item in sorted(mine, key=lambda i: int(i["item_index"]))]
    by_id = {item["item_id"]: item for item in items}
    missing = [i for b in plan.batches for i in b if i not in by_id]
    if missing:
        raise KeyError(f"items {missing[:5]} of the recorded batch plan are not in {source}; the results belong to "
                       "another selection: rerun reconstruct_prefixes")
    return [Batch(j, tuple(by_id[i] for i in plan.batches[j])) for j in range(len(plan.batches)) if j % n_shards == shard]
