"""The fixed-prefix 2x2: construction {incremental, prefill} x precision, every item's prefix ids held fixed.

The prefix ids come from the reference generation (the matched experiment's live replica at the config's
``reference_precision``), so every precision continues from the same token state. ``incremental`` (prompt
prefill, then the stage tokens fed one at a time) stands in for ``live`` at a precision that did not generate
the prefix; the bridge checks that it is ``live`` bit for bit where a live cache exists. Each cell runs two
replicas that must be bit-exact (token ids and cache bytes), else :class:`ReplicaMismatchError` names the item.

Rows go to the ledger with ``experiment="fixed_prefix"``. Non-finite logits (fp16 overflow) end a suffix and
mark its row ``nonfinite``; such rows are never compared as if valid.
"""

from __future__ import annotations

from stagereplay.engine import Decoder, build_cache, continue_greedy
from stagereplay.experiment import Settings, _cache_fields, _row, check_replicas

EXPERIMENT = "fixed_prefix"
CONSTRUCTIONS = ("incremental", "prefill")


def has_prefix(prefix_row: dict) -> bool:
    """Whether the reference generation reached the stage boundary (its stage ids are then the fixed prefix)."""
    return len(prefix_row["stage_ids"]) > 0


def fixed_prefix_item(decoder: Decoder, tokenizer, item: dict, prefix_row: dict, settings: Settings) -> list[dict]:
    """Ledger rows of the 2x2 at ``settings.precision`` for one item: each construction, replicas 1 and 2."""
    if int(prefix_row["item_index"]) != int(item["item_index"]):
        raise ValueError(f"item {item['item_id']!r}: prefix row of item_index {prefix_row['item_index']} handed in; "
                         "the prefixes file does not belong to this selection")
    if not has_prefix(prefix_row):
        return []
    prompt_ids = [int(i) for i in prefix_row["prompt_ids"]]
    stage_ids = [int(i) for i in prefix_row["stage_ids"]]
    rows: list[dict] = []
    for construction in CONSTRUCTIONS:
        cell = []
        for replica in (1, 2):
            cache = build_cache(decoder, construction, prompt_ids, stage_ids)
            fields = _cache_fields(cache)
            cont = continue_greedy(decoder, cache, stage_ids[-1], settings.max_new_tokens, copy_cache=False)
            status = "nonfinite" if cont.stop_reason == "nonfinite" else "ok"
            cell.append(_row(item, settings, EXPERIMENT, construction, replica, status, prompt_ids, stage_ids,
                             fields, cont.suffix_ids, cont.margins, cont.stop_reason, tokenizer))
        check_replicas(cell, item["item_id"])
        rows += cell
    return rows


def fixed_prefix_batch(decoder, tokenizer, items: list[dict], prefix_rows: list[dict], settings: Settings,
                       batch_index: int, replicas: tuple[int, ...] = (1, 2)) -> list[dict]:
    """Ledger rows of the 2x2 at ``settings.precision`` for one batch of the recorded plan, decoded together.

    ``items`` and ``prefix_rows`` are the plan's batch in row order. Each construction is built for the whole
    batch in the matched experiment's schedule (:func:`stagereplay.fastdecode.construct_batch`): ``prefill``
    over the rows with a prefix, one forward; ``incremental`` as the live run was stepped, stage ids forced.
    Rows record the plan's batch, row and size; replicas must be bit-exact, as at batch 1.
    """
    from stagereplay.fastdecode import batch_row_fields, construct_batch, ledger_row

    for item, prefix_row in zip(items, prefix_rows, strict=True):
        if int(prefix_row["item_index"]) != int(item["item_index"]):
            raise ValueError(f"item {item['item_id']!r}: prefix row of item_index {prefix_row['item_index']} handed "
                             "in; the prefixes file does not belong to this selection")
    n = len(items)
    prompts = [[int(i) for i in p["prompt_ids"]] for p in prefix_rows]
    stages = [[int(i) for i in p["stage_ids"]] if has_prefix(p) else None for p in prefix_rows]
    runs = {c: [construct_batch(decoder, c, prompts, stages, settings.max_new_tokens, keep_rows=set())
                for _ in replicas] for c in CONSTRUCTIONS}  # fingerprints only: four sets of a batch's caches
    rows: list[dict] = []
    for r in (r for r in range(n) if stages[r] is not None):
        for construction in CONSTRUCTIONS:
            cell = [batch_row_fields(ledger_row(items[r], settings, EXPERIMENT, construction, replica, prompts[r],
                                                run[r], tokenizer), r, n, batch_index)
                    for replica, run in zip(replicas, runs[construction])]
            check_replicas(cell, items[r]["item_id"])
            rows += cell
    return rows
