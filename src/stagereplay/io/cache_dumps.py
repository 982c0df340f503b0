"""Boundary KV caches on disk: safetensors dumps that carry their own fingerprints.

One file holds one boundary cache (one item x revision x precision x construction). Tensors are named
``layers.<i>.keys`` and ``layers.<i>.values``, each (batch, kv_heads, seq, head_dim) in the cache's own dtype.
The file's metadata (key ``stagereplay``, JSON) records the sha256 of every layer's K and V bytes, the
whole-cache fingerprint and its scheme (``fingerprint_scheme``, :data:`stagereplay.io.fingerprints.CACHE_FINGERPRINT_SCHEME`),
the prefix fingerprint, the pending token and what the cache is (item, revision, precision, construction).
:func:`load_cache` recomputes every fingerprint and refuses a file whose bytes do not match, naming the file and
the layer, and a file whose whole-cache fingerprint was made by another scheme. Writes are atomic. This module
knows nothing of models and nothing of Snakemake.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from stagereplay.io.fingerprints import (
    CACHE_FINGERPRINT_SCHEME,
    SCHEME_KEY,
    check_fingerprint_scheme,
    fingerprint_layers,
    host_copies,
)
from stagereplay.io.parquet import CorruptFileError, atomic_path

METADATA_KEY = "stagereplay"
FORMAT = "stagereplay-boundary-cache/1"


class CacheDumpError(CorruptFileError):
    """A cache dump that cannot be trusted: unreadable, incomplete, or bytes that do not match their fingerprints."""


@dataclass
class CacheDump:
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # (K, V) per layer, each (batch, kv_heads, seq, head_dim)
    meta: dict


def dump_filename(item_index: int, precision: str, construction: str) -> str:
    """File name of one dump inside ``results/<run>/<revision>/caches/`` (``chunked:C`` becomes ``chunked-C``)."""
    return f"item{int(item_index):06d}_{precision}_{construction.replace(':', '-')}.safetensors"


def save_cache(path: str | Path, layers, meta: dict) -> dict:
    """Write ``layers`` ((K, V) per layer) to ``path`` atomically with its fingerprints; return the metadata written plus ``bytes``.

    ``meta`` carries what the cache is (item_index, item_id, revision, precision, construction,
    prefix_fingerprint, pending_id, ...); the fingerprints are computed here from the exact bytes.
    """
    # one device-to-host copy per tensor, shared by the fingerprints and the file
    flat = host_copies([t for pair in layers for t in pair])
    layers = list(zip(flat[0::2], flat[1::2]))
    whole, ks, vs = fingerprint_layers(layers)
    record = {**meta, "format": FORMAT, "num_layers": len(layers), "cache_fingerprint": whole,
              "fingerprint_scheme": CACHE_FINGERPRINT_SCHEME, "k_sha256": ks, "v_sha256": vs,
              "shape": list(layers[0][0].shape) if layers else [], "dtype": str(layers[0][0].dtype) if layers else ""}
    tensors = {}
    for i, (k, v) in enumerate(layers):
        tensors[f"layers.{i}.keys"] = k
        tensors[f"layers.{i}.values"] = v
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(record, sort_keys=True)})
    return {**record, "bytes": path.stat().st_size}


def read_metadata(path: str | Path) -> dict:
    """The dump's recorded metadata, without reading or checking the tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(METADATA_KEY)
    except (OSError, SafetensorError) as exc:
        raise CacheDumpError(f"{path} is not a readable safetensors file ({exc}); delete it and rerun the dump") from exc
    if raw is None:
        raise CacheDumpError(f"{path} has no {METADATA_KEY!r} metadata: it is not a stagereplay cache dump")
    return json.loads(raw)


def load_cache(path: str | Path, device: str | torch.device = "cpu") -> CacheDump:
    """Read a dump and check every layer's K and V bytes against the recorded sha256, and the whole-cache
    fingerprint; refuse any mismatch, and a dump whose whole-cache fingerprint was made by another scheme."""
    meta = read_metadata(path)
    check_fingerprint_scheme(path, {SCHEME_KEY: meta.get("fingerprint_scheme")}, rerun="dump_caches")
    try:
        tensors = load_file(str(path), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise CacheDumpError(f"{path} is not a readable safetensors file ({exc}); delete it and rerun the dump") from exc
    layers = []
    for i in range(int(meta["num_layers"])):
        for part in ("keys", "values"):
            if f"layers.{i}.{part}" not in tensors:
                raise CacheDumpError(f"{path}: tensor layers.{i}.{part} is missing; the dump is incomplete, rerun the "
                                     "dump")
        layers.append((tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]))
    extra = sorted(set(tensors) - {f"layers.{i}.{p}" for i in range(len(layers)) for p in ("keys", "values")})
    if extra:
        raise CacheDumpError(f"{path}: unexpected tensors {extra}; this is not a boundary cache dump written here")
    whole, ks, vs = fingerprint_layers(layers)  # every byte hashed once; the whole from the per-tensor digests
    for i in range(len(layers)):
        for part, recorded, actual in (("K", meta["k_sha256"][i], ks[i]), ("V", meta["v_sha256"][i], vs[i])):
            if actual != recorded:
                raise CacheDumpError(
                    f"{path}: layer {i} {part} bytes do not match their recorded sha256 "
                    f"(recorded {recorded[:12]}..., found {actual[:12]}...); the file was altered or corrupted, "
                    "rerun the dump rule instead of using it"
                )
    if whole != meta["cache_fingerprint"]:
        raise CacheDumpError(f"{path}: the whole-cache fingerprint does not match the recorded one; rerun the dump")
    return CacheDump([(k.to(device), v.to(device)) for k, v in layers], meta)
