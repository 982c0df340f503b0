"""The saved-ledger audit: recompute every ledger row from the selection, the model and the ledger's own ids.

For each item the audit reruns what produced its rows, from scratch, and compares every column (token ids,
fingerprints, margins as float32 bytes, answer and label) with what the ledger holds:
- ``matched`` ``live``: the whole greedy generation from the prompt (rebuilt from the selection's question);
- ``matched`` ``prefill``: a one-shot prefill over the regenerated prefix;
- ``fixed_prefix`` ``incremental`` / ``prefill``: the construction rebuilt over the reference prefix, which must
  itself equal the ledger's matched live prefix at the reference precision (audited in its own right).
Each distinct computation runs once and every replica row that claims it is compared with it (replicas are
bit-exact by contract). A row that the experiment implies but the ledger lacks is reported as missing.
A batched ledger (a ``batch_plan`` in its provenance) is recomputed batch by batch, each row in its recorded batch
(:func:`recompute_batch`), and compared the same way, its batch columns included.

Findings are data, not exceptions: :func:`audit_item` never raises on a mismatch. :func:`failures_message`
turns the failing rows into the message with which the pipeline stops.
"""

from __future__ import annotations

import math
from functools import cached_property

import numpy as np
import pyarrow as pa

from stagereplay.engine import (
    BoundaryMatcher,
    Decoder,
    build_cache,
    continue_greedy,
    first_divergence,
    generate_to_boundary,
)
from stagereplay.experiment import LEDGER_SCHEMA, Prompter, Settings, _cache_fields, _row
from stagereplay.fixed_prefix import CONSTRUCTIONS as FIXED_PREFIX_CONSTRUCTIONS

AUDIT_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("experiment", pa.string()),
    ("precision", pa.string()),
    ("construction", pa.string()),
    ("replica", pa.int8()),
    ("reproduced", pa.bool_()),
    ("differed", pa.list_(pa.string())),  # ledger columns that did not reproduce ("missing_row", "error", ...)
    ("detail", pa.string()),  # the first difference of each, in words
])

KEY = ("experiment", "construction", "replica")
# (experiment, construction) pairs the audit knows how to recompute
RECIPES = {("matched", "live"), ("matched", "prefill"), *(("fixed_prefix", c) for c in FIXED_PREFIX_CONSTRUCTIONS)}


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


def _audit_record(row: dict, reproduced: bool, differed: list[str], detail: str) -> dict:
    return {"item_index": int(row["item_index"]), "item_id": row["item_id"], "revision": row["revision"],
            "experiment": row["experiment"], "precision": row["precision"], "construction": row["construction"],
            "replica": int(row["replica"]), "reproduced": reproduced, "differed": differed, "detail": detail}


class ItemRecomputer:
    """Reruns one item's computations at one precision, each at most once."""

    def __init__(self, decoder: Decoder, tokenizer, prompter: Prompter, matcher: BoundaryMatcher,
                 settings: Settings, item: dict, reference_stage_ids: list[int] | None):
        self.decoder, self.tokenizer, self.prompter, self.matcher = decoder, tokenizer, prompter, matcher
        self.settings, self.item, self.reference_stage_ids = settings, item, reference_stage_ids
        self._done: dict[tuple[str, str], dict | None] = {}

    @cached_property
    def prompt_ids(self) -> list[int]:
        return list(self.prompter(self.item["question"]))

    def row(self, experiment: str, construction: str, replica: int) -> dict | None:
        """The recomputed ledger row, or None when the experiment implies no such row."""
        key = (experiment, construction)
        if key not in self._done:
            self._done[key] = self._compute(experiment, construction)
        template = self._done[key]
        return None if template is None else {**template, "replica": replica}

    def expected_keys(self, experiments: set[str]) -> list[tuple[str, str, int]]:
        keys = []
        if "matched" in experiments:
            keys += [("matched", "live", 1), ("matched", "live", 2)]
            if self.row("matched", "live", 1)["stage_ids"]:
                keys += [("matched", "prefill", 1), ("matched", "prefill", 2)]
        if "fixed_prefix" in experiments and self.reference_stage_ids:
            keys += [("fixed_prefix", c, r) for c in FIXED_PREFIX_CONSTRUCTIONS for r in (1, 2)]
        return keys

    def _continued(self, experiment, construction, stage_ids, cache) -> dict:
        fields = _cache_fields(cache)
        cont = continue_greedy(self.decoder, cache, stage_ids[-1], self.settings.max_new_tokens, copy_cache=False)
        status = "nonfinite" if cont.stop_reason == "nonfinite" else "ok"
        return _row(self.item, self.settings, experiment, construction, 1, status, self.prompt_ids, stage_ids,
                    fields, cont.suffix_ids, cont.margins, cont.stop_reason, self.tokenizer)

    def _compute(self, experiment: str, construction: str) -> dict | None:
        if experiment == "matched" and construction == "live":
            boundary = generate_to_boundary(self.decoder, self.prompt_ids, self.matcher, self.settings.max_stage_tokens)
            if boundary.status != "ok":
                return _row(self.item, self.settings, "matched", "live", 1, boundary.status, self.prompt_ids, [], {},
                            boundary.generated_ids, [], boundary.status, self.tokenizer)
            return self._continued("matched", "live", boundary.stage_ids, boundary.cache)
        if experiment == "matched" and construction == "prefill":
            stage_ids = self.row("matched", "live", 1)["stage_ids"]
            if not stage_ids:
                return None
            return self._continued("matched", "prefill", stage_ids,
                                   build_cache(self.decoder, "prefill", self.prompt_ids, stage_ids))
        if experiment == "fixed_prefix" and construction in FIXED_PREFIX_CONSTRUCTIONS:
            if not self.reference_stage_ids:
                return None
            stage_ids = list(self.reference_stage_ids)
            return self._continued("fixed_prefix", construction, stage_ids,
                                   build_cache(self.decoder, construction, self.prompt_ids, stage_ids))
        raise KeyError(f"no audit recipe for experiment {experiment!r} construction {construction!r}; "
                       "add one to stagereplay.audit.ItemRecomputer")


