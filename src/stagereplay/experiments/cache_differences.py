"""Byte-wise comparison of two boundary caches of one row: exact or not, where they first differ, how far apart.

``compare_layers`` is the bridge's verdict (first layer, component and position that differ);
``layer_differences`` is the per-layer measurement of the report's figure 4 (max-abs and RMS in fp64 from each
tensor's own dtype). "Bit-identical" here is a comparison of bytes, never a tolerance.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from stagereplay.decode.protocol import Layers

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its width: equal elements are equal bytes (NaN == NaN, -0.0 != 0.0)."""
    t = t.detach().contiguous().cpu()
    return t.view(_BITS[t.element_size()])


def _first_differing_position(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First sequence position where two (batch, kv_heads, seq, head_dim) tensors differ in any bit, or None."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return min(a.shape[2], b.shape[2]) if a.dim() == 4 and b.dim() == 4 else 0
    differs = (_as_bits(a) != _as_bits(b)).any(dim=3).any(dim=1).any(dim=0)  # (seq,)
    hits = torch.nonzero(differs)
    return int(hits[0, 0]) if len(hits) else None


def compare_layers(la: Layers, lb: Layers) -> dict:
    """Exact or not, layers that differ, and the first layer, component and position that differ."""
    result = {"bit_exact": True, "n_layers_differ": 0, "first_layer_differs": None, "component_differs": None,
              "first_position_differs": None}
    if len(la) != len(lb):
        result.update(bit_exact=False, n_layers_differ=abs(len(la) - len(lb)),
                      first_layer_differs=min(len(la), len(lb)), component_differs="shape")
        return result
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(la, lb)):
        found = None
        for component, (x, y) in (("K", (ka, kb)), ("V", (va, vb))):
            pos = _first_differing_position(x, y)
            if pos is not None:
                found = ("shape" if x.shape != y.shape else component, pos)
                break
        if found is None:
            continue
        result["n_layers_differ"] += 1
        if result["bit_exact"]:
            result.update(bit_exact=False, first_layer_differs=layer, component_differs=found[0],
                          first_position_differs=found[1])
    return result


def layer_differences(la: Layers, lb: Layers) -> list[dict]:
    """One dict per (layer, component) comparing two caches of equal shapes."""
    rows = []
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(la, lb)):
        for component, x, y in (("k", ka, kb), ("v", va, vb)):
            if x.shape != y.shape:
                raise ValueError(f"layer {layer} {component.upper()}: shapes {tuple(x.shape)} and {tuple(y.shape)} "
                                 "differ; both caches must cover the same prefix ids")
            bits_differ = _as_bits(x) != _as_bits(y)  # (batch, kv_heads, seq, head_dim), exact bytes
            diff = (x.detach().cpu().double() - y.detach().cpu().double()).abs()
            positions = torch.nonzero(bits_differ.any(dim=3).any(dim=1).any(dim=0))
            rows.append({
                "layer": layer, "component": component, "bit_equal": not len(positions),
                "max_abs": float(diff.max()) if diff.numel() else 0.0,
                "rms": float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0,
                "first_position_differs": int(positions[0, 0]) if len(positions) else None,
                "n_positions": int(x.shape[2]),
            })
    return rows


def sample_items(prefixes: pd.DataFrame, n_items: int, seed: int) -> pd.DataFrame:
    """A seeded sample of ``n_items`` prefixes with status ok (all when fewer), in item order: drawn before any
    cache is looked at, so it cannot pick items by outcome."""
    ok = prefixes[prefixes["status"] == "ok"].sort_values("item_index")
    if len(ok) <= n_items:
        return ok.reset_index(drop=True)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(len(ok), size=n_items, replace=False))
    return ok.iloc[chosen].reset_index(drop=True)
