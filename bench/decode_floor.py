"""Batch-1 decode against the bandwidth floor: the cuda_graph regime's greedy loop on one GPU, per static-forward
attention, with the device copy rate measured in the same run and a kernel profile of one decode step.

    PYTHONPATH=src python bench/decode_floor.py --shape 14B --precision bf16 --attentions masked,triton --json OUT

The model has RANDOM weights of the named Qwen2.5 shape (bench/benchmark.py SHAPES): speed only. The floor is the
weight bytes one decode step reads divided by the measured copy rate (read + write), as in bench/benchmark.py.
For each attention it prints the engine's rate (``decode_rows``: one host sync, argmax, margin and stop check per
token), the device-side loop's rate (next ids stay on the GPU) and their shares of the floor, and, with
``--profile``, the step's kernels: how many, and the time of the weight-reading GEMMs against everything else.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import (PRECISIONS, SHAPES, build_model, copy_rate, prompts_for, rate_device_loop,  # noqa: E402
                       rate_engine, weight_bytes)

import stagereplay.decode.greedy as greedy  # noqa: E402
from stagereplay.decode.static import StaticDecoder  # noqa: E402
from stagereplay.models.loading import set_determinism  # noqa: E402


class FusedKernelsDecoder(StaticDecoder):
    """EXPLORATION, not a regime of the package: the static forward with its masked attention and library GEMMs,
    but RMSNorm, RoPE and the SiLU gate through the invariant regime's single Triton kernels (one launch each
    instead of several): how much of the small-kernel time fusion would win. Its bits differ from the default
    static regime's."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        from stagereplay.models.invariant_triton import TritonKernels

        self.ops = TritonKernels()
        with torch.no_grad():
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            cos, sin = model.model.rotary_emb(probe, self.positions[None])
        self.cos_table, self.sin_table = cos[0], sin[0]

    def _forward(self, ids, index, rows, span, row0=0):
        ops, inner = self.ops, self.model.model
        T = ids.shape[1]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        group = H // KV
        pads = self.pads[row0:row0 + rows]
        position_ids = (index[None, :] - pads[:, None]).clamp_min(0)
        cos = self.cos_table[position_ids].reshape(rows * T, D)
        sin = self.sin_table[position_ids].reshape(rows * T, D)
        keys = self.positions[None, None, :span]
        allowed = ((keys >= pads[:, None, None]) & (keys <= index[None, :, None])) | (keys == index[None, :, None])
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))
        bias = bias[:, None, None].expand(rows, KV, group, T, span).reshape(rows * KV, group * T, span)
        h = inner.embed_tokens(ids).reshape(rows * T, -1)
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            qkv_w, qkv_b, gate_up_w = self.fused[i]
            norm = layer.input_layernorm
            qkv = torch.nn.functional.linear(ops.rms_norm(h, norm.weight, norm.variance_epsilon), qkv_w, qkv_b)
            qk = ops.rotary(qkv[:, : (H + KV) * D].reshape(rows * T, H + KV, D), cos, sin)
            qk = qk.view(rows, T, H + KV, D).transpose(1, 2)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + KV) * D:].reshape(rows, T, KV, D).transpose(1, 2)
            kb, vb = self.k[i][row0:row0 + rows], self.v[i][row0:row0 + rows]
            torch.use_deterministic_algorithms(False)  # distinct positions: the non-sorting index_copy_ (as the
            kb.index_copy_(2, index, k)                 # static forward does)
            vb.index_copy_(2, index, v)
            torch.use_deterministic_algorithms(True)
            qg = q.reshape(rows * KV, group * T, D)
            kspan = kb.view(rows * KV, self.max_len, D)[:, :span]
            scores = torch.baddbmm(bias, qg, kspan.transpose(1, 2), alpha=attn.scaling)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            out = torch.bmm(probs, vb.view(rows * KV, self.max_len, D)[:, :span])
            out = out.view(rows, H, T, D).transpose(1, 2).reshape(rows * T, H * D)
            h = h + attn.o_proj(out)
            norm = layer.post_attention_layernorm
            gate_up = torch.nn.functional.linear(ops.rms_norm(h, norm.weight, norm.variance_epsilon), gate_up_w)
            width = gate_up.shape[1] // 2
            h = h + layer.mlp.down_proj(ops.gated_act(layer.mlp.act_fn, gate_up[:, :width], gate_up[:, width:]))
        last = h.view(rows, T, -1)[:, -1]
        norm = inner.norm
        return self.model.lm_head(ops.rms_norm(last, norm.weight, norm.variance_epsilon)).float()


def greedy_choice_one_transfer(logits: torch.Tensor):
    """EXPLORATION: ``greedy.greedy_choice`` with its three results brought to the host in one copy (one sync
    instead of three); the same values (int64 ids and fp32 margins are exact in float64)."""
    top = torch.topk(logits, 2, dim=-1)
    choice = torch.argmax(logits, dim=-1)
    finite = torch.isfinite(logits).all(dim=-1)
    packed = torch.stack([choice.double(), (top.values[:, 0] - top.values[:, 1]).double(), finite.double()]).cpu()
    return packed[0].long(), packed[1].float(), packed[2].bool()


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


ORIGINAL_CHOICE = greedy.greedy_choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="14B", choices=list(SHAPES))
    ap.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    ap.add_argument("--attentions", default="masked,triton",
                    help="static-forward attentions; +fused: the exploratory FusedKernelsDecoder; +onesync: the greedy "
                         "loop's choice brought to the host in one copy")
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
    first, reference_ids = None, None
    for attention in args.attentions.split(","):
        greedy.greedy_choice = greedy_choice_one_transfer if "onesync" in attention else ORIGINAL_CHOICE
        kind = FusedKernelsDecoder if "fused" in attention else StaticDecoder
        decoder = kind(model, (), max_len=args.prompt_len + args.new_tokens + 8, max_rows=1, regime="cuda_graph",
                       attention=attention.split("+")[0])
        engine, ids = rate_engine(decoder, prompt, args.new_tokens)
        device = rate_device_loop(decoder, [prompt], args.new_tokens)
        row = {"engine_tok_s": engine, "device_loop_tok_s": device, "engine_share": engine / floor,
               "device_loop_share": device / floor, "first_ids": ids[:16]}
        reference_ids = reference_ids or ids
        row["same_ids_as_first"] = ids == reference_ids
        if args.profile:
            row["profile"] = step_profile(decoder, prompt)
        first = first or engine
        row["engine_vs_first"] = engine / first
        out["attentions"][attention] = row
        print(f"  {attention}: engine {engine:.1f} tok/s ({engine / floor:.1%} of floor), device loop {device:.1f} "
              f"({device / floor:.1%}); engine x{engine / first:.3f} against {args.attentions.split(',')[0]}, "
              f"same greedy ids {row['same_ids_as_first']}",
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
