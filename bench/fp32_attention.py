"""The invariant regime's fp32 attention kernels on a GPU, side by side in one run: the packed 16-row ``ieee`` tile
(the bf16 kernel's layout) against one program per (row, query head, token, chunk of keys), the regime's choice.
Two other layouts were tried on 2026-11-30 and dropped: a per-K/V-head program sharing each key among its query
heads through a 3-D broadcast ran at 0.27 to 0.58 TB/s (bench/runs/fp32_attention_sweep2_h200.txt), and a program
per pair of query heads, with the online-softmax step in a shared helper, at 1.18 TB/s at best; that refactor also
slowed the one-head kernel to 0.82 TB/s (bench/runs/fp32_attention_sweep3_pairs_h200.txt), so the kept kernel is
the one measured at 1.47 TB/s. A decode step of ``--rows`` rows of a 14B-shaped layer (40 query heads on 8 K/V heads, d 128) over
random keys; the rate counts the K and V bytes each call must read once.

    python bench/fp32_attention.py [--rows 50] [--spans 256,2048,3336]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stagereplay.models import invariant_triton as it  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--spans", default="256,2048,3336")
    parser.add_argument("--repeats", type=int, default=48)
    parser.add_argument("--out", help="write the timings as JSON here")
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
    modes = {"packed 16-row tile, 4 warps": {"attention": "packed_tile", "attention_rows": 16, "attention_warps": 4},
             "per head, chunks of 16 blocks, 2 warps": {"attention": "per_head", "attention_chunk_blocks": 16,
                                                         "attention_warps": 2}}
    results = []
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
                rate = rows * kv * span * d * 4 * 2 / dt / 1e12
                results.append({"span": span, "name": name, "config": config, "ms": dt * 1e3, "TB_s": rate})
                print(f"span {span:5d}  {name:60s} {dt * 1e3:7.3f} ms  {rate:5.2f} TB/s", flush=True)
    finally:
        it.CONFIGS["fp32"] = chosen
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "heads": heads,
                                              "kv_heads": kv, "chosen": chosen, "results": results}, indent=1))


if __name__ == "__main__":
    main()
