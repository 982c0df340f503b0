"""Where a transplant decode's time goes, on a GPU, against its floor (issue 49's first step).

One batch in the transplant stage's shape (``--rows`` rows, varied prompt and stage lengths, ``--new`` suffix
tokens, the static or cuda_graph regime): the rebuild of both constructions (what the stage does per batch), then
transplant decodes with ``--edited`` rows edited, recipient ``incremental`` (the live schedule: the stage is
replayed token by token) and recipient ``prefill`` (one forward, then the steps), donor arm and placebo arm. Each
decode is timed whole, its steps counted and timed (a CUDA event pair around every ``decoder.step``), the boundary
work (edit + fingerprint) timed, and one decode is run under torch.profiler for the host's synchronisations. The
floor: a step reads the weights and the batch's K/V buffer once, at the device's bandwidth.

    python scripts/make_random_qwen.py /tmp/m --shape qwen2.5-0.5b
    python bench/transplant_profile.py --model /tmp/m --rows 16 --edited 4 --new 128 --out OUT.json

RANDOM WEIGHTS: speed only.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

import stagereplay.decode.greedy as greedy
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import RunSettings
from stagereplay.experiments.transplant import transplant_rows
from stagereplay.experiments.transplant_specs import TransplantSpec
from stagereplay.models.loading import load_model, set_determinism
from stagereplay.models.sources import ModelSource


class StepClock:
    """Wraps ``decoder.step`` and the greedy loop's boundary work: counts and times them on the device."""

    def __init__(self, decoder):
        self.decoder, self.inner = decoder, decoder.step
        self.inner_boundary = greedy._at_boundary
        self.events, self.boundary_s, self.boundaries = [], 0.0, 0

        def step(batch, tokens):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.inner(batch, tokens)
            end.record()
            self.events.append((start, end))
            return out

        def at_boundary(*args, **kwargs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = self.inner_boundary(*args, **kwargs)
            torch.cuda.synchronize()
            self.boundary_s += time.perf_counter() - t
            self.boundaries += 1
            return out

        decoder.step = step
        greedy._at_boundary = at_boundary

    def reset(self):
        self.events, self.boundary_s, self.boundaries = [], 0.0, 0

    def summary(self) -> dict:
        torch.cuda.synchronize()
        ms = [a.elapsed_time(b) for a, b in self.events]
        return {"steps": len(ms), "step_device_ms_total": sum(ms),
                "step_device_ms_median": sorted(ms)[len(ms) // 2] if ms else None,
                "boundaries": self.boundaries, "boundary_s": self.boundary_s}


def timed(clock, fn) -> dict:
    clock.reset()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return {"wall_s": time.perf_counter() - t, **clock.summary()}


def floor_ms(model, rows: int, max_len: int, bandwidth_gbs: float) -> dict:
    """One step's bytes: every weight once and the batch's whole K/V buffer (the static regime attends over it)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * rows * cfg.num_key_value_heads * max_len * head_dim * 2
    return {"weights_bytes": weights, "kv_bytes": kv, "bandwidth_gbs": bandwidth_gbs,
            "floor_ms_per_step": (weights + kv) / (bandwidth_gbs * 1e9) * 1e3}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--regime", default="cuda_graph", choices=["static", "cuda_graph"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--edited", type=int, default=4)
    parser.add_argument("--stage", type=int, nargs=2, default=[40, 160], help="stage lengths drawn in [lo, hi)")
    parser.add_argument("--prompt", type=int, nargs=2, default=[60, 140])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--bandwidth", type=float, default=3350.0, help="GB/s (H100 SXM 3350, H200 4800)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    set_determinism(1)
    loaded = load_model(ModelSource("local", args.model), args.precision, "cuda")
    vocab = int(loaded.model.config.vocab_size)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(*args.prompt))] for _ in range(args.rows)]
    stages = [[rng.randrange(100, vocab) for _ in range(rng.randrange(*args.stage))] for _ in range(args.rows)]
    settings = RunSettings("random", args.precision, None, args.new, decode_regime=args.regime)
    max_len = max(len(p) for p in prompts) + max(len(s) for s in stages) + args.new + 8
    decoder = make_decoder(loaded.model, (), args.regime, max_len=max_len, max_rows=args.rows)
    clock = StepClock(decoder)
    edited = list(range(0, args.rows, max(1, args.rows // args.edited)))[: args.edited]
    keep = set(edited)
    out = {"random_weights": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "regime": args.regime, "rows": args.rows, "edited": edited, "new": args.new, "max_len": max_len,
           "prompt_lengths": [len(p) for p in prompts], "stage_lengths": [len(s) for s in stages],
           "floor": floor_ms(loaded.model, args.rows, max_len, args.bandwidth), "decodes": {}}
    own = {}
    for name in ("incremental", "prefill"):  # warm: graphs captured, allocator pools filled
        run(decoder, name, prompts, settings, stages=stages, keep=keep)
    for name in ("incremental", "prefill"):
        holder = {}
        out["decodes"][f"rebuild {name}"] = timed(clock, lambda n=name: holder.update(
            r=run(decoder, n, prompts, settings, stages=stages, keep=keep)))
        own[name] = holder["r"]
    every = TransplantSpec("all", tuple(range(decoder.n_layers)))
    half = TransplantSpec("halves", tuple(range(decoder.n_layers // 2)))
    for donor, recipient in (("prefill", "incremental"), ("incremental", "prefill")):
        for arm in ("donor", "placebo"):
            for spec in (every, half):
                key = f"transplant {donor}->{recipient} {arm} {spec.sweep}"
                out["decodes"][key] = timed(clock, lambda d=donor, r=recipient, a=arm, s=spec: transplant_rows(
                    decoder, prompts, stages, settings, own, d, r, {i: s for i in edited}, a))
    for key, d in out["decodes"].items():
        d["ms_per_step_wall"] = 1e3 * d["wall_s"] / max(1, d["steps"])
        d["host_share"] = 1 - d["step_device_ms_total"] / 1e3 / d["wall_s"]
    # the host's synchronisations in one decode of each recipient
    from torch.profiler import ProfilerActivity, profile

    for donor, recipient in (("prefill", "incremental"), ("incremental", "prefill")):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            transplant_rows(decoder, prompts, stages, settings, own, donor, recipient, {i: every for i in edited})
        table = {e.key: {"count": e.count, "cpu_ms": e.cpu_time_total / 1e3, "device_ms": e.device_time_total / 1e3}
                 for e in prof.key_averages()}
        syncs = {k: v for k, v in table.items() if "Synchronize" in k or "Memcpy" in k or "item" in k
                 or "cudaGraphLaunch" in k or "_local_scalar_dense" in k}
        top = sorted(table.items(), key=lambda kv: -kv[1]["cpu_ms"])[:25]
        out[f"profile recipient {recipient}"] = {"syncs_and_copies": syncs, "top_cpu": dict(top)}
    print(json.dumps({k: v for k, v in out.items() if not k.startswith("profile")}, indent=1))
    for k, v in out.items():
        if k.startswith("profile"):
            print(k)
            for name, e in v["syncs_and_copies"].items():
                print(f"  {name[:60]:60s} n={e['count']:6d} cpu {e['cpu_ms']:9.1f} ms dev {e['device_ms']:9.1f} ms")
            for name, e in list(v["top_cpu"].items())[:12]:
                print(f"  top {name[:56]:56s} n={e['count']:6d} cpu {e['cpu_ms']:9.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
