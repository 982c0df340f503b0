"""Batch-1 decode against the bandwidth floor: the cuda_graph regime's greedy loop on one GPU, per static-forward
attention, with the device copy rate measured in the same run and a kernel profile of one decode step.

    PYTHONPATH=src python bench/decode_floor.py --shape 14B --precision bf16 --attentions masked,triton --json OUT

The model has RANDOM weights of the named Qwen2.5 shape (bench/benchmark.py SHAPES): speed only. The floor is the
weight bytes one decode step reads divided by the measured copy rate (read + write), as in bench/benchmark.py.
For each variant (``ATTENTION[+fused][+nolookahead]``: the static forward's attention, ``decode_kernels: fused``,
the greedy loop without its lookahead) it prints the engine's rate (``decode_rows``: argmax, margin and stop checks
on the host every token), the device-side loop's rate (next ids stay on the GPU) and their shares of the floor,
and, with ``--profile``, the step's kernels: how many, and the time of the weight-reading GEMMs against everything
else.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections import Counter
from pathlib import Path

import torch

from stagereplay.decode.static import StaticDecoder
from stagereplay.models.loading import PRECISIONS, set_determinism

from decode_rates import rate_device_loop, rate_engine
from random_models import SHAPES, build_model, copy_rate, prompts_for, weight_bytes


def step_profile(decoder: StaticDecoder, prompt: list[int], steps: int = 5) -> dict:
    """Kernels of ``steps`` graph-replayed decode steps: count per step and device time split into GEMM/GEMV
    kernels (the weight reads) and the rest."""
    from torch.profiler import ProfilerActivity, profile

    cache, logits = decoder.open([prompt])
    ids = logits.argmax(-1, keepdim=True)
    ids = decoder.forward_rows(ids, cache).argmax(-1, keepdim=True)  # capture
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            ids = decoder.forward_rows(ids, cache).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    def is_gemm(name: str) -> bool:
        low = name.lower()
        return any(k in low for k in ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitk"))
    total = sum(e.device_time for e in kernels)
    gemm = sum(e.device_time for e in kernels if is_gemm(e.name))
    names = Counter()
    for e in kernels:
        names[e.name[:90]] += e.device_time
    return {"kernels_per_step": len(kernels) / steps, "device_us_per_step": total / steps,
            "gemm_us_per_step": gemm / steps, "other_us_per_step": (total - gemm) / steps,
            "top": [(n, round(t / steps, 1)) for n, t in names.most_common(14)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="14B", choices=list(SHAPES))
    ap.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    ap.add_argument("--attentions", default="masked,triton",
                    help="variants, comma-separated: a static-forward attention (masked, triton), then +fused for "
                         "decode_kernels fused and +nolookahead for the greedy loop without its lookahead")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_floor measures a CUDA device; none is visible")
    set_determinism(os.cpu_count())
    model = build_model(args.shape, args.precision, "cuda")
    bandwidth = copy_rate("cuda", 4.0)
    wbytes = weight_bytes(model)
    floor = bandwidth / wbytes
    prompt = prompts_for(1, args.prompt_len, model.config.vocab_size, 1)[0]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "weights": f"random, {args.shape} shape", "precision": args.precision, "copy_TB_s": bandwidth / 1e12,
           "weights_GB": wbytes / 1e9, "floor_tok_s": floor, "attentions": {}}
    print(f"{args.shape} {args.precision}: weights {wbytes / 1e9:.1f} GB, copy {bandwidth / 1e12:.2f} TB/s, floor "
          f"{floor:.1f} tok/s", flush=True)
    first, reference_ids = None, {}
    for attention in args.attentions.split(","):
        parts = attention.split("+")
        unknown = set(parts[1:]) - {"fused", "nolookahead"}
        if unknown:
            sys.exit(f"unknown variant flags {sorted(unknown)} in {attention!r}: use +fused and/or +nolookahead")
        decoder = StaticDecoder(model, (), max_len=args.prompt_len + args.new_tokens + 8, max_rows=1,
                                regime="cuda_graph", attention=parts[0],
                                kernels="fused" if "fused" in parts else "library")
        decoder.lookahead = "nolookahead" not in parts
        engine, ids = rate_engine(decoder, prompt, args.new_tokens)
        device = rate_device_loop(decoder, [prompt], args.new_tokens)
        row = {"engine_tok_s": engine, "device_loop_tok_s": device, "engine_share": engine / floor,
               "device_loop_share": device / floor, "first_ids": ids[:16], "record": decoder.record(),
               "lookahead": decoder.lookahead}
        forward = (parts[0], decoder.decode_kernels)  # the lookahead must not change a token
        reference_ids.setdefault(forward, ids)
        row["same_ids_as_first_with_this_forward"] = ids == reference_ids[forward]
        if args.profile:
            row["profile"] = step_profile(decoder, prompt)
        first = first or engine
        row["engine_vs_first"] = engine / first
        out["attentions"][attention] = row
        print(f"  {attention}: engine {engine:.1f} tok/s ({engine / floor:.1%} of floor), device loop {device:.1f} "
              f"({device / floor:.1%}); engine x{engine / first:.3f} against {args.attentions.split(',')[0]}, "
              f"same greedy ids as the first run of this forward {row['same_ids_as_first_with_this_forward']}",
              flush=True)
        if args.profile:
            p = row["profile"]
            print(f"    {p['kernels_per_step']:.0f} kernels a step, {p['device_us_per_step']:.0f} us on the device: "
                  f"GEMM {p['gemm_us_per_step']:.0f} us, other {p['other_us_per_step']:.0f} us", flush=True)
            for name, us in p["top"]:
                print(f"      {us:8.1f} us  {name}", flush=True)
        decoder.graphs.clear()
        del decoder
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
