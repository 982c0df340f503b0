"""Stages of the controls: the fixed-prefix 2x2, the saved-ledger audit and the batch-invariance control. Each
reads its inputs, calls the experiments and writes its outputs. The bridge's and the audit's gathers and the audit's
check load no model and live in :mod:`stagereplay.stages.gather` (named here too)."""

from __future__ import annotations

import logging

import pandas as pd
import pyarrow as pa

from stagereplay.data.prompts import Prompter
from stagereplay.decode.greedy import matcher_from_config
from stagereplay.io.ids import first_divergence
from stagereplay.decode.plans import Batch, BatchPlan, batches_of
from stagereplay.experiments.audit import AUDIT_SCHEMA, audit_batch
from stagereplay.experiments.bridge import choose_bridge_items
from stagereplay.experiments.matched import fixed_prefix, matched
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import LEDGER_SCHEMA, ledger_row
from stagereplay.io.fingerprints import check_fingerprint_scheme
from stagereplay.io.keys import ITEM_FIELDS, KEY_FIELDS
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.io.provenance import recorded_batch_plan, software_versions
from stagereplay.stages.jobs import config_of, load_as_recorded
from stagereplay.stages.progress import progress
from stagereplay.stages.settings import BatchInvarianceSettings, ControlSettings

log = logging.getLogger("stagereplay")


def _reference_stages(batch: Batch, stage_of: dict[int, list[int]]) -> list[list[int] | None]:
    return [stage_of.get(int(item["item_index"])) or None for item in batch.items]


def generate_fixed_prefix(items_path: str, reference_prefixes_path: str, ledger_path: str, s: ControlSettings) -> None:
    """The fixed-prefix 2x2 at ``s.precision`` for one shard, over the reference generation's prefixes, each row in
    its recorded batch."""
    selection = read_parquet(items_path)
    prefixes = read_parquet(reference_prefixes_path)
    prefixes = prefixes[prefixes["precision"] == s.reference_precision]
    plan = BatchPlan.from_record(recorded_batch_plan(reference_prefixes_path))
    batches = batches_of(selection.to_dict("records"), plan, s.shard, s.n_shards, reference_prefixes_path)
    known = {int(i) for i in prefixes["item_index"]}
    missing = [item["item_id"] for b in batches for item in b.items if int(item["item_index"]) not in known]
    if missing:
        raise KeyError(f"items {missing[:5]} have no reference prefix at {s.reference_precision} in "
                       f"{reference_prefixes_path}; rerun reconstruct_prefixes")
    prompt_of = {int(r["item_index"]): [int(i) for i in r["prompt_ids"]] for r in prefixes.to_dict("records")}
    stage_of = {int(r["item_index"]): [int(i) for i in r["stage_ids"]] for r in prefixes.to_dict("records")}
    job = load_as_recorded(s, s.precision, reference_prefixes_path)
    settings = job.run_settings()
    rows = []
    for batch in progress(batches, f"generate_fixed_prefix {s.revision}/{s.precision} shard {s.shard}",
                          enabled=s.progress):
        prompts = [prompt_of[int(item["item_index"])] for item in batch.items]
        rows += fixed_prefix(job.decoder, batch, prompts, _reference_stages(batch, stage_of), settings,
                             job.loaded.tokenizer, pair=tuple(s.fixed_prefix_constructions))
    prov = job.provenance("generate_fixed_prefix", config_of(s), batch_plan=None if plan is None else plan.record())
    write_parquet(pd.DataFrame(rows, columns=LEDGER_SCHEMA.names), ledger_path, prov, LEDGER_SCHEMA)


