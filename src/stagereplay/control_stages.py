"""Stage functions of the controls (fixed-prefix 2x2, bridge, saved-ledger audit): what their rule scripts call.

Like :mod:`stagereplay.stages`, each takes paths and plain values, works through the package and writes its
outputs atomically with provenance; none knows Snakemake.
"""

from __future__ import annotations

import json
import logging

import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from stagereplay.audit import (
    AUDIT_SCHEMA,
    AuditFailedError,
    ItemRecomputer,
    audit_item,
    failures_message,
    recompute_batch,
)
from stagereplay.bridge import BRIDGE_SCHEMA
from stagereplay.fastdecode import (
    decoder_from_record,
    plan_record,
    recorded_plan,
    recorded_regime,
    regime_info,
    shard_batches,
)
from stagereplay.experiment import LEDGER_SCHEMA, Prompter, Settings, make_matcher
from stagereplay.fixed_prefix import fixed_prefix_batch, fixed_prefix_item
from stagereplay.models.gpus import claim_gpu
from stagereplay.models.invariant import recorded_numerics
from stagereplay.io.fingerprints import check_fingerprint_scheme
from stagereplay.io.parquet import read_parquet, write_parquet, write_text_atomic
from stagereplay.io.provenance import software_versions
from stagereplay.models.loading import eos_token_ids, load_model, resolve_source, set_determinism
from stagereplay.stages import gather, provenance, shard_of

log = logging.getLogger("stagereplay")

EXPERIMENTS = ("matched", "fixed_prefix")


def _setup(model, revision, precision, threads, device, attn_implementation, trust_remote_code, allow_pickle,
           offline, base_dir, regime_from):
    """Model and decoder, the decoder in the regime recorded in ``regime_from`` (the generation's own)."""
    flags = set_determinism(threads)
    gpu = claim_gpu(device)  # a GPU of this job's own when several are visible; held until the job ends
    loaded = load_model(resolve_source(model, revision, base_dir), precision, gpu.device, attn_implementation,
                        trust_remote_code, allow_pickle, offline, numerics=recorded_numerics(regime_from))
    loaded.info["gpu_slot"] = gpu.record()
    decoder = decoder_from_record(loaded.model, eos_token_ids(loaded), recorded_regime(regime_from))
    return flags, loaded, decoder


def plan_batches(selection: pd.DataFrame, plan, shard: int, n_shards: int, source: str) -> list[tuple[int, list[dict]]]:
    """(batch index, the batch's selection rows in row order) for the plan's batches of this shard."""
    by_id = {item["item_id"]: item for item in selection.to_dict("records")}
    missing = [i for b in plan.batches for i in b if i not in by_id]
    if missing:
        raise KeyError(f"items {missing[:5]} of the batch plan recorded in {source} are not in the selection; the "
                       "results belong to another selection: rerun reconstruct_prefixes")
    return [(j, [by_id[i] for i in plan.batches[j]]) for j in shard_batches(plan, shard, n_shards)]


