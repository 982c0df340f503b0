"""The invariant regime's fp32 attention kernels on a GPU, side by side in one run: the packed 16-row ``ieee`` tile
(the bf16 kernel's layout) against one program per (row, query head, token, chunk of keys), for a few chunk sizes
and warp counts. A decode step of ``--rows`` rows of a 14B-shaped layer (40 query heads on 8 K/V heads, d 128) over
random keys; the rate counts the K and V bytes each call must read once.

    python bench/fp32_attention.py [--rows 50] [--spans 256,2048,3336]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stagereplay import invariant_triton as it  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--spans", default="256,2048,3336")
    parser.add_argument("--repeats", type=int, default=48)
    args = parser.parse_args(argv)
    spans = [int(s) for s in args.spans.split(",")]
    rows, heads, kv, d, length = args.rows, args.heads, args.kv_heads, 128, max(spans)
    kernels = it.TritonKernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(rows, kv, length, d, device="cuda", generator=g)
    values = torch.randn(rows, kv, length, d, device="cuda", generator=g)
    q = torch.randn(rows, 1, heads, d, device="cuda", generator=g)
    pads = torch.zeros(rows, dtype=torch.long, device="cuda")
    chosen = dict(it.CONFIGS["fp32"])
    modes = {"packed 16-row tile, 4 warps": {"attention": "packed_tile", "attention_rows": 16, "attention_warps": 4}}
    for blocks in (2, 4, 8, 16):
        for warps in (1, 2, 4):
            modes[f"per head, chunks of {blocks} blocks, {warps} warps"] = {
                "attention": "per_head", "attention_chunk_blocks": blocks, "attention_warps": warps}
    print(f"{torch.cuda.get_device_name()}, triton {it.triton.__version__}; the regime's fp32 choice: {chosen}")
    try:
        for span in spans:
            index = torch.tensor([span - 1], device="cuda")
            for name, config in modes.items():
                it.CONFIGS["fp32"] = {**chosen, **config}
                kernels.attention_rows(q, keys, values, pads, index, d ** -0.5, 64)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.repeats):
                    kernels.attention_rows(q, keys, values, pads, index, d ** -0.5, 64)
                torch.cuda.synchronize()
                dt = (time.perf_counter() - start) / args.repeats
                print(f"span {span:5d}  {name:40s} {dt * 1e3:7.3f} ms  {rows * kv * span * d * 4 * 2 / dt / 1e12:5.2f} TB/s")
    finally:
        it.CONFIGS["fp32"] = chosen


if __name__ == "__main__":
    main()
