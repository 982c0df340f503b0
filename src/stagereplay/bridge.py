"""The bridge: a prospective check that the ``incremental`` construction is the ``live`` cache, byte for byte.

For rows chosen by a seed from the selection alone (before any outcome exists), the retained live cache is
compared layer by layer (K and V) with a cache rebuilt from the same ids by teacher forcing (prompt prefill, then
the stage tokens one at a time: the schedule the live generation used), and with a one-shot ``prefill`` of the
same ids for contrast; the incremental cache is then continued and its suffix compared with the live one.
This is what lets the fixed-prefix 2x2 use ``incremental`` in place of ``live`` at a precision that did not
generate the prefix. It must run where the live cache exists (inside the matched experiment): a live cache
cannot cross a process boundary. At batch size > 1 the rebuild runs in the row's own batch (:class:`BatchBridge`).

This module knows nothing of Snakemake; it reads no files.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from stagereplay.models import compat
from stagereplay.engine import Decoder, build_cache, continue_greedy
from stagereplay.io.fingerprints import fingerprint_ids, fingerprint_layers

BRIDGE_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("precision", pa.string()),
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

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def choose_bridge_items(item_indexes, n_rows: int, seed: int) -> list[int]:
    """``n_rows`` item indexes drawn without replacement by ``seed`` from the selection (sorted); all if fewer.

    Depends on the selected item indexes only, so the choice is fixed before any generation runs.
    """
    pool = np.sort(np.asarray(list(item_indexes), dtype=np.int64))
    if n_rows >= len(pool):
        return [int(i) for i in pool]
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(pool, size=n_rows, replace=False))


def _first_differing_position(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First sequence position where two (batch, kv_heads, seq, head_dim) tensors differ in any bit, or None."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return min(a.shape[2], b.shape[2]) if a.dim() == 4 and b.dim() == 4 else 0
    bits = _SAME_WIDTH_INT[a.element_size()]
    # Compared as integers of the same width, so the comparison is on bits (NaN == NaN, -0.0 != 0.0).
    differs = (a.contiguous().view(bits) != b.contiguous().view(bits)).any(dim=3).any(dim=1).any(dim=0)  # (seq,)
    hits = torch.nonzero(differs)
    return int(hits[0, 0]) if len(hits) else None


def compare_caches(a, b) -> dict:
    """Byte-for-byte comparison of two caches: exact or not, and the first layer, component and position that differ."""
    return compare_layers(compat.cache_layers(a), compat.cache_layers(b))


def compare_layers(la: list, lb: list) -> dict:
    """:func:`compare_caches` over (K, V) per layer, each (1, kv_heads, seq, head_dim) (a batched row's cache)."""
    result = {"bit_exact": True, "n_layers_differ": 0, "first_layer_differs": None, "component_differs": None,
              "first_position_differs": None}
    if len(la) != len(lb):
        result.update(bit_exact=False, n_layers_differ=abs(len(la) - len(lb)),
                      first_layer_differs=min(len(la), len(lb)), component_differs="shape")
        return result
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(la, lb)):
        found = None
        for component, (x, y) in (("K", (ka, kb)), ("V", (va, vb))):
            pos = _first_differing_position(x, y)
            if pos is not None:
                found = ("shape" if x.shape != y.shape else component, pos)
                break
        if found is None:
            continue
        result["n_layers_differ"] += 1
        if result["bit_exact"]:
            result.update(bit_exact=False, first_layer_differs=layer, component_differs=found[0],
                          first_position_differs=found[1])
    return result


