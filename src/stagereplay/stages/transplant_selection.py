"""Stage ``select_transplant_items``: the outcome-blind choice of the items to transplant, from a baseline file.

The baseline (the ledger at the primary revision, ``replay_baseline.parquet`` at another; see
:mod:`stagereplay.stages.transplant`) holds each item's two constructions and their own continuations; the selection
is decided from their suffix ids alone, before any transplant runs. Loads no model: this module and what it imports
never import torch (``tests/test_job_imports.py``), so the job starts in well under a second.
"""

from __future__ import annotations

import logging

import pandas as pd
import pyarrow as pa

from stagereplay.experiments.transplant import choose_transplant_items
from stagereplay.experiments.transplant_specs import rebuilt_as
from stagereplay.io.keys import ITEM_FIELDS
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.io.provenance import recorded_stages, software_versions

log = logging.getLogger("stagereplay")

BASELINE_EXPERIMENT = "transplant_baseline"

SELECTION_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("divergent", pa.bool_()),  # the two constructions' own suffix ids differ
    ("first_divergence", pa.int32()),
])


def baseline_rows(baseline: pd.DataFrame, precision: str, pair) -> pd.DataFrame:
    """One row per item whose two constructions of ``pair`` both ran (status ok) at ``precision``, from the
    baseline's replica-1 rows. Columns: item_index, item_id, row_a, row_b (dicts), suffix_a, suffix_b."""
    rep1 = baseline[(baseline["replica"] == 1) & (baseline["precision"] == precision)]
    if rep1.empty:
        raise ValueError(f"the baseline has no rows at precision {precision!r}; transplant.precision must be one of "
                         f"the precisions the baseline ran ({sorted(baseline['precision'].unique())})")
    columns = ["item_index", "item_id", "row_a", "row_b", "suffix_a", "suffix_b"]
    if not (rep1["status"] == "ok").any():
        # no item reached the stage boundary (or every one overflowed): no prefix, so no construction but the live
        # generation's rows, and nothing to compare; the report says why each item was left out
        log.warning("no item of the baseline reached the stage boundary at %s (statuses %s): nothing to transplant",
                    precision, sorted(rep1["status"].unique()))
        return pd.DataFrame(columns=columns)
    missing = [c for c in pair if c not in set(rep1["construction"])]
    if missing:
        raise ValueError(f"transplant.constructions {list(pair)}: the baseline has no {missing} rows at {precision}; "
                         "add them to fixed_prefix.constructions (or transplant a pair the experiments ran)")
    order = {"matched": 0, "fixed_prefix": 1, BASELINE_EXPERIMENT: 2}
    rows = []
    for item_index, group in rep1.groupby("item_index", sort=True):
        by, experiments = {}, {}
        for r in sorted(group.to_dict("records"), key=lambda r: order.get(r["experiment"], 3)):
            by.setdefault(r["construction"], r)
            experiments.setdefault(r["experiment"], {})[r["construction"]] = r
        # both sides from one experiment where one ran both (the same prefix ids and batches); else the first of each
        by = next((e for e in experiments.values() if pair[0] in e and pair[1] in e), by)
        a, b = by.get(pair[0]), by.get(pair[1])
        if a is None or b is None or a["status"] != "ok" or b["status"] != "ok":
            continue
        if list(a["prompt_ids"]) != list(b["prompt_ids"]) or list(a["stage_ids"]) != list(b["stage_ids"]):
            raise ValueError(f"item {a['item_id']!r}: the baseline's {pair[0]} and {pair[1]} rows do not share their "
                             "prefix ids (the fixed-prefix 2x2 runs on the reference precision's prefixes)")
        rows.append({"item_index": int(item_index), "item_id": a["item_id"], "row_a": a, "row_b": b,
                     "suffix_a": list(a["suffix_ids"]), "suffix_b": list(b["suffix_ids"])})
    return pd.DataFrame(rows, columns=columns)


def select_transplant_items(baseline_path: str, out_path: str, *, revision: str, precision: str, select,
                            seed: int = 0, constructions=("live", "prefill")) -> pd.DataFrame:
    """Write the outcome-blind transplant selection (before any transplant runs), with its rule and seed."""
    pairs = baseline_rows(read_parquet(baseline_path), precision, baseline_pair(baseline_path, constructions))
    chosen = choose_transplant_items(pairs[["item_index", "item_id", "suffix_a", "suffix_b"]], select, seed)
    chosen["revision"] = revision
    chosen["precision"] = precision
    n_divergent = sum(a != b for a, b in zip(pairs["suffix_a"], pairs["suffix_b"]))
    prov = {**software_versions(), "stage": "select_transplant_items",
            "selection": {"rule": select, "seed": seed, "decided_from": "suffix token ids of the two constructions "
                          "(replica 1); never correctness or transplant outcomes",
                          "n_candidates": int(len(pairs)), "n_divergent": int(n_divergent),
                          "n_selected": int(len(chosen))},
            "baseline": {"path": str(baseline_path), "stage": read_provenance(baseline_path).get("stage")},
            "config": {"revision": revision, "precision": precision, "select": select, "seed": seed,
                       "constructions": list(constructions)}}
    chosen = chosen.astype({"first_divergence": "object"}).where(chosen.notna(), None)
    write_parquet(chosen[SELECTION_SCHEMA.names], out_path, prov, SELECTION_SCHEMA)
    log.info("selected %d of %d candidate items (%d divergent) by %r", len(chosen), len(pairs), n_divergent, select)
    return chosen


def baseline_pair(baseline_path: str, constructions) -> tuple[str, str]:
    """The pair as the baseline names it: a replayed baseline holds ``incremental`` where the pair says ``live``."""
    if "replay_fixed_prefixes" in recorded_stages(baseline_path):  # its parts' stage: the file is gathered
        return tuple(rebuilt_as(c) for c in constructions)
    return tuple(constructions)