def generate_fixed_prefix(items_path: str, reference_prefixes_path: str, ledger_path: str, *, model: str,
                          revision: str, precision: str, reference_precision: str, max_new_tokens: int,
                          max_stage_tokens: int, shard: int = 0, n_shards: int = 1, threads: int = 1,
                          device: str = "auto", attn_implementation: str = "eager",
                          answer_format: str = "last_number", stage_end: str | None = "</think>",
                          trust_remote_code: bool = False, allow_pickle: bool = False, offline: bool = True,
                          base_dir: str = ".", seed: int = 0, progress: bool = True, **_unused) -> None:
    """The fixed-prefix 2x2 at ``precision`` for one shard, over the reference generation's prefixes."""
    config_slice = dict(model=model, revision=revision, precision=precision, reference_precision=reference_precision,
                        max_new_tokens=max_new_tokens, shard=shard, n_shards=n_shards, threads=threads,
                        attn_implementation=attn_implementation, answer_format=answer_format, seed=seed)
    items = shard_of(read_parquet(items_path), shard, n_shards)
    prefixes = read_parquet(reference_prefixes_path)
    prefixes = prefixes[prefixes["precision"] == reference_precision].set_index("item_index", drop=False)
    flags, loaded, decoder = _setup(model, revision, precision, threads, device, attn_implementation,
                                    trust_remote_code, allow_pickle, offline, base_dir, reference_prefixes_path)
    settings = Settings(revision, precision, max_stage_tokens, max_new_tokens, answer_format, stage_end,
                        regime_info(decoder)["decode_regime"], numerics=loaded.info["numerics_regime"]["numerics"])
    plan = recorded_plan(reference_prefixes_path)

    def prefix_of(item):
        if item["item_index"] not in prefixes.index:
            raise KeyError(f"item {item['item_id']!r} (item_index {item['item_index']}) has no reference prefix "
                           f"at {reference_precision} in {reference_prefixes_path}; rerun reconstruct_prefixes")
        return prefixes.loc[item["item_index"]].to_dict()

    rows = []
    if plan is None:
        bar = tqdm(items.to_dict("records"), desc=f"fixed_prefix {revision}/{precision} shard {shard}",
                   disable=not progress, mininterval=2)
        for item in bar:
            rows += fixed_prefix_item(decoder, loaded.tokenizer, item, prefix_of(item), settings)
    else:  # every row in its recorded batch, as the reference generation decoded it
        batches = plan_batches(read_parquet(items_path), plan, shard, n_shards, reference_prefixes_path)
        for j, batch in tqdm(batches, desc=f"fixed_prefix {revision}/{precision} shard {shard} (batches)",
                             disable=not progress, mininterval=2):
            rows += fixed_prefix_batch(decoder, loaded.tokenizer, batch, [prefix_of(item) for item in batch],
                                       settings, j)
    prov = {**provenance(loaded, flags, config_slice, "generate_fixed_prefix"), **regime_info(decoder),
            "batch_plan": plan_record(plan)}
    write_parquet(pd.DataFrame(rows, columns=LEDGER_SCHEMA.names), ledger_path, prov, LEDGER_SCHEMA)


def gather_bridge(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, BRIDGE_SCHEMA, ["item_index", "precision"])