class BridgeRecorder:
    """Collects bridge rows inside the matched experiment; ``observe`` sees the live cache before it is consumed."""

    def __init__(self, decoder: Decoder, chosen: list[int], revision: str, precision: str, max_new_tokens: int):
        self.decoder, self.chosen = decoder, set(int(i) for i in chosen)
        self.revision, self.precision, self.max_new_tokens = revision, precision, max_new_tokens
        self.rows: list[dict] = []
        self._pending: dict[int, list[int]] = {}

    def wants(self, item: dict) -> bool:
        return int(item["item_index"]) in self.chosen

    def observe(self, item: dict, prompt_ids: list[int], boundary) -> None:
        """Called with the live boundary (replica 1) before its cache is continued."""
        if not self.wants(item):
            return
        base = {"item_index": int(item["item_index"]), "item_id": item["item_id"], "revision": self.revision,
                "precision": self.precision, "status": boundary.status}
        if boundary.status != "ok":
            self.rows.append(base)
            return
        live_fp = fingerprint_layers(compat.cache_layers(boundary.cache))[0]
        incremental = build_cache(self.decoder, "incremental", prompt_ids, boundary.stage_ids)
        prefill = build_cache(self.decoder, "prefill", prompt_ids, boundary.stage_ids)
        exact = compare_caches(boundary.cache, incremental)
        contrast = compare_caches(boundary.cache, prefill)
        incremental_fp = fingerprint_layers(compat.cache_layers(incremental))[0]  # before the continuation grows it
        cont = continue_greedy(self.decoder, incremental, boundary.stage_ids[-1], self.max_new_tokens,
                               copy_cache=False)
        self._pending[base["item_index"]] = cont.suffix_ids
        self.rows.append({
            **base, **exact,
            "live_cache_fingerprint": live_fp,
            "incremental_cache_fingerprint": incremental_fp,
            "incremental_suffix_fingerprint": fingerprint_ids(cont.suffix_ids),
            **{f"prefill_{k}": v for k, v in contrast.items() if k != "n_layers_differ"},
        })

    def complete(self, item: dict, live_row: dict) -> None:
        """Compare the incremental continuation with the live replica-1 row of the matched experiment."""
        index = int(item["item_index"])
        if index not in self._pending:
            return
        suffix = self._pending.pop(index)
        row = next(r for r in self.rows if r["item_index"] == index)
        row["live_suffix_fingerprint"] = live_row["suffix_fingerprint"]
        row["suffix_equal"] = list(live_row["suffix_ids"]) == suffix

    def records(self) -> list[dict]:
        if self._pending:
            raise RuntimeError(f"bridge rows {sorted(self._pending)} were observed but never completed")
        return [{name: row.get(name) for name in BRIDGE_SCHEMA.names} for row in self.rows]


class BatchBridge:
    """The bridge at batch > 1: the live rows of a batch against the incremental rebuild *in the same batch*.

    The rebuild is the live run's batched schedule with each row's stage ids teacher-forced
    (:func:`stagereplay.fastdecode.construct_batch`): same plan, same rows, same padding, one token per step, so
    the row's cache must be the live one byte for byte and its continuation the live suffix. Rows of the batch
    without a boundary are filler there (fed padding instead of their greedy ids): a bit-exact bridge then also
    shows that a row's bits do not depend on the other rows' token values. The contrast is the row's one-shot
    prefill in the batch (the matched experiment's). ``observe`` is the matched experiment's ``on_live_batch``.
    """

    def __init__(self, decoder, chosen: list[int], revision: str, precision: str, max_new_tokens: int):
        self.decoder, self.chosen = decoder, set(int(i) for i in chosen)
        self.revision, self.precision, self.max_new_tokens = revision, precision, max_new_tokens
        self.rows: list[dict] = []

    def wanted(self, items: list[dict]) -> list[int]:
        """Rows of a batch that are bridge rows: the only live caches ``observe`` reads."""
        return [r for r, item in enumerate(items) if int(item["item_index"]) in self.chosen]

    def observe(self, items: list[dict], prompts: list[list[int]], live: list) -> None:
        from stagereplay.fastdecode import construct_batch

        wanted = self.wanted(items)
        if not wanted:
            return
        stages = [res.stage_ids if res.stage_ids else None for res in live]
        rebuilt = construct_batch(self.decoder, "incremental", prompts, stages, self.max_new_tokens,
                                  keep_rows=set(wanted))
        prefill = construct_batch(self.decoder, "prefill", prompts, stages, self.max_new_tokens,
                                  keep_rows=set(wanted))
        for r in wanted:
            item, res = items[r], live[r]
            base = {"item_index": int(item["item_index"]), "item_id": item["item_id"], "revision": self.revision,
                    "precision": self.precision}
            if not res.stage_ids:
                self.rows.append({**base, "status": "nonfinite" if res.stop_reason == "nonfinite"
                                  else "boundary_missing"})
                continue
            inc = rebuilt[r]
            contrast = compare_layers(res.cache_layers, prefill[r].cache_layers)
            self.rows.append({
                **base, "status": "ok",  # the boundary was reached (as at batch 1, whatever the suffix did)
                **compare_layers(res.cache_layers, inc.cache_layers),
                "live_cache_fingerprint": fingerprint_layers(res.cache_layers)[0],
                "incremental_cache_fingerprint": fingerprint_layers(inc.cache_layers)[0],
                "live_suffix_fingerprint": fingerprint_ids(res.suffix_ids),
                "incremental_suffix_fingerprint": fingerprint_ids(inc.suffix_ids),
                "suffix_equal": list(res.suffix_ids) == list(inc.suffix_ids),
                **{f"prefill_{k}": v for k, v in contrast.items() if k != "n_layers_differ"},
            })

    def records(self) -> list[dict]:
        return [{name: row.get(name) for name in BRIDGE_SCHEMA.names} for row in self.rows]
