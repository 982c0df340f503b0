"""The item browser's data: per item, its status, labels, suffixes, margins and transplants, as JSON-safe values.

One record per item (per revision with a ledger) with its status and, per experiment and precision (a cell of the
page), the correctness label of each construction, whether the two constructions' suffixes diverge and where, and
each construction's replica-1 row (suffix ids, margins, answer, stop reason); the primary revision's items carry
their transplant outcomes too. Labels and divergences come from :func:`stagereplay.analysis.tables.all_pairs`, so
the page and the report cannot disagree; ids, margins, answers and statuses are the ledger's replica-1 rows
(replicas are bit-identical by construction).

This module knows no HTML and no tokenizer: :func:`suffix_token_ids` lists the ids the page shows, and the caller
decodes them (:mod:`stagereplay.stages.token_texts` does, with the run's tokenizer). It knows nothing of torch or
Snakemake.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from stagereplay.analysis import tables as analysis
from stagereplay.analysis.row_keys import check_unique
from stagereplay.io.parquet import read_parquet

TRANSPLANT_FIELDS = ("precision", "direction", "donor", "recipient", "layer_set", "component", "positions",
                     "divergent", "outcome", "first_divergence_donor", "first_divergence_recipient")


def _plain(value):
    """A JSON-safe value: numpy scalars as Python ones, NaN and None as None."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _side(row) -> dict:
    """One construction's replica-1 row as the page shows it."""
    return {"construction": row["construction"], "status": row["status"],
            "ids": [int(i) for i in row["suffix_ids"]],
            "margins": [_plain(float(m)) for m in row["margins"]],
            "answer": _plain(row.get("answer")), "correct": _plain(row.get("correct")),
            "stop_reason": _plain(row.get("stop_reason"))}


def _transplant_rows(transplants: dict[str, pd.DataFrame]) -> dict[int, list[dict]]:
    """item_index -> its transplant rows (every revision's), in the report's order of layer sets and directions."""
    by_item: dict[int, list[dict]] = {}
    for revision, frame in transplants.items():
        if frame is None or frame.empty:
            continue
        check_unique(frame, "transplant")
        frame = frame.copy()
        if "positions" not in frame.columns:
            frame["positions"] = "all"
        ordered = sorted(frame.itertuples(index=False),
                         key=lambda r: (r.precision, analysis.transplant_row_key(r), r.direction))
        for r in ordered:
            row = r._asdict()
            record = {"revision": revision, "label": analysis.transplant_label(row),
                      **{f: _plain(row.get(f)) for f in TRANSPLANT_FIELDS}}
            by_item.setdefault(int(r.item_index), []).append(record)
    return by_item


def browser_data(ledgers: dict[str, pd.DataFrame], token_texts: dict[str, dict[int, str]],
                 transplants: dict[str, pd.DataFrame] | None = None, selection: pd.DataFrame | None = None,
                 run: str = "") -> dict:
    """The page's data: ``ledgers`` and ``transplants`` map a revision to its table, ``token_texts`` a revision to
    {token id: its text decoded alone}, ``selection`` is selection/items.parquet (questions and gold answers).

    Transplants run on the primary revision's prefixes (the first ledger's), so their rows go with its items."""
    questions = {}
    if selection is not None and not selection.empty:
        questions = {int(r.item_index): r.question for r in selection.itertuples(index=False)}
    transplant_rows = _transplant_rows(transplants or {})
    cells, items = [], []
    for position, (revision, ledger) in enumerate(ledgers.items()):
        check_unique(ledger, "ledger")
        pairs = {(int(p["item_index"]), p["experiment"], p["precision"]): p
                 for p in analysis.all_pairs(ledger).to_dict("records")}
        coinciding = analysis.coinciding_comparisons(ledger)
        rows = ledger[ledger["replica"] == 1]
        revision_cells = []
        for experiment, a, b in analysis.comparisons(ledger):
            present = rows.loc[rows["experiment"] == experiment, "precision"]
            for precision in analysis.sort_precisions(present):
                note = coinciding.get((revision, precision)) if experiment == "fixed_prefix" else None
                revision_cells.append({"key": f"{revision}/{experiment}/{precision}", "revision": revision,
                                       "experiment": experiment, "precision": precision, "a": a, "b": b,
                                       "note": note})
        cells += revision_cells
        by_item: dict[int, dict[tuple, dict]] = {}
        for row in rows.to_dict("records"):
            by_item.setdefault(int(row["item_index"]), {})[
                (row["experiment"], row["precision"], row["construction"])] = row
        for item_index in sorted(by_item):
            by = by_item[item_index]
            first = by[min(by)]
            live = by.get(("matched", first["precision"], "live"), first)
            statuses = sorted({row["status"] for row in by.values()} - {"ok"})
            record = {"revision": revision, "item_index": item_index, "item_id": first["item_id"],
                      "question": questions.get(item_index), "gold_answer": _plain(first.get("gold_answer")),
                      "status": ", ".join(statuses) if statuses else "ok",
                      "stage_ids": [int(i) for i in live["stage_ids"]], "cells": {}, "divergent": False,
                      "transplants": transplant_rows.get(item_index, []) if position == 0 else []}
            for cell in revision_cells:
                sides = {c: by.get((cell["experiment"], cell["precision"], c)) for c in (cell["a"], cell["b"])}
                if all(side is None for side in sides.values()):
                    continue
                pair = pairs.get((item_index, cell["experiment"], cell["precision"]))
                divergent = bool(pair["disagree"]) if pair is not None else False
                entry = {"compared": pair is not None, "divergent": divergent,
                         "first_divergence": int(pair["first_divergence"]) if divergent else None,
                         "sides": {c: _side(row) for c, row in sides.items() if row is not None}}
                record["cells"][cell["key"]] = entry
                record["divergent"] = record["divergent"] or divergent
            items.append(record)
    tokens = {revision: {str(int(i)): text for i, text in texts.items()} for revision, texts in token_texts.items()}
    return {"run": run, "cells": cells, "items": items, "tokens": tokens}


def read_results(ledgers: dict[str, str], transplants: dict[str, str] | None = None, selection: str | None = None
                 ) -> tuple[dict[str, pd.DataFrame], dict[str, pd.DataFrame], pd.DataFrame | None]:
    """The page's inputs from their paths: ledgers, transplants (one not on disk is left out), the selection."""
    frames = {revision: read_parquet(path) for revision, path in ledgers.items()}
    transplant_frames = {revision: read_parquet(path) for revision, path in (transplants or {}).items()
                         if path and Path(path).is_file()}
    chosen = read_parquet(selection) if selection and Path(selection).is_file() else None
    return frames, transplant_frames, chosen


def suffix_token_ids(ledgers: dict[str, pd.DataFrame]) -> dict[str, set[int]]:
    """Per revision, every token id the page shows (replica-1 suffixes and stage ids): the ids to decode."""
    ids: dict[str, set[int]] = {}
    for revision, ledger in ledgers.items():
        rows = ledger[ledger["replica"] == 1]
        found = ids.setdefault(revision, set())
        for column in ("suffix_ids", "stage_ids"):
            for values in rows[column]:
                found.update(int(i) for i in values)
    return ids