def audit_ledger(items_path: str, ledger_path: str, out_path: str, *, model: str, revision: str, precision: str,
                 reference_precision: str, boundary: dict, max_stage_tokens: int, max_new_tokens: int,
                 shard: int = 0, n_shards: int = 1, threads: int = 1, device: str = "auto",
                 attn_implementation: str = "eager", answer_format: str = "last_number",
                 stage_end: str | None = "</think>", prompt: dict | None = None, trust_remote_code: bool = False,
                 allow_pickle: bool = False, offline: bool = True, base_dir: str = ".", seed: int = 0,
                 progress: bool = True, experiments: tuple[str, ...] = EXPERIMENTS, **_execution) -> None:
    """Recompute the ledger rows of one precision and shard; write one audit record per row (never fails on a
    mismatch: the findings are the output; :func:`check_audit` is what stops the pipeline)."""
    config_slice = dict(model=model, revision=revision, precision=precision, reference_precision=reference_precision,
                        boundary=boundary, max_stage_tokens=max_stage_tokens, max_new_tokens=max_new_tokens,
                        shard=shard, n_shards=n_shards, threads=threads, attn_implementation=attn_implementation,
                        answer_format=answer_format, prompt=prompt, seed=seed)
    selection = read_parquet(items_path)
    items = shard_of(selection, shard, n_shards)
    ledger = read_parquet(ledger_path)
    check_fingerprint_scheme(ledger_path)  # its cache fingerprints are compared with recomputed ones
    plan = recorded_plan(ledger_path)
    if plan is None:
        ledger = ledger[(ledger["item_index"] % n_shards == shard)]
    else:  # shards take whole batches of the recorded plan: a row is recomputed in its batch
        batches = plan_batches(selection, plan, shard, n_shards, ledger_path)
        mine_ids = {item["item_id"] for _, batch in batches for item in batch}
        items = selection[selection["item_id"].isin(mine_ids)]
        ledger = ledger[ledger["item_id"].isin(mine_ids) | ~ledger["item_id"].isin(set(selection["item_id"]))
                        & (ledger["item_index"] % n_shards == shard)]
    reference = ledger[(ledger["experiment"] == "matched") & (ledger["construction"] == "live")
                       & (ledger["replica"] == 1) & (ledger["precision"] == reference_precision)]
    reference_stage = {int(r["item_index"]): [int(i) for i in r["stage_ids"]] for r in reference.to_dict("records")}
    mine = ledger[ledger["precision"] == precision].to_dict("records")
    by_item: dict[int, list[dict]] = {}
    for row in mine:
        by_item.setdefault(int(row["item_index"]), []).append(row)
    flags, loaded, decoder = _setup(model, revision, precision, threads, device, attn_implementation,
                                    trust_remote_code, allow_pickle, offline, base_dir, ledger_path)
    prompter = Prompter(loaded.tokenizer, **(prompt or {}))
    matcher = make_matcher(boundary, loaded.tokenizer)
    settings = Settings(revision, precision, max_stage_tokens, max_new_tokens, answer_format, stage_end,
                        regime_info(decoder)["decode_regime"], numerics=loaded.info["numerics_regime"]["numerics"])
    known = set(int(i) for i in selection["item_index"])
    records = []
    for index in sorted(set(by_item) - known):  # rows of items the selection does not hold
        for row in by_item.pop(index):
            records.append({**{k: row[k] for k in ("item_index", "item_id", "revision", "experiment", "precision",
                                                   "construction", "replica")},
                            "reproduced": False, "differed": ["item_index"],
                            "detail": f"item_index {index} is not in the selection {items_path}"})
    if plan is None:
        bar = tqdm(items.to_dict("records"), desc=f"audit {revision}/{precision} shard {shard}",
                   disable=not progress, mininterval=2)
        for item in bar:
            recomputer = ItemRecomputer(decoder, loaded.tokenizer, prompter, matcher, settings, item,
                                        reference_stage.get(int(item["item_index"])))
            records += audit_item(recomputer, by_item.get(int(item["item_index"]), []), set(experiments))
    else:
        for j, batch in tqdm(batches, desc=f"audit {revision}/{precision} shard {shard} (batches)",
                             disable=not progress, mininterval=2):
            for recomputer in recompute_batch(decoder, loaded.tokenizer, prompter, matcher, settings, batch, j,
                                              reference_stage, set(experiments)):
                records += audit_item(recomputer, by_item.get(int(recomputer.item["item_index"]), []),
                                      set(experiments))
    prov = {**provenance(loaded, flags, config_slice, "audit_ledger"), **regime_info(decoder),
            "batch_plan": plan_record(plan)}
    df = pd.DataFrame(records, columns=AUDIT_SCHEMA.names)
    write_parquet(df, out_path, prov, AUDIT_SCHEMA)
    log.info("audit %s/%s shard %d: %d of %d rows reproduced", revision, precision, shard,
             int(df["reproduced"].sum()), len(df))


def gather_audit(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, AUDIT_SCHEMA, ["item_index", "experiment", "precision", "construction", "replica"])


