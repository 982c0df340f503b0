"""The bridge: a prospective check that the ``incremental`` construction is the ``live`` cache, byte for byte.

For rows chosen by a seed from the selection alone (before any outcome exists), the retained live cache (kept by
the matched experiment at its boundary) is compared layer by layer (K and V) with the ``incremental`` rebuild of
the same ids in the same batch and layout, and with the matched experiment's one-shot ``prefill`` for contrast;
the incremental cache is then continued and its suffix compared with the live one. This is what lets the
fixed-prefix 2x2 use ``incremental`` in place of ``live`` at a precision that did not generate the prefix. It runs
where the live cache exists (inside the matched experiment): a live cache cannot cross a process boundary.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stagereplay.decode.plans import Batch
from stagereplay.decode.protocol import Decoder
from stagereplay.experiments.cache_differences import compare_layers
from stagereplay.experiments.matched import Matched
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import RunSettings
from stagereplay.io.fingerprints import fingerprint_ids
from stagereplay.io.keys import ITEM_FIELDS

BRIDGE_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("status", pa.string()),  # ok | boundary_missing | nonfinite (no boundary: nothing to compare)
    ("bit_exact", pa.bool_()),  # incremental cache == live cache, every layer's K and V bytes
    ("n_layers_differ", pa.int32()),
    ("first_layer_differs", pa.int32()),  # null when bit_exact
    ("component_differs", pa.string()),  # "K" | "V" | "shape"; null when bit_exact
    ("first_position_differs", pa.int32()),  # first cache position (token index) where that layer differs
    ("live_cache_fingerprint", pa.string()),
    ("incremental_cache_fingerprint", pa.string()),
    ("live_suffix_fingerprint", pa.string()),
    ("incremental_suffix_fingerprint", pa.string()),
    ("suffix_equal", pa.bool_()),
    # The contrast that shows why the schedule matters: a one-shot prefill of the same ids against live.
    ("prefill_bit_exact", pa.bool_()),
    ("prefill_first_layer_differs", pa.int32()),
    ("prefill_component_differs", pa.string()),
    ("prefill_first_position_differs", pa.int32()),
])


def choose_bridge_items(item_indexes, n_rows: int, seed: int) -> list[int]:
    """``n_rows`` item indexes drawn without replacement by ``seed`` from the selection (sorted); all if fewer.

    Depends on the selected item indexes only, so the choice is fixed before any generation runs.
    """
    pool = np.sort(np.asarray(list(item_indexes), dtype=np.int64))
    if n_rows >= len(pool):
        return [int(i) for i in pool]
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(pool, size=n_rows, replace=False))


def bridge_rows_of(batch: Batch, chosen: set[int]) -> set[int]:
    """Rows of ``batch`` that are bridge rows (the matched experiment keeps their live and prefill caches)."""
    return {r for r, item in enumerate(batch.items) if int(item["item_index"]) in chosen}


def bridge(decoder: Decoder, batch: Batch, prompts: list[list[int]], settings: RunSettings, matched: Matched,
           rows: set[int]) -> list[dict]:
    """Bridge records of ``rows`` of one batch, from the matched experiment's kept caches and an incremental
    rebuild of the batch."""
    if not rows:
        return []
    incremental = run(decoder, "incremental", prompts, settings.decode, stages=matched.stages(), keep=rows)
    out = []
    for r in sorted(rows):
        item, live = batch.items[r], matched.live[r]
        base = {"item_index": int(item["item_index"]), "item_id": item["item_id"], "revision": settings.revision,
                "precision": settings.precision}
        if not live.stage_ids:
            out.append({**base, "status": "nonfinite" if live.stop_reason == "nonfinite" else "boundary_missing"})
            continue
        inc = incremental[r]
        contrast = compare_layers(live.layers, matched.prefill[r].layers)
        out.append({
            **base, "status": "ok",  # the boundary was reached, whatever the suffix did
            **compare_layers(live.layers, inc.layers),
            "live_cache_fingerprint": live.fingerprints[0],
            "incremental_cache_fingerprint": inc.fingerprints[0],
            "live_suffix_fingerprint": fingerprint_ids(live.suffix_ids),
            "incremental_suffix_fingerprint": fingerprint_ids(inc.suffix_ids),
            "suffix_equal": list(live.suffix_ids) == list(inc.suffix_ids),
            **{f"prefill_{k}": v for k, v in contrast.items() if k != "n_layers_differ"},
        })
    return [{name: row.get(name) for name in BRIDGE_SCHEMA.names} for row in out]
