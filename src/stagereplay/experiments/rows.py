"""Ledger rows: the schema, one row from one decoded row, and the replica check.

A ledger row is one (item, revision, experiment, precision, construction, replica): its ids, its boundary-cache
fingerprints, its suffix, answer and label, and its layout (decode regime, numerics, batch, left padding and the
pending token's buffer position). Compared constructions of an item must share the layout (checked by the audit).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from stagereplay.data.answers import extract_answer, is_correct
from stagereplay.decode.greedy import RowResult
from stagereplay.decode.plans import Batch
from stagereplay.io.fingerprints import fingerprint_ids
from stagereplay.io.keys import LEDGER_FIELDS

LEDGER_SCHEMA = pa.schema([
    *LEDGER_FIELDS,
    ("status", pa.string()),  # ok | boundary_missing | nonfinite
    ("prompt_ids", pa.list_(pa.int32())),
    ("stage_ids", pa.list_(pa.int32())),  # generated ids up to and including the boundary token
    ("prefix_fingerprint", pa.string()),
    ("cache_fingerprint", pa.string()),
    ("cache_k_fingerprints", pa.list_(pa.string())),
    ("cache_v_fingerprints", pa.list_(pa.string())),
    ("suffix_ids", pa.list_(pa.int32())),  # boundary_missing: everything generated within the stage budget
    ("suffix_fingerprint", pa.string()),
    ("margins", pa.list_(pa.float32())),  # top-2 logit margin at every decode step
    ("stop_reason", pa.string()),
    ("suffix_text", pa.string()),
    ("answer", pa.string()),
    ("gold_answer", pa.string()),
    ("correct", pa.bool_()),
    ("decode_regime", pa.string()),  # eager | static | cuda_graph: part of the construction
    ("batch_index", pa.int32()),  # batched runs: the item's batch in the seeded plan, its row, the batch's size
    ("batch_row", pa.int16()),
    ("batch_rows", pa.int16()),
    ("numerics", pa.string()),  # the numerics regime (default | invariant): a construction factor
    ("layout_pad", pa.int32()),  # buffer positions before the row's first token (its left padding)
    ("layout_position", pa.int32()),  # buffer position where the pending (boundary) token is fed
])

# what compared constructions of one item must share: decoded in one layout
LAYOUT_COLUMNS = ("decode_regime", "numerics", "batch_index", "batch_row", "batch_rows", "layout_pad",
                  "layout_position")
REPLICA_COLUMNS = ("status", "stage_ids", "cache_fingerprint", "suffix_fingerprint", "stop_reason", "layout_pad",
                   "layout_position")


class ReplicaMismatchError(RuntimeError):
    """Two replicas of one construction and precision that are not bit-identical."""


@dataclass(frozen=True)
class RunSettings:
    """What an experiment needs besides the model: plain values from the config."""

    revision: str
    precision: str
    max_stage_tokens: int | None  # None: the stage replays fixed prefixes and generates none
    max_new_tokens: int
    answer_format: str = "last_number"
    stage_end: str | None = "</think>"
    decode_regime: str = "eager"
    numerics: str = "default"  # default | invariant
    chunk_size: int = 16  # the chunked construction's forwards

    def __post_init__(self):
        for key in ("max_stage_tokens", "max_new_tokens", "chunk_size"):
            value = getattr(self, key)
            if key == "max_stage_tokens" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} is {value!r}; it must be a whole number of tokens, at least 1")


def ledger_row(item: dict, settings: RunSettings, experiment: str, construction: str, replica: int,
               prompt_ids: list[int], res: RowResult, tokenizer, batch: Batch, row: int) -> dict:
    """The ledger row of one decoded row."""
    if res.stage_ids:
        status = "nonfinite" if res.stop_reason == "nonfinite" else "ok"
        whole, ks, vs = res.fingerprints
        margins, stop = res.margins, res.stop_reason
    else:
        status = "nonfinite" if res.stop_reason == "nonfinite" else "boundary_missing"
        whole, ks, vs = "", [], []
        margins, stop = [], status
    text = tokenizer.decode(res.suffix_ids) if res.suffix_ids else ""
    answer = extract_answer(text, settings.answer_format, settings.stage_end) if status == "ok" else None
    return {
        "item_index": int(item["item_index"]), "item_id": item["item_id"], "revision": settings.revision,
        "experiment": experiment, "precision": settings.precision, "construction": construction,
        "replica": replica, "status": status, "prompt_ids": list(prompt_ids), "stage_ids": list(res.stage_ids),
        "prefix_fingerprint": fingerprint_ids(list(prompt_ids) + list(res.stage_ids)),
        "cache_fingerprint": whole, "cache_k_fingerprints": ks, "cache_v_fingerprints": vs,
        "suffix_ids": list(res.suffix_ids), "suffix_fingerprint": fingerprint_ids(res.suffix_ids),
        "margins": list(margins), "stop_reason": stop, "suffix_text": text, "answer": answer,
        "gold_answer": item["gold_answer"],
        "correct": is_correct(answer, item["gold_answer"]) if status == "ok" else None,
        "decode_regime": settings.decode_regime, "numerics": settings.numerics, **batch.layout_fields(row),
        "layout_pad": res.pad, "layout_position": res.position,
    }


def check_replicas(rows: list[dict], item_id: str) -> None:
    """Raise if rows of one (construction, precision) differ in any id, fingerprint or layout."""
    first = rows[0]
    for other in rows[1:]:
        for key in REPLICA_COLUMNS:
            if first[key] != other[key]:
                detail = ""
                if key == "cache_fingerprint":
                    layers = [i for i, (a, b) in enumerate(zip(first["cache_k_fingerprints"],
                                                               other["cache_k_fingerprints"])) if a != b]
                    detail = f" (K differs from layer {layers[0] if layers else '?'})"
                raise ReplicaMismatchError(
                    f"item {item_id!r}: {first['construction']} replicas {first['replica']} and {other['replica']} "
                    f"at {first['precision']} differ in {key}{detail}. Replicas must be bit-exact: check that "
                    "deterministic algorithms are on and nothing else runs kernels with a different schedule")
