"""The saved-ledger audit: recompute every ledger row through the same recipes, and compare every column.

For each batch (an item alone at batch 1) the audit reruns the experiments that produced its rows, from scratch,
with one replica (:func:`stagereplay.experiments.matched.matched` and ``fixed_prefix``), and compares every
ledger column (token ids, fingerprints, margins as float32 bytes, answer, label, layout) of every stored replica
with it. It also refuses what a recomputation cannot vouch for: duplicated keys, replicas outside the experiment's
set, rows no experiment produces, and compared constructions of an item decoded in different layouts (layout
parity). A row that the experiments imply but the ledger lacks is reported as missing.

Findings are data, not exceptions: :func:`audit_batch` never raises on a mismatch; :func:`failures_message` turns
failing rows into the message with which the pipeline stops.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pyarrow as pa

from stagereplay.io.ids import first_divergence
from stagereplay.experiments.rows import LAYOUT_COLUMNS, LEDGER_SCHEMA
from stagereplay.io.keys import LEDGER_FIELDS, LEDGER_KEY

AUDIT_SCHEMA = pa.schema([
    *LEDGER_FIELDS,
    ("reproduced", pa.bool_()),
    ("differed", pa.list_(pa.string())),  # ledger columns that did not reproduce ("missing_row", "error", ...)
    ("detail", pa.string()),  # the first difference of each, in words
])

REPLICAS = (1, 2)  # every experiment's replica set


class AuditFailedError(RuntimeError):
    """Ledger rows that the audit could not reproduce."""


def _norm(column: str, value):
    """A ledger value in a form that compares exactly (margins as their float32 bytes)."""
    if column == "margins":
        return np.asarray([] if value is None else list(value), dtype="<f4").tobytes()
    if isinstance(value, (list, tuple, np.ndarray)):
        return [x.item() if hasattr(x, "item") else x for x in value]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if hasattr(value, "item") else value


def _describe(column: str, stored, recomputed) -> str:
    if column == "margins":
        a, b = np.frombuffer(stored, "<f4"), np.frombuffer(recomputed, "<f4")
        pos = next((i for i, (x, y) in enumerate(zip(a.view("<i4"), b.view("<i4"))) if x != y), min(len(a), len(b)))
        return f"margins differ from step {pos}"
    if isinstance(stored, list) and isinstance(recomputed, list):
        pos = first_divergence(stored, recomputed)
        at = lambda xs: repr(xs[pos]) if pos is not None and pos < len(xs) else "(end)"  # noqa: E731
        return f"{column} differ at index {pos}: ledger {at(stored)}, recomputed {at(recomputed)}"
    return f"{column}: ledger {stored!r}, recomputed {recomputed!r}"


def compare_row(stored: dict, expected: dict) -> tuple[list[str], str]:
    """Columns of ``stored`` that differ from ``expected`` (every ledger column), and the differences in words."""
    differed, details = [], []
    for column in LEDGER_SCHEMA.names:
        a, b = _norm(column, stored.get(column)), _norm(column, expected.get(column))
        if a != b:
            differed.append(column)
            details.append(_describe(column, a, b))
    return differed, "; ".join(details)


def record(row: dict, reproduced: bool, differed: list[str], detail: str) -> dict:
    return {"item_index": int(row["item_index"]), "item_id": row["item_id"], "revision": row["revision"],
            "experiment": row["experiment"], "precision": row["precision"], "construction": row["construction"],
            "replica": int(row["replica"]), "reproduced": reproduced, "differed": differed, "detail": detail}


def layout_parity(rows: list[dict]) -> dict[int, str]:
    """Rows (by position in ``rows``) whose layout differs from the other constructions of their item and
    experiment: compared constructions must be decoded in one layout."""
    out = {}
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        if row.get("status") == "ok":
            groups.setdefault((int(row["item_index"]), row["experiment"], row["precision"]), []).append(i)
    for members in groups.values():
        layouts = Counter(tuple(_norm(c, rows[i].get(c)) for c in LAYOUT_COLUMNS) for i in members)
        if len(layouts) < 2:
            continue
        common = layouts.most_common(1)[0][0]
        for i in members:
            mine = tuple(_norm(c, rows[i].get(c)) for c in LAYOUT_COLUMNS)
            if mine != common:
                diff = [f"{c} {a!r} vs {b!r}" for c, a, b in zip(LAYOUT_COLUMNS, mine, common) if a != b]
                out[i] = "decoded in another layout than the item's other constructions: " + ", ".join(diff)
    return out


def held_counts(stored: list[dict]) -> Counter:
    """How many times the stored rows hold each row key (:data:`LEDGER_KEY`), for :func:`unvouched`."""
    return Counter(tuple(_norm(k, r[k]) for k in LEDGER_KEY) for r in stored)


def unvouched(row: dict, counts: Counter) -> dict | None:
    """The record of a stored row that no recomputation can vouch for (its key held more than once, or a replica
    outside :data:`REPLICAS`), else None: the ledger's audit and the engine's both ask it first."""
    if counts[tuple(_norm(k, row[k]) for k in LEDGER_KEY)] > 1:
        return record(row, False, ["duplicate_row"], "the ledger holds this (item, revision, experiment, precision, "
                      "construction, replica) more than once")
    if int(row["replica"]) not in REPLICAS:
        return record(row, False, ["unexpected_row"], f"replica {int(row['replica'])} is not one of the "
                      f"experiment's replicas {list(REPLICAS)}")
    return None


def missing_replicas(expected: dict[tuple, dict], seen: set[tuple], detail: str) -> list[dict]:
    """A ``missing_row`` record for each replica of :data:`REPLICAS` of each recomputed row (``expected``: its key
    -> the row) whose (key, replica) the stored rows lack (``seen``)."""
    return [record({**row, "replica": replica}, False, ["missing_row"], detail)
            for key, row in expected.items() for replica in REPLICAS if (*key, replica) not in seen]


def audit_batch(stored: list[dict], recomputed: list[dict] | Exception) -> list[dict]:
    """One audit record per stored row of one batch and precision, plus one per row that the recomputed
    experiments produce and the ledger lacks. ``recomputed``: the experiments' rows with one replica, or the
    exception that the recomputation raised (a finding about every row, not a crash)."""
    counts = held_counts(stored)
    parity = layout_parity(stored)
    expected = {} if isinstance(recomputed, Exception) else {
        (int(r["item_index"]), r["experiment"], r["construction"]): r for r in recomputed}
    out = []
    for i, row in enumerate(stored):
        key = (int(row["item_index"]), row["experiment"], row["construction"])
        if (refused := unvouched(row, counts)) is not None:
            out.append(refused)
        elif isinstance(recomputed, Exception):
            out.append(record(row, False, ["error"], f"{type(recomputed).__name__}: {recomputed}"))
        elif key not in expected:
            out.append(record(row, False, ["unexpected_row"],
                              "the ledger holds a row that the recomputed experiment does not produce"))
        else:
            differed, detail = compare_row(row, {**expected[key], "replica": row["replica"]})
            if i in parity:
                differed, detail = differed + ["layout_parity"], "; ".join(filter(None, [detail, parity[i]]))
            out.append(record(row, not differed, differed, detail))
    seen = {(int(r["item_index"]), r["experiment"], r["construction"], int(r["replica"])) for r in stored}
    return out + missing_replicas(expected, seen, "the recomputed experiment produces this row but the ledger lacks it")


def failures_message(failed: list[dict], limit: int = 20) -> str:
    lines = [f"{len(failed)} ledger row(s) did not reproduce:"]
    for row in failed[:limit]:
        lines.append(f"  item {row['item_id']!r} (item_index {row['item_index']}), {row['revision']} "
                     f"{row['experiment']}/{row['precision']}/{row['construction']} replica {row['replica']}: "
                     f"{', '.join(row['differed'])}" + (f" ({row['detail']})" if row.get("detail") else ""))
    if len(failed) > limit:
        lines.append(f"  ... and {len(failed) - limit} more (see the audit file)")
    return "\n".join(lines)