def audit_ledger(items_path: str, ledger_path: str, out_path: str, s: ControlSettings) -> None:
    """Recompute the ledger rows of one precision and shard through the experiments; write one audit record per
    row (never fails on a mismatch: the findings are the output; :func:`~stagereplay.stages.gather.check_audit`
    stops the pipeline)."""
    selection = read_parquet(items_path)
    ledger = read_parquet(ledger_path)
    check_fingerprint_scheme(ledger_path)  # its cache fingerprints are compared with recomputed ones
    plan = BatchPlan.from_record(recorded_batch_plan(ledger_path))
    batches = batches_of(selection.to_dict("records"), plan, s.shard, s.n_shards, ledger_path)
    mine_ids = {item["item_id"] for b in batches for item in b.items}
    known = set(selection["item_id"])
    ledger = ledger[ledger["item_id"].isin(mine_ids)
                    | (~ledger["item_id"].isin(known) & (ledger["item_index"] % s.n_shards == s.shard))]
    reference = ledger[(ledger["experiment"] == "matched") & (ledger["construction"] == "live")
                       & (ledger["replica"] == 1) & (ledger["precision"] == s.reference_precision)]
    stage_of = {int(r["item_index"]): [int(i) for i in r["stage_ids"]] for r in reference.to_dict("records")}
    stored = ledger[ledger["precision"] == s.precision].to_dict("records")
    by_item: dict[str, list[dict]] = {}
    for row in stored:
        by_item.setdefault(row["item_id"], []).append(row)
    records = []
    for item_id in sorted(set(by_item) - known):  # rows of items the selection does not hold
        for row in by_item.pop(item_id):
            records.append({**{k: row[k] for k in KEY_FIELDS.names},
                            "reproduced": False, "differed": ["item_index"],
                            "detail": f"item {item_id!r} is not in the selection {items_path}"})
    job = load_as_recorded(s, s.precision, ledger_path)
    tokenizer = job.loaded.tokenizer
    prompter = Prompter(tokenizer, **(s.prompt or {}))
    matcher = matcher_from_config(s.boundary, tokenizer)
    settings = job.run_settings()
    experiments = set(ledger["experiment"]) | {"matched", "fixed_prefix"}
    for batch in progress(batches, f"audit_ledger {s.revision}/{s.precision} shard {s.shard}", enabled=s.progress):
        prompts = [prompter(item["question"]) for item in batch.items]
        try:
            recomputed = matched(job.decoder, batch, prompts, settings, tokenizer, matcher, replicas=(1,)).rows
            if "fixed_prefix" in experiments:
                recomputed += fixed_prefix(job.decoder, batch, prompts, _reference_stages(batch, stage_of), settings,
                                           tokenizer, pair=tuple(s.fixed_prefix_constructions), replicas=(1,))
        except Exception as exc:  # a finding about every row of the batch, not a crash of the audit
            recomputed = exc
        records += audit_batch([row for item in batch.items for row in by_item.get(item["item_id"], [])], recomputed)
    prov = job.provenance("audit_ledger", config_of(s), batch_plan=None if plan is None else plan.record())
    df = pd.DataFrame(records, columns=AUDIT_SCHEMA.names)
    write_parquet(df, out_path, prov, AUDIT_SCHEMA)
    log.info("audit %s/%s shard %d: %d of %d rows reproduced", s.revision, s.precision, s.shard,
             int(df["reproduced"].sum()), len(df))


BATCH_INVARIANCE_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("construction", pa.string()),  # live | prefill (the matched experiment's)
    ("batch_index", pa.int32()),  # the item's place in the recorded plan
    ("batch_row", pa.int16()),
    ("batch_rows", pa.int16()),
    ("status_batched", pa.string()),
    ("status_alone", pa.string()),
    ("cache_equal", pa.bool_()),  # boundary-cache fingerprints equal; null when either side has no cache
    ("stage_equal", pa.bool_()),
    ("suffix_equal", pa.bool_()),  # stage and suffix ids both equal
    ("first_divergence", pa.int32()),  # first differing position over stage + suffix ids; null when equal
    ("label_equal", pa.bool_()),  # correctness label equal (null labels of both sides count as equal)
    ("correct_batched", pa.bool_()),
    ("correct_alone", pa.bool_()),
    ("cache_fingerprint_batched", pa.string()),
    ("cache_fingerprint_alone", pa.string()),
])


def _label(value):
    return None if value is None or pd.isna(value) else bool(value)


def compare_alone(batched: dict, alone: dict) -> dict:
    """One batch-invariance record: a stored batched ledger row against the same computation at batch 1. A side
    without a boundary cache leaves ``cache_equal`` null: there is nothing to compare."""
    stage_b, stage_a = [int(i) for i in batched["stage_ids"]], [int(i) for i in alone["stage_ids"]]
    ids_b = stage_b + [int(i) for i in batched["suffix_ids"]]
    ids_a = stage_a + [int(i) for i in alone["suffix_ids"]]
    fp_b, fp_a = batched["cache_fingerprint"] or "", alone["cache_fingerprint"] or ""
    return {"status_batched": batched["status"], "status_alone": alone["status"],
            "cache_equal": fp_b == fp_a if fp_b and fp_a else None, "stage_equal": stage_b == stage_a,
            "suffix_equal": ids_b == ids_a, "first_divergence": first_divergence(ids_b, ids_a),
            "label_equal": _label(batched["correct"]) == _label(alone["correct"]),
            "correct_batched": _label(batched["correct"]), "correct_alone": _label(alone["correct"]),
            "cache_fingerprint_batched": fp_b, "cache_fingerprint_alone": fp_a}


