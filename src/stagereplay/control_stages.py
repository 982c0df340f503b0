"""Stage functions of the controls (fixed-prefix 2x2, bridge, saved-ledger audit): what their rule scripts call.

Like :mod:`stagereplay.stages`, each takes paths and plain values, works through the package and writes its
outputs atomically with provenance; none knows Snakemake.
"""

from __future__ import annotations

import json
import logging

import pandas as pd
from tqdm import tqdm

from .audit import AUDIT_SCHEMA, AuditFailedError, ItemRecomputer, audit_item, failures_message
from .bridge import BRIDGE_SCHEMA
from .fastdecode import decoder_from_record, recorded_regime, regime_info
from .experiment import LEDGER_SCHEMA, Prompter, Settings, make_matcher
from .fixed_prefix import fixed_prefix_item
from .gpus import claim_gpu
from .ledger import read_parquet, write_parquet, write_text_atomic
from .models import eos_token_ids, load_model, resolve_source, set_determinism
from .stages import gather, provenance, shard_of

log = logging.getLogger("stagereplay")

EXPERIMENTS = ("matched", "fixed_prefix")


def _setup(model, revision, precision, threads, device, attn_implementation, trust_remote_code, allow_pickle,
           offline, base_dir, regime_from):
    """Model and decoder, the decoder in the regime recorded in ``regime_from`` (the generation's own)."""
    flags = set_determinism(threads)
    gpu = claim_gpu(device)  # a GPU of this job's own when several are visible; held until the job ends
    loaded = load_model(resolve_source(model, revision, base_dir), precision, gpu.device, attn_implementation,
                        trust_remote_code, allow_pickle, offline)
    loaded.info["gpu_slot"] = gpu.record()
    decoder = decoder_from_record(loaded.model, eos_token_ids(loaded), recorded_regime(regime_from))
    return flags, loaded, decoder


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
                        regime_info(decoder)["decode_regime"])
    rows = []
    bar = tqdm(items.to_dict("records"), desc=f"fixed_prefix {revision}/{precision} shard {shard}",
               disable=not progress, mininterval=2)
    for item in bar:
        if item["item_index"] not in prefixes.index:
            raise KeyError(f"item {item['item_id']!r} (item_index {item['item_index']}) has no reference prefix "
                           f"at {reference_precision} in {reference_prefixes_path}; rerun reconstruct_prefixes")
        rows += fixed_prefix_item(decoder, loaded.tokenizer, item, prefixes.loc[item["item_index"]].to_dict(),
                                  settings)
    prov = {**provenance(loaded, flags, config_slice, "generate_fixed_prefix"), **regime_info(decoder)}
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
    ledger = ledger[(ledger["item_index"] % n_shards == shard)]
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
                        regime_info(decoder)["decode_regime"])
    known = set(int(i) for i in selection["item_index"])
    records = []
    for index in sorted(set(by_item) - known):  # rows of items the selection does not hold
        for row in by_item.pop(index):
            records.append({**{k: row[k] for k in ("item_index", "item_id", "revision", "experiment", "precision",
                                                   "construction", "replica")},
                            "reproduced": False, "differed": ["item_index"],
                            "detail": f"item_index {index} is not in the selection {items_path}"})
    bar = tqdm(items.to_dict("records"), desc=f"audit {revision}/{precision} shard {shard}", disable=not progress,
               mininterval=2)
    for item in bar:
        recomputer = ItemRecomputer(decoder, loaded.tokenizer, prompter, matcher, settings, item,
                                    reference_stage.get(int(item["item_index"])))
        records += audit_item(recomputer, by_item.get(int(item["item_index"]), []), set(experiments))
    prov = {**provenance(loaded, flags, config_slice, "audit_ledger"), **regime_info(decoder)}
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
