"""Per-layer differences between two constructions' boundary caches over identical prefix ids.

For a seeded sample of items, rebuild the ``incremental`` and ``prefill`` boundary caches from the recorded prefix
ids and record, per layer and per K/V, whether the bytes are identical, the max-abs and RMS difference (computed in
fp64 from each tensor's own dtype) and the first position that differs. The sample is drawn from the items that
reached the boundary, before any cache is looked at, so it cannot pick items by outcome.

This is a measurement for the report's figure 4, not a check: "bit-identical" here is a byte comparison, and the
magnitudes only say how far apart the two schedules' caches lie.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from stagereplay.models import compat
from stagereplay.engine import build_cache
from stagereplay.fastdecode import decoder_from_record, recorded_regime
from stagereplay.models.gpus import claim_gpu
from stagereplay.models.invariant import recorded_numerics
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.io.provenance import software_versions
from stagereplay.models.loading import load_model, resolve_source, set_determinism

log = logging.getLogger("stagereplay")

CACHE_DIFFERENCE_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("precision", pa.string()),
    ("construction_a", pa.string()),
    ("construction_b", pa.string()),
    ("layer", pa.int32()),
    ("component", pa.string()),  # k | v
    ("bit_equal", pa.bool_()),
    ("max_abs", pa.float64()),
    ("rms", pa.float64()),
    ("first_position_differs", pa.int32()),  # null when bit-identical
    ("n_positions", pa.int32()),
    ("prompt_length", pa.int32()),
])


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its width: equal elements here are equal bytes (so -0.0 != 0.0)."""
    t = t.detach().contiguous().cpu()
    return t.view(_BITS[t.element_size()])


def layer_differences(cache_a, cache_b) -> list[dict]:
    """One dict per (layer, component) comparing two caches of equal shapes."""
    rows = []
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(compat.cache_layers(cache_a), compat.cache_layers(cache_b))):
        for component, x, y in (("k", ka, kb), ("v", va, vb)):
            if x.shape != y.shape:
                raise ValueError(f"layer {layer} {component.upper()}: shapes {tuple(x.shape)} and {tuple(y.shape)} "
                                 "differ; both caches must cover the same prefix ids")
            bits_differ = _as_bits(x) != _as_bits(y)  # (batch, kv_heads, seq, head_dim), exact bytes
            diff = (x.detach().cpu().double() - y.detach().cpu().double()).abs()
            positions = torch.nonzero(bits_differ.any(dim=3).any(dim=1).any(dim=0))  # (positions that differ, 1)
            rows.append({
                "layer": layer, "component": component, "bit_equal": not len(positions),
                "max_abs": float(diff.max()) if diff.numel() else 0.0,
                "rms": float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0,
                "first_position_differs": int(positions[0, 0]) if len(positions) else None,
                "n_positions": int(x.shape[2]),
            })
    return rows


def sample_items(prefixes: pd.DataFrame, n_items: int, seed: int) -> pd.DataFrame:
    """A seeded sample of ``n_items`` prefixes with status ok (all when fewer), in item order."""
    ok = prefixes[prefixes["status"] == "ok"].sort_values("item_index")
    if len(ok) <= n_items:
        return ok.reset_index(drop=True)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(len(ok), size=n_items, replace=False))
    return ok.iloc[chosen].reset_index(drop=True)


def measure_cache_differences(prefixes_path: str, out_path: str, *, model: str, revision: str,
                              revision_slug: str, precisions: list[str], prefix_precision: str | None = None,
                              n_items: int = 50, seed: int = 0, constructions: tuple[str, str] = ("incremental", "prefill"),
                              threads: int = 1, device: str = "auto", attn_implementation: str = "eager",
                              trust_remote_code: bool = False, allow_pickle: bool = False, offline: bool = True,
                              base_dir: str = ".") -> pd.DataFrame:
    """Rebuild both constructions' boundary caches for a seeded sample of items, per precision, and compare them.

    Prefix ids come from ``prefixes_path`` at ``prefix_precision`` (the first of ``precisions`` by default), so every
    precision sees the same token ids, as in the fixed-prefix 2x2.
    """
    prefix_precision = prefix_precision or precisions[0]
    prefixes = read_parquet(prefixes_path)
    available = sorted(prefixes["precision"].unique())
    if prefix_precision not in available:
        raise ValueError(f"cache_differences.prefix_precision {prefix_precision!r}: {prefixes_path} holds prefixes "
                         f"for {available} only; pick one of those or add it to precisions")
    chosen = sample_items(prefixes[prefixes["precision"] == prefix_precision], n_items, seed)
    flags = set_determinism(threads)
    rows, infos = [], []
    a, b = constructions
    gpu = claim_gpu(device) if len(chosen) else None  # a GPU of this job's own when several are visible
    for precision in precisions if len(chosen) else []:  # n_items 0: an empty table, no model loaded
        loaded = load_model(resolve_source(model, revision, base_dir), precision, gpu.device, attn_implementation,
                            trust_remote_code, allow_pickle, offline, numerics=recorded_numerics(prefixes_path))
        loaded.info["gpu_slot"] = gpu.record()
        infos.append(loaded.info)
        decoder = decoder_from_record(loaded.model, (), recorded_regime(prefixes_path))
        for item in chosen.itertuples(index=False):
            prompt, stage = [int(i) for i in item.prompt_ids], [int(i) for i in item.stage_ids]
            cache_a = build_cache(decoder, a, prompt, stage)
            cache_b = build_cache(decoder, b, prompt, stage)
            for row in layer_differences(cache_a, cache_b):
                rows.append({"item_index": int(item.item_index), "item_id": item.item_id, "revision": revision_slug,
                             "precision": precision, "construction_a": a, "construction_b": b, **row,
                             "prompt_length": len(prompt)})
        log.info("cache differences %s/%s: %d items", revision_slug, precision, len(chosen))
        del loaded, decoder
    df = pd.DataFrame(rows, columns=CACHE_DIFFERENCE_SCHEMA.names)
    prov = {**software_versions(), "models": infos, "numerics": flags, "stage": "measure_cache_differences",
            "seed": seed, "config": {"model": model, "revision": revision, "precisions": list(precisions),
                                     "prefix_precision": prefix_precision, "n_items": n_items, "seed": seed,
                                     "constructions": list(constructions), "threads": threads,
                                     "attn_implementation": attn_implementation},
            "items": [str(i) for i in chosen["item_id"]]}
    write_parquet(df, out_path, prov, CACHE_DIFFERENCE_SCHEMA)
    return df