class RecomputedRows(ItemRecomputer):
    """One item's rows recomputed together with the rest of its batch (batched ledgers: a row is rebuilt in its
    recorded batch, never alone). ``rows`` maps (experiment, construction) to the recomputed replica-1 row;
    ``error``, when the batch's recomputation failed, is raised for every row (a finding, as at batch 1)."""

    def __init__(self, settings: Settings, item: dict, reference_stage_ids: list[int] | None,
                 rows: dict[tuple[str, str], dict], error: Exception | None = None):
        self.settings, self.item, self.reference_stage_ids = settings, item, reference_stage_ids
        self._done = dict(rows)
        self.error = error

    def row(self, experiment: str, construction: str, replica: int) -> dict | None:
        if self.error is not None:
            raise self.error
        if (experiment, construction) not in RECIPES:
            raise KeyError(f"no audit recipe for experiment {experiment!r} construction {construction!r}; "
                           "add one to stagereplay.audit.recompute_batch")
        template = self._done.get((experiment, construction))
        return None if template is None else {**template, "replica": replica}


def recompute_batch(decoder, tokenizer, prompter: Prompter, matcher: BoundaryMatcher, settings: Settings,
                    items: list[dict], batch_index: int, reference_stage: dict[int, list[int]],
                    experiments: set[str]) -> list[RecomputedRows]:
    """Recompute one batch of the recorded plan at one precision, each computation once (replica 1), exactly
    as the experiments decoded it: the matched experiment (:func:`stagereplay.fastdecode.matched_batch`) and the
    fixed-prefix 2x2 (:func:`stagereplay.fixed_prefix.fixed_prefix_batch`) over the reference prefixes."""
    from stagereplay.fastdecode import matched_batch
    from stagereplay.fixed_prefix import fixed_prefix_batch

    refs = [reference_stage.get(int(item["item_index"])) for item in items]
    try:
        rows = []
        if "matched" in experiments:
            rows += matched_batch(decoder, tokenizer, prompter, matcher, items, settings, batch_index,
                                  replicas=(1,))[0]
        if "fixed_prefix" in experiments:
            prefixes = [{"item_index": item["item_index"], "prompt_ids": prompter(item["question"]),
                         "stage_ids": ref or []} for item, ref in zip(items, refs)]
            rows += fixed_prefix_batch(decoder, tokenizer, items, prefixes, settings, batch_index, replicas=(1,))
    except Exception as exc:  # a finding about every row of the batch, not a crash of the audit
        return [RecomputedRows(settings, item, ref, {}, exc) for item, ref in zip(items, refs)]
    by_item: dict[int, dict] = {}
    for row in rows:
        by_item.setdefault(int(row["item_index"]), {})[row["experiment"], row["construction"]] = row
    return [RecomputedRows(settings, item, ref, by_item.get(int(item["item_index"]), {}))
            for item, ref in zip(items, refs)]


def audit_item(recomputer: ItemRecomputer, stored_rows: list[dict], experiments: set[str]) -> list[dict]:
    """One audit record per stored row of this item and precision, plus one per row that ``experiments`` imply
    and the ledger lacks."""
    out = []
    seen = set()
    for stored in stored_rows:
        key = (stored["experiment"], stored["construction"], int(stored["replica"]))
        seen.add(key)
        try:
            expected = recomputer.row(*key)
        except Exception as exc:  # a finding about this row, not a crash of the audit
            out.append(_audit_record(stored, False, ["error"], f"{type(exc).__name__}: {exc}"))
            continue
        if expected is None:
            out.append(_audit_record(stored, False, ["unexpected_row"],
                                     "the ledger holds a row that the recomputed experiment does not produce"))
            continue
        differed, detail = compare_row(stored, expected)
        out.append(_audit_record(stored, not differed, differed, detail))
    try:
        implied = recomputer.expected_keys(experiments)
    except Exception as exc:
        implied = []
        out.append(_audit_record({**_blank(recomputer), "experiment": "matched", "construction": "live", "replica": 1},
                                 False, ["error"], f"{type(exc).__name__}: {exc}"))
    for experiment, construction, replica in implied:
        if (experiment, construction, replica) not in seen:
            out.append(_audit_record({**_blank(recomputer), "experiment": experiment, "construction": construction,
                                      "replica": replica}, False, ["missing_row"],
                                     "the recomputed experiment produces this row but the ledger lacks it"))
    return out


def _blank(recomputer: ItemRecomputer) -> dict:
    return {"item_index": int(recomputer.item["item_index"]), "item_id": recomputer.item["item_id"],
            "revision": recomputer.settings.revision, "precision": recomputer.settings.precision}


def failures_message(failed: list[dict], limit: int = 20) -> str:
    lines = [f"{len(failed)} ledger row(s) did not reproduce:"]
    for row in failed[:limit]:
        lines.append(f"  item {row['item_id']!r} (item_index {row['item_index']}), {row['revision']} "
                     f"{row['experiment']}/{row['precision']}/{row['construction']} replica {row['replica']}: "
                     f"{', '.join(row['differed'])}" + (f" ({row['detail']})" if row.get("detail") else ""))
    if len(failed) > limit:
        lines.append(f"  ... and {len(failed) - limit} more (see the audit file)")
    return "\n".join(lines)
