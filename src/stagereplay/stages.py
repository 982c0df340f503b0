"""One function per pipeline stage, taking paths and plain values: what the Snakemake rule scripts call.

Each function reads its inputs, does the work through the package and writes its outputs atomically with
provenance. None of them knows Snakemake; the workflow's scripts are a few lines handing ``snakemake.*`` here.
"""

from __future__ import annotations

import logging

import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from stagereplay.data import datasets
from stagereplay.bridge import BRIDGE_SCHEMA, BatchBridge, BridgeRecorder, choose_bridge_items
from stagereplay.fastdecode import batch_plan, make_decoder, matched_batch, plan_record, regime_info, shard_batches
from stagereplay.experiment import LEDGER_SCHEMA, Prompter, Settings, make_matcher, matched_item
from stagereplay.models.gpus import claim_gpu
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.io.provenance import software_versions
from stagereplay.models.loading import eos_token_ids, load_model, resolve_source, set_determinism
from stagereplay.preflight import check_decode_settings

log = logging.getLogger("stagereplay")

PREFIX_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("precision", pa.string()),
    ("status", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("stage_ids", pa.list_(pa.int32())),
    ("prefix_fingerprint", pa.string()),
    ("gold_answer", pa.string()),
])


def shard_of(items: pd.DataFrame, shard: int, n_shards: int) -> pd.DataFrame:
    """Items of shard ``shard`` (0-based): every ``n_shards``-th item, so shards stay balanced."""
    return items[items["item_index"] % n_shards == shard]


def select_items(dataset: dict, n_items: int, seed: int, out_path: str, base_dir: str = ".",
                 answer_format: str = "last_number", offline: bool = True) -> pd.DataFrame:
    rows = datasets.load_source(dataset, base_dir, numeric=answer_format != "boxed", offline=offline)
    selected = datasets.select_items(rows, n_items, seed)
    write_parquet(selected, out_path, {**software_versions(), "stage": "select_items", "seed": seed,
                                       "config": {"dataset": dataset, "n_items": n_items}})
    return selected


def provenance(loaded, flags: dict, config_slice: dict, stage: str) -> dict:
    return {**software_versions(), **loaded.info, "numerics": flags, "stage": stage, "config": config_slice}


