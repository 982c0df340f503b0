"""The fp32 Triton attention on a GPU: one program per K/V head (the kernel in use) against one program per query
head (the reference it replaced), byte for byte and side by side in one run.

Both cut a row's keys into the same chunks of 64-key blocks from its first real key and run the same online
softmax per query head; the per-K/V-head program runs a group's query heads one after the other over each key
block, so the block is fetched once per group instead of once per query head. The proof: over random queries,
keys and values of several shapes (14B: 40 query heads on 8 K/V heads; 1.5B: 12 on 2; 0.5B: 14 on 2; 7B: 28 on
4), rows at their own positions with their own left padding, decode steps (one token) and multi-token forwards,
every output's bytes must be equal. The control: the same comparison against the reference with chunks of 8
blocks instead of 16 (another reduction order) must find differing bytes, so the comparison can fail. Then both
kernels are timed on a decode step of ``--rows`` rows of a 14B-shaped layer; the rate counts the K and V bytes a
call must read once.

Variants (``--no-variants`` skips them): the key loop's software pipelining (``attention_stages``: when loads are
issued, not what is computed) for both programs, and 1, 2 or 4 warps for the per-K/V-head one (a warp count can
change a sum's reduction tree: the proof says which keep the bytes); ``--best`` writes the fastest byte-identical
one. Tried on 2026-12-02 and dropped: the group's heads unrolled instead of a loop, byte-identical but 1.3x slower
than the reference (its tiles spill; bench/runs/fp32_attention_grouped_h200/). Tried on 2026-11-30 and dropped: a
per-K/V-head program sharing each key among its heads through a 3-D broadcast, 0.27 to 0.58 TB/s
(bench/runs/fp32_attention_sweep2_h200.txt), and a program per pair of heads with the online-softmax step in a
shared helper, 1.18 TB/s at best (bench/runs/fp32_attention_sweep3_pairs_h200.txt), against the per-query-head
kernel's 1.47 TB/s.

    python bench/fp32_attention.py [--rows 62] [--spans 256,2048,3336] [--out OUT.json] [--best BEST.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from stagereplay.models import invariant_triton as it

SHAPES = {"14B": (40, 8), "7B": (28, 4), "1.5B": (12, 2), "0.5B": (14, 2)}  # (query heads, K/V heads), d 128
REFERENCE = {"attention_programs": "per_query_head"}
IN_USE = {}  # the module's own choice
IN_USE_NAME = "in use"
VARIANTS = {}  # launch variants (the docstring)
for _warps in (1, 2, 4):
    for _stages in (1, 2, 3, 4):
        VARIANTS[f"per_kv_head loop, {_warps} warps, {_stages} stages"] = {
            "attention_programs": "per_kv_head", "attention_warps": _warps,
            "attention_stages": _stages}
for _stages in (1, 2, 4):
    VARIANTS[f"per_query_head, {_stages} stages"] = {"attention_programs": "per_query_head",
                                                    "attention_stages": _stages}


def call(kernels, config: dict, *args):
    chosen = dict(it.CONFIGS["fp32"])
    it.CONFIGS["fp32"] = {**chosen, **config}
    try:
        return kernels.attention_rows(*args)
    finally:
        it.CONFIGS["fp32"] = chosen


def cases(g: torch.Generator, rows: int, length: int):
    """(name, q, keys, values, pads, index) over a buffer of ``length`` positions: decode steps at spread
    positions, rows at their own positions with their own padding, and multi-token forwards."""
    for shape, (heads, kv) in SHAPES.items():
        keys = torch.randn(rows, kv, length, 128, device="cuda", generator=g)
        values = torch.randn(rows, kv, length, 128, device="cuda", generator=g)
        pads = torch.randint(0, 200, (rows,), device="cuda", generator=g)
        for T in (1, 4, 17):
            q = torch.randn(rows, T, heads, 128, device="cuda", generator=g)
            for p in (0, 63, 64, 1023, 1024, 1500, length - T):
                yield f"{shape} T={T} all rows at {p}", q, keys, values, torch.zeros_like(pads), \
                    torch.arange(p, p + T, device="cuda")
            low = pads + 1
            first = low + (torch.rand(rows, device="cuda", generator=g) * (length - T - low)).long()
            index = first[:, None] + torch.arange(T, device="cuda")[None, :]
            yield f"{shape} T={T} own pads and positions", q, keys, values, pads, index


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=62, help="rows of the timed decode step")
    parser.add_argument("--proof-rows", type=int, default=6)
    parser.add_argument("--spans", default="256,2048,3336")
    parser.add_argument("--repeats", type=int, default=48)
    parser.add_argument("--out", help="write the proof and the timings as JSON here")
    parser.add_argument("--best", help="write the fastest variant byte-identical in every case here (JSON)")
    parser.add_argument("--no-variants", action="store_true", help="the kernel in use and the reference only")
    args = parser.parse_args(argv)
    if args.no_variants:
        VARIANTS.clear()
    kernels = it.TritonKernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {it.triton.__version__}; fp32 "
          f"config {it.CONFIGS['fp32']}", flush=True)
    proof, control = [], []
    for name, q, keys, values, pads, index in cases(g, args.proof_rows, 3336):
        a = call(kernels, REFERENCE, q, keys, values, pads, index, 128 ** -0.5, 64)
        equal = {v: torch.equal(a.view(torch.int32), call(kernels, config, q, keys, values, pads, index,
                                                          128 ** -0.5, 64).view(torch.int32))
                 for v, config in {IN_USE_NAME: IN_USE, **VARIANTS}.items()}
        c = call(kernels, {**REFERENCE, "attention_chunk_blocks": 8}, q, keys, values, pads, index, 128 ** -0.5, 64)
        differ = int((a.view(torch.int32) != c.view(torch.int32)).sum())
        proof.append({"case": name, "equal": equal, "values": a.numel()})
        control.append({"case": name, "values_differing": differ})
        print(f"{name:40s} {sum(equal.values())}/{len(equal)} variants == per-query-head"
              + (f" (not: {[v for v in equal if not equal[v]]})" if not all(equal.values()) else "")
              + f"; control (chunks of 8 blocks): {differ} of {a.numel()} values differ", flush=True)
    print(f"proof of the module's choice {IN_USE}: {sum(p['equal'][IN_USE_NAME] for p in proof)}/{len(proof)} cases "
          f"byte-identical; control differs in {sum(c['values_differing'] > 0 for c in control)}/{len(control)} "
          "cases", flush=True)

    spans = [int(s) for s in args.spans.split(",")]
    heads, kv = SHAPES["14B"]
    rows, length = args.rows, max(spans)
    keys = torch.randn(rows, kv, length, 128, device="cuda", generator=g)
    values = torch.randn(rows, kv, length, 128, device="cuda", generator=g)
    q = torch.randn(rows, 1, heads, 128, device="cuda", generator=g)
    pads = torch.zeros(rows, dtype=torch.long, device="cuda")
    timings = []
    for span in spans:
        index = torch.tensor([span - 1], device="cuda")
        row = {"span": span}
        for name, config in (("per_query_head", REFERENCE), (IN_USE_NAME, IN_USE), *VARIANTS.items()):
            call(kernels, config, q, keys, values, pads, index, 128 ** -0.5, 64)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.repeats):
                call(kernels, config, q, keys, values, pads, index, 128 ** -0.5, 64)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - start) / args.repeats
            row[name] = {"ms": dt * 1e3, "TB_s": rows * kv * span * 128 * 4 * 2 / dt / 1e12}
        row["ratio"] = row[IN_USE_NAME]["ms"] / row["per_query_head"]["ms"]
        timings.append(row)
        print(f"span {span:5d}  " + "   ".join(f"{name} {row[name]['ms']:.3f} ms ({row[name]['TB_s']:.2f} TB/s)"
                                             for name in row if isinstance(row[name], dict))
              + f"   in use / reference {row['ratio']:.2f}", flush=True)
    identical = [v for v in VARIANTS if all(p["equal"][v] for p in proof)]
    at = timings[-1]  # the longest span
    best = min(identical, key=lambda v: at[v]["ms"]) if identical else None
    if VARIANTS:
        print(f"byte-identical variants: {len(identical)}/{len(VARIANTS)}; fastest at span {at['span']}: {best} "
              f"({at[best]['ms']:.3f} ms, {at[best]['ms'] / at['per_query_head']['ms']:.2f} x the reference)"
              if best else "no variant is byte-identical", flush=True)
    if args.best and best:
        Path(args.best).write_text(json.dumps(VARIANTS[best]))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "triton": it.triton.__version__, "config": it.CONFIGS["fp32"],
                                              "rows": rows, "proof": proof, "control": control,
                                              "timings": timings, "best": best}, indent=1))
    return 0 if all(p["equal"][IN_USE_NAME] for p in proof) else 1


if __name__ == "__main__":
    sys.exit(main())