def batch_invariance(items_path: str, ledger_path: str, out_path: str, s: BatchInvarianceSettings) -> pd.DataFrame:
    """The batch-invariance control: a seeded sample of items, each rerun alone (a batch of one row, the recorded
    decode regime and precision) and compared with its batched matched rows (``live`` and ``prefill``, replica 1).
    Disagreements are findings, not errors: batch composition is a construction factor. At batch size 1 there is
    nothing to compare: the table is empty and its provenance says why."""
    selection = read_parquet(items_path)
    plan = BatchPlan.from_record(recorded_batch_plan(ledger_path))
    records, job = [], None
    if plan is None:
        control = {"status": "not_applicable", "reason": "the ledger was decoded at batch_size 1: every row "
                   "already ran alone, so there is no batched row to compare"}
        log.warning("batch_invariance %s: %s", s.revision, control["reason"])
    else:
        chosen = set(choose_bridge_items(selection["item_index"], s.sample, s.sample_seed))
        control = {"status": "compared", "sampled_items": sorted(chosen)}
        ledger = read_parquet(ledger_path)
        check_fingerprint_scheme(ledger_path)
        stored = ledger[(ledger["experiment"] == "matched") & (ledger["replica"] == 1)
                        & ledger["item_index"].isin(chosen)]
        # this shard's items: those of its whole batches of the plan (each still reruns alone, in item order)
        mine = {it["item_id"] for b in batches_of(selection.to_dict("records"), plan, s.shard, s.n_shards, ledger_path)
                for it in b.items}
        for precision in s.precisions:
            job = load_as_recorded(s, precision, ledger_path)
            tokenizer = job.loaded.tokenizer
            prompter = Prompter(tokenizer, **(s.prompt or {}))
            matcher = matcher_from_config(s.boundary, tokenizer)
            settings = job.run_settings()
            by_key = {(int(r["item_index"]), r["construction"]): r
                      for r in stored[stored["precision"] == precision].to_dict("records")}
            ours = selection["item_index"].isin(chosen) & selection["item_id"].isin(mine)
            for item in progress(selection[ours].to_dict("records"),
                                 f"check_batch_invariance {s.revision}/{precision} shard {s.shard}", enabled=s.progress,
                                 items=lambda _: 1):
                live = by_key.get((int(item["item_index"]), "live"))
                if live is None:
                    raise KeyError(f"item {item['item_id']!r}: no matched live row at {precision} in {ledger_path}; "
                                   "rerun reconstruct_prefixes")
                alone_batch, ids = Batch(None, (item,)), [prompter(item["question"])]
                alone = {"live": run(job.decoder, "live", ids, settings.decode, matcher=matcher)[0]}
                if (int(item["item_index"]), "prefill") in by_key:  # over the batched row's prefix
                    alone["prefill"] = run(job.decoder, "prefill", ids, settings.decode,
                                           stages=[[int(i) for i in live["stage_ids"]]])[0]
                for construction, res in alone.items():
                    batched = by_key[int(item["item_index"]), construction]
                    row = ledger_row(item, settings, "matched", construction, 1, ids[0], res, tokenizer, alone_batch, 0)
                    records.append({"item_index": int(item["item_index"]), "item_id": item["item_id"],
                                    "revision": s.revision, "precision": precision, "construction": construction,
                                    **{k: int(batched[k]) for k in ("batch_index", "batch_row", "batch_rows")},
                                    **compare_alone(batched, row)})
    df = pd.DataFrame(records, columns=BATCH_INVARIANCE_SCHEMA.names).astype(
        {"first_divergence": "object", "cache_equal": "object"})
    df = df.where(df.notna(), None)
    base = (job.provenance("batch_invariance", config_of(s)) if job else
            {**software_versions(), "stage": "batch_invariance", "config": config_of(s)})
    prov = {**base, "batch_plan": None if plan is None else plan.record(), "batch_invariance": control}
    write_parquet(df, out_path, prov, BATCH_INVARIANCE_SCHEMA)
    if records:
        log.info("batch_invariance %s: %d of %d sampled rows identical to batch 1", s.revision,
                 int(df["suffix_equal"].sum()), len(df))
    return df