def reconstruct_prefixes(items_path: str, ledger_path: str, prefixes_path: str, *, model: str, revision: str,
                         precision: str, boundary: dict, max_stage_tokens: int, max_new_tokens: int,
                         shard: int = 0, n_shards: int = 1, threads: int = 1, device: str = "auto",
                         attn_implementation: str = "eager", decode_regime: str = "eager",
                         decode_attention: str = "masked", decode_prefill_group: int | None = None,
                         batch_size: int = 1, batch_seed: int | None = None, answer_format: str = "last_number",
                         stage_end: str | None = "</think>", prompt: dict | None = None,
                         trust_remote_code: bool = False, allow_pickle: bool = False, offline: bool = True,
                         base_dir: str = ".", seed: int = 0, progress: bool = True,
                         bridge_path: str | None = None, bridge: dict | None = None,
                         numerics: str = "default") -> None:
    """Stage 2 + the matched experiment: reconstruct each item's prefix with the live cache and run the matched
    live-vs-prefill experiment while that cache exists (a live cache cannot cross a process boundary).

    With ``bridge_path``, the bridge rows (``bridge: {n_rows, seed}``, chosen from the whole selection before
    any generation) compare their live cache with an incremental rebuild there (stagereplay.bridge); with
    ``batch_size`` > 1, in the row's own batch (:class:`stagereplay.bridge.BatchBridge`)."""
    config_slice = dict(model=model, revision=revision, precision=precision, boundary=boundary,
                        max_stage_tokens=max_stage_tokens, max_new_tokens=max_new_tokens, shard=shard,
                        n_shards=n_shards, threads=threads, attn_implementation=attn_implementation,
                        decode_regime=decode_regime, decode_attention=decode_attention,
                        decode_prefill_group=decode_prefill_group, batch_size=batch_size, batch_seed=batch_seed,
                        answer_format=answer_format,
                        prompt=prompt, seed=seed, numerics=numerics)
    if bridge_path is not None:
        config_slice["bridge"] = bridge
    check_decode_settings(batch_size, decode_regime, decode_attention, decode_prefill_group)
    flags = set_determinism(threads)
    selection = read_parquet(items_path)
    items = shard_of(selection, shard, n_shards)
    plan = None
    if batch_size > 1:
        # The plan covers the whole selection and shards take whole batches, so an item's batch (and its bits)
        # does not depend on the shard count.
        plan = batch_plan(list(selection["item_id"]), batch_size, seed if batch_seed is None else batch_seed)
        mine = {i for j in shard_batches(plan, shard, n_shards) for i in plan.batches[j]}
        items = selection[selection["item_id"].isin(mine)]
    gpu = claim_gpu(device)  # a GPU of this job's own when several are visible; held until the job ends
    loaded = load_model(resolve_source(model, revision, base_dir), precision, gpu.device, attn_implementation,
                        trust_remote_code, allow_pickle, offline, numerics=numerics)
    prompter = Prompter(loaded.tokenizer, **(prompt or {}))
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    # The static regimes hold one buffer for the longest prompt plus both budgets. Its length shapes the
    # attention reduction, so it comes from the whole selection (not this shard) and is recorded.
    longest = max((len(prompter(q)) for q in selection["question"]), default=0)
    decoder = make_decoder(loaded.model, tuple(eos_token_ids(loaded)), decode_regime,
                           max_len=longest + max_stage_tokens + max_new_tokens, max_rows=batch_size,
                           attention=decode_attention, prefill_group=decode_prefill_group)
    matcher = make_matcher(boundary, loaded.tokenizer)
    settings = Settings(revision, precision, max_stage_tokens, max_new_tokens, answer_format, stage_end,
                        decode_regime, numerics=numerics)
    recorder = None
    if bridge_path is not None:
        chosen = choose_bridge_items(selection["item_index"], int(bridge["n_rows"]), int(bridge["seed"]))
        recorder = (BridgeRecorder if plan is None else BatchBridge)(decoder, chosen, revision, precision,
                                                                     max_new_tokens)
    rows, prefix_rows = [], []
    if plan is None:
        bar = tqdm(items.to_dict("records"), desc=f"matched {revision}/{precision} shard {shard}",
                   disable=not progress, mininterval=2)
        for item in bar:
            item_rows, prefix_row = matched_item(decoder, loaded.tokenizer, prompter, matcher, item, settings, context,
                                                 on_live_boundary=recorder.observe if recorder else None)
            if recorder is not None:
                recorder.complete(item, item_rows[0])  # item_rows[0]: live replica 1
            rows += item_rows
            prefix_rows.append(prefix_row)
    else:
        by_id = {item["item_id"]: item for item in items.to_dict("records")}
        for j in tqdm(shard_batches(plan, shard, n_shards), desc=f"matched {revision}/{precision} shard {shard} "
                      "(batches)", disable=not progress):
            batch_rows, batch_prefixes = matched_batch(decoder, loaded.tokenizer, prompter, matcher,
                                                       [by_id[i] for i in plan.batches[j]], settings, j,
                                                       on_live_batch=recorder.observe if recorder else None,
                                                       live_rows_kept=recorder.wanted if recorder else None)
            rows += batch_rows
            prefix_rows += batch_prefixes
    prov = {**provenance(loaded, flags, config_slice, "reconstruct_prefixes"), **regime_info(decoder),
            "gpu_slot": gpu.record(),
            "batch_plan": plan_record(plan)}
    write_parquet(pd.DataFrame(rows, columns=LEDGER_SCHEMA.names), ledger_path, prov, LEDGER_SCHEMA)
    write_parquet(pd.DataFrame(prefix_rows, columns=PREFIX_SCHEMA.names), prefixes_path, prov, PREFIX_SCHEMA)
    if bridge_path is not None:
        records = recorder.records() if recorder is not None else []
        write_parquet(pd.DataFrame(records, columns=BRIDGE_SCHEMA.names), bridge_path, prov, BRIDGE_SCHEMA)
    gpu.release()


SORT_KEYS = ["item_index", "experiment", "precision", "construction", "replica"]


def gather(parts: list[str], out_path: str, schema: pa.Schema, sort_keys: list[str]) -> None:
    """Join per-shard (and per-precision) parts in a deterministic order, whatever the shard count."""
    frames = [read_parquet(p) for p in parts]
    provs = []
    from stagereplay.io.parquet import read_provenance

    for p in parts:
        prov = read_provenance(p)
        config = dict(prov.get("config") or {})
        for key in ("shard", "n_shards"):
            config.pop(key, None)
        prov["config"] = config
        provs.append(prov)
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=schema.names)
    df = df.sort_values([k for k in sort_keys if k in df.columns], kind="stable").reset_index(drop=True)
    # Parts that differ only by shard carry the same provenance; keep the distinct records.
    distinct = []
    for prov in provs:
        if prov not in distinct:
            distinct.append(prov)
    write_parquet(df, out_path, {"stage": "gather", "parts": distinct}, schema)


def gather_ledger(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, LEDGER_SCHEMA, SORT_KEYS)


def gather_prefixes(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, PREFIX_SCHEMA, ["item_index", "precision"])