def check_audit(audit_path: str, ledger_path: str, out_path: str) -> dict:
    """Raise :class:`AuditFailedError` naming every ledger row that did not reproduce (or was never audited);
    else write a small summary to ``out_path``."""
    audit = read_parquet(audit_path)
    ledger = read_parquet(ledger_path)
    key = ["item_index", "experiment", "precision", "construction", "replica"]
    failed = [r for r in audit.to_dict("records") if not r["reproduced"]]
    for r in failed:
        r["differed"] = list(r["differed"])
    audited = set(map(tuple, audit[key].astype(str).values.tolist()))
    for r in ledger.to_dict("records"):
        if tuple(str(r[k]) for k in key) not in audited:
            failed.append({**{k: r[k] for k in key}, "item_id": r["item_id"], "revision": r["revision"],
                           "differed": ["not_audited"], "detail": "no audit record for this ledger row"})
    if failed:
        raise AuditFailedError(failures_message(failed) + f"\nThe audit's findings stay in {audit_path}.")
    summary = {"audit": str(audit_path), "ledger_rows": int(len(ledger)), "audit_rows": int(len(audit)),
               "reproduced": int(audit["reproduced"].sum())}
    write_text_atomic(out_path, json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


BATCH_INVARIANCE_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("precision", pa.string()),
    ("construction", pa.string()),  # live | prefill (the matched experiment's)
    ("batch_index", pa.int32()),  # the item's place in the recorded plan
    ("batch_row", pa.int16()),
    ("batch_rows", pa.int16()),
    ("status_batched", pa.string()),
    ("status_alone", pa.string()),
    ("cache_equal", pa.bool_()),  # boundary-cache fingerprints equal (false when either side has no cache)
    ("stage_equal", pa.bool_()),
    ("suffix_equal", pa.bool_()),  # stage and suffix ids both equal
    ("first_divergence", pa.int32()),  # first differing position over stage + suffix ids; null when equal
    ("label_equal", pa.bool_()),  # correctness label equal (null labels of both sides count as equal)
    ("correct_batched", pa.bool_()),
    ("correct_alone", pa.bool_()),
    ("cache_fingerprint_batched", pa.string()),
    ("cache_fingerprint_alone", pa.string()),
])


def compare_alone(batched: dict, alone: dict) -> dict:
    """One batch-invariance record: a stored batched ledger row against the same computation at batch 1."""
    from stagereplay.engine import first_divergence

    stage_b, stage_a = [int(i) for i in batched["stage_ids"]], [int(i) for i in alone["stage_ids"]]
    ids_b = stage_b + [int(i) for i in batched["suffix_ids"]]
    ids_a = stage_a + [int(i) for i in alone["suffix_ids"]]
    fp_b, fp_a = batched["cache_fingerprint"] or "", alone["cache_fingerprint"] or ""
    return {"status_batched": batched["status"], "status_alone": alone["status"],
            "cache_equal": fp_b == fp_a and fp_b != "", "stage_equal": stage_b == stage_a,
            "suffix_equal": ids_b == ids_a, "first_divergence": first_divergence(ids_b, ids_a),
            "label_equal": _label(batched["correct"]) == _label(alone["correct"]),
            "correct_batched": _label(batched["correct"]), "correct_alone": _label(alone["correct"]),
            "cache_fingerprint_batched": fp_b, "cache_fingerprint_alone": fp_a}


def _label(value):
    return None if value is None or pd.isna(value) else bool(value)


