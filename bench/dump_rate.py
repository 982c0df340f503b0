"""How fast a boundary-cache dump reaches the disk, against the disk itself, in one run.

A dump (``stagereplay.io.cache_dumps.save_cache``) fingerprints every layer's K and V bytes (sha256) and writes a
safetensors file atomically (temp file, fsync, rename). The baseline is the same number of bytes written from
host memory and fsynced, in the same folder and the same run: the disk's own rate. Reading a dump back
(``load_cache``, which checks every fingerprint) is timed too. Each figure is the median over repeats, the
dump and the baseline interleaved so that load from other processes falls on both.

    python bench/dump_rate.py                         # a 14B-shaped bf16 cache of 2303 positions, 0.45 GB
    python bench/dump_rate.py --layers 28 --kv-heads 2 --positions 4096 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stagereplay.io.cache_dumps import load_cache, save_cache
from stagereplay.io.fingerprints import fingerprint_layers


def fake_layers(layers: int, kv_heads: int, positions: int, head_dim: int, dtype: torch.dtype, device: str):
    """A boundary cache of random values: (K, V) per layer, each (1, kv_heads, positions, head_dim)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        k, v = (torch.randn(1, kv_heads, positions, head_dim, generator=generator).to(dtype).to(device)
                for _ in range(2))
        out.append((k, v))
    return out


def raw_write(folder: Path, data: bytes) -> float:
    path = folder / "raw.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--positions", type=int, default=2303)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", help="where to write (default: a temp folder under the current directory)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the measurements as JSON here")
    args = parser.parse_args(argv)

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    layers = fake_layers(args.layers, args.kv_heads, args.positions, args.head_dim, dtype, args.device)
    size = sum(k.numel() * k.element_size() * 2 for k, _ in layers)
    raw = os.urandom(size)
    with tempfile.TemporaryDirectory(dir=args.dir or ".") as tmp:
        folder = Path(tmp)
        disk, dump, load, hashing = [], [], [], []
        for r in range(args.repeats):
            disk.append(raw_write(folder, raw))
            start = time.perf_counter()
            save_cache(folder / "dump.safetensors", layers, {"item_index": r})
            dump.append(time.perf_counter() - start)
            start = time.perf_counter()
            load_cache(folder / "dump.safetensors")
            load.append(time.perf_counter() - start)
            (folder / "dump.safetensors").unlink()
            start = time.perf_counter()
            fingerprint_layers(layers)
            hashing.append(time.perf_counter() - start)
    gb = size / 1e9
    result = {"bytes": size, "device": args.device, "cpus": os.cpu_count(), "repeats": args.repeats,
              "disk_GB_s": gb / statistics.median(disk), "dump_GB_s": gb / statistics.median(dump),
              "load_GB_s": gb / statistics.median(load), "fingerprint_GB_s": gb / statistics.median(hashing)}
    result["dump_over_disk"] = result["dump_GB_s"] / result["disk_GB_s"]
    print(f"cache of {gb:.2f} GB ({args.layers} layers, {args.positions} positions, {args.dtype}, on "
          f"{args.device}), {os.cpu_count()} CPUs, median of {args.repeats}:")
    print(f"  disk alone (write + fsync)    {result['disk_GB_s']:.2f} GB/s")
    print(f"  dump (fingerprints + write)   {result['dump_GB_s']:.2f} GB/s = {result['dump_over_disk']:.0%} of the disk")
    print(f"  fingerprints alone            {result['fingerprint_GB_s']:.2f} GB/s")
    print(f"  load (read + check)           {result['load_GB_s']:.2f} GB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
