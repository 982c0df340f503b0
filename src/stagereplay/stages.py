"""One function per pipeline stage, taking paths and plain values: what the Snakemake rule scripts call.

Each function reads its inputs, does the work through the package and writes its outputs atomically with
provenance. None of them knows Snakemake; the workflow's scripts are a few lines handing ``snakemake.*`` here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from . import datasets
from .bridge import BRIDGE_SCHEMA, BridgeRecorder, choose_bridge_items
from .engine import Decoder
from .experiment import LEDGER_SCHEMA, Prompter, Settings, make_matcher, matched_item
from .gpus import claim_gpu
from .ledger import read_parquet, software_versions, write_parquet
from .models import eos_token_ids, load_model, resolve_source, set_determinism

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
                         attn_implementation: str = "eager", answer_format: str = "last_number",
                         stage_end: str | None = "</think>", prompt: dict | None = None,
                         trust_remote_code: bool = False, allow_pickle: bool = False, offline: bool = True,
                         base_dir: str = ".", seed: int = 0, progress: bool = True,
                         bridge_path: str | None = None, bridge: dict | None = None) -> None:
    """Stage 2 + the matched experiment: reconstruct each item's prefix with the live cache and run the matched
    live-vs-prefill experiment while that cache exists (a live cache cannot cross a process boundary).

    With ``bridge_path``, the bridge rows (``bridge: {n_rows, seed}``, chosen from the whole selection before
    any generation) compare their live cache with an incremental rebuild there (stagereplay.bridge)."""
    config_slice = dict(model=model, revision=revision, precision=precision, boundary=boundary,
                        max_stage_tokens=max_stage_tokens, max_new_tokens=max_new_tokens, shard=shard,
                        n_shards=n_shards, threads=threads, attn_implementation=attn_implementation,
                        answer_format=answer_format, prompt=prompt, seed=seed)
    if bridge_path is not None:
        config_slice["bridge"] = bridge
    flags = set_determinism(threads)
    selection = read_parquet(items_path)
    items = shard_of(selection, shard, n_shards)
    gpu = claim_gpu(device)  # a GPU of this job's own when several are visible; held until the job ends
    loaded = load_model(resolve_source(model, revision, base_dir), precision, gpu.device, attn_implementation,
                        trust_remote_code, allow_pickle, offline)
    decoder = Decoder(loaded.model, tuple(eos_token_ids(loaded)))
    prompter = Prompter(loaded.tokenizer, **(prompt or {}))
    matcher = make_matcher(boundary, loaded.tokenizer)
    settings = Settings(revision, precision, max_stage_tokens, max_new_tokens, answer_format, stage_end)
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    recorder = None
    if bridge_path is not None:
        chosen = choose_bridge_items(selection["item_index"], int(bridge["n_rows"]), int(bridge["seed"]))
        recorder = BridgeRecorder(decoder, chosen, revision, precision, max_new_tokens)
    rows, prefix_rows = [], []
    bar = tqdm(items.to_dict("records"), desc=f"matched {revision}/{precision} shard {shard}", disable=not progress,
               mininterval=2)
    for item in bar:
        item_rows, prefix_row = matched_item(decoder, loaded.tokenizer, prompter, matcher, item, settings, context,
                                             on_live_boundary=recorder.observe if recorder else None)
        if recorder is not None:
            recorder.complete(item, item_rows[0])  # item_rows[0]: live replica 1
        rows += item_rows
        prefix_rows.append(prefix_row)
    prov = {**provenance(loaded, flags, config_slice, "reconstruct_prefixes"), "gpu_slot": gpu.record()}
    write_parquet(pd.DataFrame(rows, columns=LEDGER_SCHEMA.names), ledger_path, prov, LEDGER_SCHEMA)
    write_parquet(pd.DataFrame(prefix_rows, columns=PREFIX_SCHEMA.names), prefixes_path, prov, PREFIX_SCHEMA)
    if recorder is not None:
        write_parquet(pd.DataFrame(recorder.records(), columns=BRIDGE_SCHEMA.names), bridge_path, prov, BRIDGE_SCHEMA)
    gpu.release()


SORT_KEYS = ["item_index", "experiment", "precision", "construction", "replica"]


def gather(parts: list[str], out_path: str, schema: pa.Schema, sort_keys: list[str]) -> None:
    """Join per-shard (and per-precision) parts in a deterministic order, whatever the shard count."""
    frames = [read_parquet(p) for p in parts]
    provs = []
    from .ledger import read_provenance

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
