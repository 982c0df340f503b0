"""Ledger rows: the schema, the settings they record, one row from one decoded row, and the recipe's replicas as
ledger rows.

A ledger row is one (item, revision, experiment, precision, construction, replica): its ids, its boundary-cache
fingerprints, its suffix, answer and label, and its layout (decode regime, numerics, batch, left padding and the
pending token's buffer position). Compared constructions of an item must share the layout (checked by the audit).
This is the layer above the recipe (:mod:`stagereplay.experiments.recipe`): the revision, the answer format and the
items' gold answers enter here, never below.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from stagereplay.data.answers import extract_answer, is_correct
from stagereplay.decode.greedy import RowResult
from stagereplay.decode.plans import Batch
from stagereplay.decode.protocol import Decoder
from stagereplay.experiments.recipe import DecodeSettings, ReplicaMismatchError, replica_difference, run_replicas
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


@dataclass(frozen=True)
class RunSettings:
    """What an experiment needs besides the model: plain values from the config. The ledger's fields (revision,
    precision, answer format, regimes) label its rows; the budgets and chunk size are the recipe's (:attr:`decode`)."""

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
        self.decode  # the budgets are checked where the recipe's settings are made

    @property
    def decode(self) -> DecodeSettings:
        """The recipe's settings: the budgets and the chunk size, nothing of the ledger."""
        return DecodeSettings(self.max_stage_tokens, self.max_new_tokens, self.chunk_size)


def ledger_row(item: dict, settings: RunSettings, experiment: str, construction: str, replica: int,
               prompt_ids: list[int], res: RowResult, tokenizer, batch: Batch, row: int) -> dict:
    """The ledger row of one decoded row."""
    status = res.status
    if res.stage_ids:
        whole, ks, vs = res.fingerprints
        margins, stop = res.margins, res.stop_reason
    else:
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


def replicated(decoder: Decoder, experiment: str, construction: str, batch: Batch, prompts: list[list[int]],
               settings: RunSettings, tokenizer, *, replicas=(1, 2), stages=None, matcher=None,
               keep=frozenset()) -> tuple[list[dict], list[RowResult]]:
    """Ledger rows of ``construction`` for every row of ``batch`` with something to decode, each replica run
    from scratch by the recipe and checked bit for bit; and replica 1's results (its kept caches included)."""
    runs = run_replicas(decoder, construction, prompts, settings.decode, replicas=replicas, stages=stages,
                        matcher=matcher, keep=keep)
    rows = []
    for r, item in enumerate(batch.items):
        if stages is not None and stages[r] is None:
            continue
        for replica, res in zip(replicas[1:], runs[1:]):
            differs = replica_difference(runs[0][r], res[r])
            if differs:
                raise ReplicaMismatchError(
                    f"item {item['item_id']!r}: {construction} replicas {replicas[0]} and {replica} at "
                    f"{settings.precision} differ in {differs}. Replicas must be bit-exact: check that "
                    "deterministic algorithms are on and nothing else runs kernels with a different schedule")
        rows += [ledger_row(item, settings, experiment, construction, replica, prompts[r], res[r], tokenizer, batch, r)
                 for replica, res in zip(replicas, runs)]
    return rows, runs[0]