def batch_invariance(items_path: str, ledger_path: str, out_path: str, *, precisions: list[str], sample: int,
                     sample_seed: int, model: str, revision: str, boundary: dict, max_stage_tokens: int,
                     max_new_tokens: int, threads: int = 1, device: str = "auto", attn_implementation: str = "eager",
                     answer_format: str = "last_number", stage_end: str | None = "</think>",
                     prompt: dict | None = None, trust_remote_code: bool = False, allow_pickle: bool = False,
                     offline: bool = True, base_dir: str = ".", progress: bool = True, **_unused) -> pd.DataFrame:
    """The batch-invariance control: a seeded sample of items, each rerun alone (batch 1, the recorded decode
    regime, the same precision) and compared with its batched matched rows (``live`` and ``prefill``, replica 1).

    Disagreements are findings, not errors: batch composition is a construction factor. The sample is drawn
    from the selection alone (:func:`stagereplay.bridge.choose_bridge_items`), before any outcome. At batch
    size 1 there is nothing to compare: the table is empty and its provenance says why."""
    from stagereplay.bridge import choose_bridge_items
    from stagereplay.fastdecode import construct_batch, generate_batch, ledger_row

    config_slice = dict(model=model, revision=revision, precisions=list(precisions), sample=sample,
                        sample_seed=sample_seed, max_stage_tokens=max_stage_tokens, max_new_tokens=max_new_tokens,
                        threads=threads, attn_implementation=attn_implementation)
    selection = read_parquet(items_path)
    plan = recorded_plan(ledger_path)
    records, loaded, flags, regime = [], None, {}, {}
    if plan is None:
        control = {"status": "not_applicable", "reason": "the ledger was decoded at batch_size 1: every row "
                   "already ran alone, so there is no batched row to compare"}
        log.warning("batch_invariance %s: %s", revision, control["reason"])
    else:
        chosen = set(choose_bridge_items(selection["item_index"], sample, sample_seed))
        control = {"status": "compared", "sampled_items": sorted(chosen)}
        ledger = read_parquet(ledger_path)
        check_fingerprint_scheme(ledger_path)  # its cache fingerprints are compared with recomputed ones
        stored = ledger[(ledger["experiment"] == "matched") & (ledger["replica"] == 1)
                        & ledger["item_index"].isin(chosen)]
        for precision in precisions:
            flags, loaded, decoder = _setup(model, revision, precision, threads, device, attn_implementation,
                                            trust_remote_code, allow_pickle, offline, base_dir, ledger_path)
            regime = regime_info(decoder)
            prompter = Prompter(loaded.tokenizer, **(prompt or {}))
            matcher = make_matcher(boundary, loaded.tokenizer)
            settings = Settings(revision, precision, max_stage_tokens, max_new_tokens, answer_format, stage_end,
                                regime["decode_regime"], numerics=loaded.info["numerics_regime"]["numerics"])
            mine = stored[stored["precision"] == precision]
            by_key = {(int(r["item_index"]), r["construction"]): r for r in mine.to_dict("records")}
            for item in tqdm(selection[selection["item_index"].isin(chosen)].to_dict("records"),
                             desc=f"batch_invariance {revision}/{precision}", disable=not progress, mininterval=2):
                live = by_key.get((int(item["item_index"]), "live"))
                if live is None:
                    raise KeyError(f"item {item['item_id']!r}: no matched live row at {precision} in {ledger_path}; "
                                   "rerun reconstruct_prefixes")
                ids = prompter(item["question"])
                alone = {"live": generate_batch(decoder, [ids], matcher.reached, max_stage_tokens,
                                                max_new_tokens)[0]}
                if by_key.get((int(item["item_index"]), "prefill")) is not None:  # over the batched row's prefix
                    alone["prefill"] = construct_batch(decoder, "prefill", [ids], [[int(i) for i in live["stage_ids"]]],
                                                       max_new_tokens)[0]
                for construction, res in alone.items():
                    batched = by_key[int(item["item_index"]), construction]
                    row = ledger_row(item, settings, "matched", construction, 1, ids, res, loaded.tokenizer)
                    records.append({"item_index": int(item["item_index"]), "item_id": item["item_id"],
                                    "revision": revision, "precision": precision, "construction": construction,
                                    **{k: int(batched[k]) for k in ("batch_index", "batch_row", "batch_rows")},
                                    **compare_alone(batched, row)})
    df = pd.DataFrame(records, columns=BATCH_INVARIANCE_SCHEMA.names).astype({"first_divergence": "object"})
    df = df.where(df.notna(), None)
    prov = {**(provenance(loaded, flags, config_slice, "batch_invariance") if loaded else
               {**software_versions(), "stage": "batch_invariance", "config": config_slice}),
            **regime, "batch_plan": plan_record(plan), "batch_invariance": control}
    write_parquet(df, out_path, prov, BATCH_INVARIANCE_SCHEMA)
    if records:
        log.info("batch_invariance %s: %d of %d sampled rows identical to batch 1", revision,
                 int(df["suffix_equal"].sum()), len(df))
    return df
