"""Decode speed on one GPU: the naive loops against the project's regimes, a projection of the paper-scale run,
and the bridge checked on the device. One command, one process:

    PYTHONPATH=src python bench/benchmark.py --out OUTDIR

Models are random-weight Qwen2.5 shapes built from Qwen2Config (no weights are downloaded): every number here is
a speed or an exactness check, never model quality. Writes OUTDIR/results.json (every measurement) and
OUTDIR/results.md (the tables), printing each table as it is measured. On a CPU, ``--tiny`` runs every code path
on a toy shape in seconds (that is how the script is tested; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.io.ids import first_divergence
from stagereplay.decode.plans import batch_plan
from stagereplay.decode.regimes import make_decoder
from stagereplay.decode.fused import fuse_layer
from stagereplay.decode.static import ATTENTIONS, KERNELS, StaticDecoder
from stagereplay.experiments import constructions
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import RunSettings
from stagereplay.models.loading import PRECISIONS, set_determinism
from stagereplay.projection.floor import fp32_floor, run_floor
from stagereplay.projection.paper import project

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench/ helpers, also when loaded by file path
from batch_invariance import StageOfLength, batch_invariance, live_rows  # noqa: E402
from bucketed import BucketedDecoder  # noqa: E402

SHAPES = {
    # Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads / 2 KV heads, tied embeddings
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    # Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads / 2 KV heads, tied embeddings
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    # Qwen2.5-7B: hidden 3584, 28 layers, 28 heads / 4 KV heads, untied embeddings
    "7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    # Qwen2.5-14B: hidden 5120, 48 layers, 40 heads / 8 KV heads, untied embeddings
    "14B": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=13824, vocab_size=152064, tie_word_embeddings=False),
    # a toy shape that exercises every path on a CPU in seconds
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
}

RESULTS: dict = {"decode": [], "projection": [], "bridge": [], "errors": []}


def log(*a):
    print(*a, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t, out


def build_model(shape: str, precision: str, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1_000_000.0, eos_token_id=None,
                      pad_token_id=0, bos_token_id=None, use_sliding_window=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(cfg, dtype=PRECISIONS[precision], attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every parameter once; an untied input embedding only by one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def copy_rate(device: str, gbytes: float) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    n = int(gbytes * 2**30) // 4
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    times = []
    for i in range(13):
        dt, _ = timed(lambda: y.copy_(x))
        if i >= 3:
            times.append(dt)
    del x, y
    return 2 * n * 4 / sorted(times)[len(times) // 2]


def prompts_for(n_rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n_rows, length), generator=g).tolist()


# -- decode rates ---------------------------------------------------------------------------------------------

def rate_generate(model, prompt, n_new) -> float:
    """model.generate, greedy; decode rate from the difference of n_new and 1 new tokens (prefill cancels)."""
    ids = torch.tensor([prompt], device=model.device)
    mask = torch.ones_like(ids)

    def gen(n):
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                              pad_token_id=0)

    gen(2)
    t1, _ = timed(lambda: gen(1))
    tn, out = timed(lambda: gen(n_new))
    assert out.shape[1] == len(prompt) + n_new
    return (n_new - 1) / (tn - t1)


class FromFirstStep:
    """A decoder as the greedy loop sees it, clocked from its first ``step``: the loop's continuation from the
    boundary (the pending tokens fed, then one greedy token per step), without the cache build and the boundary
    fingerprints that come before it."""

    def __init__(self, decoder):
        self.decoder, self.start = decoder, None

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def step(self, batch, tokens):
        if self.start is None:
            sync()
            self.start = time.perf_counter()
        return self.decoder.step(batch, tokens)


# a one-token stage: each prompt but its last token in one forward, that token pending (the live schedule's own
# cache, so a batch of rows decodes it without a second build)
PENDING_LAST = constructions.get("incremental").cache_build()


def continuation(decoder, prompts, n_new) -> tuple[float, list]:
    """The package's greedy loop (``decode_rows``) from a prefilled cache over each prompt but its last token, that
    token pending: ``n_new`` greedy tokens per row (host loop: one sync per token, margins and stop checks per
    row). Seconds from the first step (the cache's build is not timed), and the rows' results."""
    clocked = FromFirstStep(decoder)
    out = decode_rows(clocked, [p[:-1] for p in prompts], stages=[p[-1:] for p in prompts], build=PENDING_LAST,
                      max_new_tokens=n_new)
    sync()
    return time.perf_counter() - clocked.start, out


def rate_engine(decoder, prompt, n_new) -> tuple[float, list[int]]:
    """The package's greedy loop at batch 1 from a prefilled cache (host loop: one sync per token)."""
    continuation(decoder, [prompt], 2)
    dt, out = continuation(decoder, [prompt], n_new)
    return n_new / dt, out[0].suffix_ids


def rate_device_loop(decoder: StaticDecoder, prompts, n_new) -> float:
    """Aggregate tok/s of greedy steps whose next ids stay on the device (no host sync inside the loop)."""
    cache, logits = decoder.open(prompts)  # the prompts, left-padded, in one forward
    ids = logits.argmax(-1, keepdim=True)
    ids = decoder.forward_rows(ids, cache).argmax(-1, keepdim=True)  # captures the graph for this row count

    def loop():
        nonlocal ids
        for _ in range(n_new):
            ids = decoder.forward_rows(ids, cache).argmax(-1, keepdim=True)

    dt, _ = timed(loop)
    return len(prompts) * n_new / dt


def rate_continue_batch(decoder: StaticDecoder, prompts, n_new) -> tuple[float, list]:
    """Aggregate tok/s of the package's greedy loop over a batch of rows (host loop, margins and stop checks per
    row)."""
    continuation(decoder, prompts, 2)
    dt, out = continuation(decoder, prompts, n_new)
    return len(prompts) * n_new / dt, out


def decode_rates(model, shape, precision, args, bandwidth) -> dict:
    vocab = model.config.vocab_size
    prompt = prompts_for(1, args.prompt_len, vocab, 1)[0]
    wbytes = weight_bytes(model)
    floor = bandwidth / wbytes
    row = {"shape": shape, "precision": precision, "weights_GB": wbytes / 1e9, "floor_tok_s": floor,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    n = args.new_tokens
    row["generate_tok_s"] = rate_generate(model, prompt, n)
    log(f"  {shape} {precision}: model.generate {row['generate_tok_s']:.1f} tok/s")
    row["eager_loop_tok_s"], eager_ids = rate_engine(EagerDecoder(model, ()), prompt, n)
    log(f"  {shape} {precision}: eager DynamicCache loop {row['eager_loop_tok_s']:.1f} tok/s")
    max_len = args.prompt_len + n + 8
    cuda = torch.cuda.is_available()  # CPU: the static regime stands in (no graphs), so every code path still runs
    graph = StaticDecoder(model, (), max_len=max_len, max_rows=max(args.batches),
                          regime="cuda_graph" if cuda else "static", attention=args.decode_attention,
                          kernels=args.decode_kernels)
    row["graph_engine_tok_s"], graph_ids = rate_engine(graph, prompt, n)
    row["graph_device_loop_tok_s"] = rate_device_loop(graph, [prompt], n)
    if cuda:
        static = StaticDecoder(model, (), max_len=max_len, regime="static", kernels=args.decode_kernels)
        _, static_ids = rate_engine(static, prompt, min(n, 16))
        row["static_equals_graph_first16"] = static_ids == graph_ids[: len(static_ids)]
        del static
    row["eager_vs_graph_first_divergence"] = first_divergence(eager_ids, graph_ids)
    log(f"  {shape} {precision}: cuda_graph b1 engine {row['graph_engine_tok_s']:.1f} tok/s, device loop "
        f"{row['graph_device_loop_tok_s']:.1f} tok/s ({row['graph_device_loop_tok_s'] / floor:.0%} of floor "
        f"{floor:.0f})")
    row["batched"] = {}
    for b in args.batches:
        prompts = prompts_for(b, args.prompt_len, vocab, 100 + b)
        agg, _ = rate_continue_batch(graph, prompts, n)
        dev = rate_device_loop(graph, prompts, n)
        row["batched"][b] = {"continue_batch_tok_s": agg, "device_loop_tok_s": dev}
        log(f"  {shape} {precision}: batch {b}: continue_batch {agg:.0f} tok/s, device loop {dev:.0f} tok/s")
    if shape == args.bridge_shape:
        row["batch_control"] = batch_control(graph, vocab, args)
    graph.graphs.clear()
    del graph
    return row


def batch_control(decoder, vocab, args) -> dict:
    """Batched live runs of prompts of different lengths: replicas of one plan, and rows against batch 1."""
    item_ids, seed = [f"item-{i}" for i in range(args.control_items)], 0
    plan = batch_plan(item_ids, args.control_items, seed=seed)  # None at one item: a batch of one row
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(args.bridge_prompt // 2, args.bridge_prompt, (args.control_items,), generator=g).tolist()
    by_id = {f"item-{i}": prompts_for(1, n, vocab, 200 + i)[0] for i, n in enumerate(lengths)}
    prompts = [by_id[i] for i in (plan.batches[0] if plan is not None else item_ids)]
    matcher = StageOfLength(args.bridge_stage)  # random weights: a fixed-length stage
    live = lambda: live_rows(decoder, prompts, matcher, args.bridge_stage, args.bridge_suffix)  # noqa: E731
    a, b = live(), live()
    replicas = all(x.fingerprints == y.fingerprints and x.suffix_ids == y.suffix_ids for x, y in zip(a, b))
    records = batch_invariance(decoder, prompts, a, matcher, args.bridge_stage, args.bridge_suffix,
                               sample=args.control_sample, seed=0)
    out = {"rows": len(prompts), "plan_seed": seed, "replicas_equal": replicas, "sampled": len(records),
           "suffix_disagreements": sum(not r["suffix_equal"] for r in records),
           "cache_disagreements": sum(not r["cache_equal"] for r in records), "records": records}
    log(f"  batch control: {out['rows']} rows, replicas equal {replicas}; vs batch 1 on {len(records)} sampled "
        f"rows: {out['suffix_disagreements']} suffix and {out['cache_disagreements']} cache disagreements")
    return out


# -- projection of the paper-scale run --------------------------------------------------------------------------

def kv_bytes_per_position(model) -> int:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def shared_rows(model, max_len: int, args) -> int:
    """Rows of ``max_len`` positions that fit next to the weights at the run's widest precision, less
    ``--proj-headroom-gib`` for activations, graphs and the allocator. The pipeline decodes every precision in one
    batch plan (the batch is a construction factor, so the 2x2 compares precisions over the same batches), so the
    projection gives every precision this one row count: the widest precision's memory sets it."""
    widest = max(PRECISIONS[p].itemsize for p in args.precisions.split(","))
    element = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * widest
    per_row = kv_bytes_per_position(model) // element * widest * max_len
    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 16 * 2**30
    return int((total - weights - args.proj_headroom_gib * 2**30) // per_row)


def projection_measure(model, shape, precision, args) -> dict:
    """A reduced run of every stage at paper-scale lengths: batched decode steps, batched one-shot prefills,
    cache dumps to disk and back."""
    P, S, N = args.proj_prompt, args.proj_stage, args.proj_suffix
    max_len = P + S + N + 8
    gc.collect()  # decoders of earlier measurements hold buffers until their reference cycles are collected
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    per_row = kv_bytes_per_position(model) * max_len
    rows = max(1, min(args.proj_max_rows, shared_rows(model, max_len, args)))
    out = {"shape": shape, "precision": precision, "P": P, "S": S, "N": N, "max_len": max_len, "rows": rows,
           "kv_GB_per_row": per_row / 1e9, "rows_rule": "one batch size for every precision"}
    regime = "cuda_graph" if torch.cuda.is_available() else "static"
    triton_attention = args.decode_attention == "triton"
    # the triton attention reads each row's keys up to its position: its "bucket" is one position
    bucket = 1 if triton_attention else args.proj_bucket
    dec = BucketedDecoder(model, (), max_len=max_len, max_rows=rows, regime=regime,
                          bucket=None if triton_attention else bucket, attention=args.decode_attention,
                          kernels=args.decode_kernels)
    out["decode_attention"], out["decode_kernels"] = args.decode_attention, args.decode_kernels
    vocab = model.config.vocab_size
    prompts = prompts_for(rows, 16, vocab, 7)
    cache, _ = dec.open(prompts)
    ids = torch.ones(rows, 1, dtype=torch.long, device=dec.device)
    # A step's cost depends on the span it attends over (the whole buffer, the position's bucket, or with the
    # triton attention the position itself), not on the content: time a few steps at a few spans and fit
    # time = a + b * span.
    steps = args.proj_steps
    points = (args.proj_bucket, max_len // 3, 2 * max_len // 3, max_len)
    spans = sorted({min(p, max_len) for p in points} if triton_attention else {dec.span(e) for e in points})
    out["span_step_s"] = {}
    for span in spans:
        cache.length = span - steps - 1  # positions before hold zeros: timing only
        dec.forward_rows(ids, cache)  # capture this span's graph
        dt, _ = timed(lambda: [dec.forward_rows(ids, cache) for _ in range(steps)])
        out["span_step_s"][span] = dt / steps
    xs, ys = list(out["span_step_s"]), list(out["span_step_s"].values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    out["step_fit"] = {"a_s": my - b * mx, "b_s_per_position": b, "bucket": bucket}
    out["step_s"] = out["span_step_s"][spans[-1]]
    out["decode_tok_s"] = rows / out["step_s"]
    log(f"  projection {shape} {precision}: {rows} rows x max_len {max_len}: step ms by span "
        f"{ {k: round(1e3 * v, 1) for k, v in out['span_step_s'].items()} }; full buffer {out['decode_tok_s']:.0f} "
        "tok/s aggregate")
    dec.graphs.clear()
    del dec, cache
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    # one-shot prefill of boundary prefixes (P + S - 1 tokens), a few rows at once
    prows = min(args.proj_prefill_rows, rows)
    pdec = StaticDecoder(model, (), max_len=P + S + 8, max_rows=prows, regime="static", kernels=args.decode_kernels)
    pp = prompts_for(prows, P + S - 1, vocab, 8)
    dt, _ = timed(lambda: pdec.open(pp))  # the rows, left-padded, in one forward
    dt, (pcache, _) = timed(lambda: pdec.open(pp))
    out["prefill_tokens_s"] = prows * (P + S - 1) / dt
    log(f"  projection {shape} {precision}: prefill {prows} x {P + S - 1} tokens in {dt:.2f} s "
        f"({out['prefill_tokens_s']:.0f} tok/s)")
    # dump one boundary cache to disk and read it back (a transplant's donor)
    from safetensors.torch import load_file, save_file

    layers = pdec.row_layers(pcache, 0, pcache.length)  # row 0's boundary cache, as views of the buffer
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        path = os.path.join(tmp, "cache.safetensors")

        def dump():
            tensors = {}
            for i, (k, v) in enumerate(layers):
                tensors[f"k.{i}"] = k.contiguous().cpu()
                tensors[f"v.{i}"] = v.contiguous().cpu()
            save_file(tensors, path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())

        dt_dump, _ = timed(dump)
        size = os.path.getsize(path)
        dt_load, loaded = timed(lambda: {k: t.to(model.device) for k, t in load_file(path).items()})
        same = all(torch.equal(loaded[f"k.{i}"].cpu(), k.cpu()) for i, (k, _) in enumerate(layers))
        # the disk's own rate: the same bytes from host memory, written and synced
        raw = os.urandom(1 << 20) * max(1, size >> 20)
        raw_path = os.path.join(tmp, "raw.bin")

        def write_raw():
            with open(raw_path, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())

        dt_raw, _ = timed(write_raw)
    out.update(dump_GB=size / 1e9, dump_GB_s=size / 1e9 / dt_dump, load_GB_s=size / 1e9 / dt_load,
               dump_roundtrip_exact=bool(same), disk_write_GB_s=len(raw) / 1e9 / dt_raw)
    log(f"  projection {shape} {precision}: cache dump {size / 1e9:.2f} GB at {out['dump_GB_s']:.2f} GB/s "
        f"(disk alone {out['disk_write_GB_s']:.2f} GB/s), load at {out['load_GB_s']:.2f} GB/s, exact {same}")
    del pdec, pcache, layers, loaded
    out.update(gemm_rates(model, rows))
    log(f"  projection {shape} {precision}: linear maps at {rows} rows {out['gemm_TFLOP_s_rows']:.1f} TFLOP/s, at "
        f"{out['gemm_large_rows']} rows {out['gemm_TFLOP_s_large']:.1f} TFLOP/s")
    return out


def gemm_rates(model, rows: int, large: int = 2048, repeats: int = 10) -> dict:
    """FLOP/s of one decoder layer's linear maps as the static decoder runs them (the model's own weights: q|k|v
    fused, o, gate|up fused, down) at ``rows`` input rows (the decode step's batch) and at ``large`` rows (a
    prefill-sized product, near the GEMM's best rate): the compute bound of a decode step whose weights no longer
    dominate its time (fp32, where TF32 stays off)."""
    layer = model.model.layers[0]
    qkv_w, _, gate_up_w = fuse_layer(layer)  # the static decoder's fused weights (made once, reused)
    weights = [qkv_w, layer.self_attn.o_proj.weight, gate_up_w, layer.mlp.down_proj.weight]
    linear_params = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    linear_params += model.lm_head.weight.numel()
    out = {"linear_params": linear_params}
    for name, m in (("rows", rows), ("large", large)):
        xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
        for w in weights:  # warm up the library's kernel choice
            torch.nn.functional.linear(xs[w.shape[1]], w)
        dt, _ = timed(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for _ in range(repeats) for w in weights])
        flops = repeats * sum(2 * m * w.shape[0] * w.shape[1] for w in weights)
        out[f"gemm_TFLOP_s_{name}"] = flops / dt / 1e12
        del xs
    out["gemm_rows"], out["gemm_large_rows"] = rows, large
    return out


# -- the bridge on the device -------------------------------------------------------------------------------------

def bridge_study(model, precision, args, decoder, regime) -> list[dict]:
    """live vs incremental vs prefill through the package's recipe (one row each), on random prompts of
    ``bridge_prompt`` tokens."""
    rows = []
    vocab = model.config.vocab_size
    stage_len = args.bridge_stage
    settings = RunSettings(revision="random", precision=precision, max_stage_tokens=stage_len + 4,
                           max_new_tokens=args.bridge_suffix, decode_regime=regime)
    for p, prompt in enumerate(prompts_for(args.bridge_prompts, args.bridge_prompt, vocab, 11)):
        # stage_len free greedy tokens (a marker that never comes), then the boundary at the last of them
        free = decode_rows(decoder, [prompt], matcher=BoundaryMatcher(1, token_ids=[vocab + 1]),
                           max_stage_tokens=stage_len, max_new_tokens=0)[0].suffix_ids
        marker = free[stage_len - 1]
        matcher = BoundaryMatcher(free[:stage_len].count(marker), token_ids=[marker])
        live = run(decoder, "live", [prompt], settings, matcher=matcher)[0]
        assert live.stop_reason != "boundary_missing" and live.stage_ids == free[:stage_len]
        inc = run(decoder, "incremental", [prompt], settings, stages=[live.stage_ids])[0]
        pre1 = run(decoder, "prefill", [prompt], settings, stages=[live.stage_ids])[0]
        pre2 = run(decoder, "prefill", [prompt], settings, stages=[live.stage_ids], max_new_tokens=0)[0]
        f_live, f_inc, f_pre1, f_pre2 = live.fingerprints, inc.fingerprints, pre1.fingerprints, pre2.fingerprints
        first_layer = next((i for i, (a, b) in enumerate(zip(f_live[1], f_pre1[1])) if a != b), None)
        s_live, s_inc, s_pre = live.suffix_ids, inc.suffix_ids, pre1.suffix_ids
        row = {"regime": regime, "precision": precision, "prompt": p, "prompt_len": len(prompt),
               "stage_len": stage_len, "live_equals_incremental": f_live == f_inc,
               "prefill_replicas_equal": f_pre1 == f_pre2, "prefill_equals_live": f_pre1[0] == f_live[0],
               "first_K_layer_differing": first_layer,
               "suffix_live_equals_incremental": s_live == s_inc,
               "suffix_live_vs_prefill_first_divergence": first_divergence(s_live, s_pre),
               "suffix_len": args.bridge_suffix}
        log(f"  bridge {regime} {precision} prompt {p}: {row}")
        rows.append(row)
    return rows


# -- report ----------------------------------------------------------------------------------------------------

def render(meta: dict) -> str:
    L = [f"- date: {meta['date']}", f"- device: {meta['device']}", f"- torch {meta['torch']}, transformers "
         f"{meta['transformers']}, python {meta['python']}", f"- numerics: {meta['numerics']}",
         f"- measured device copy rate (read + write): {meta['copy_TB_s']:.2f} TB/s",
         "- models: **random weights** built from Qwen2Config with the real shapes; the floor is weight bytes / copy rate",
         "", "### Decode, batch 1 (tok/s)", "",
         "| shape | prec | weights GB | floor | generate | eager loop | cuda_graph (engine) | cuda_graph (device loop) | "
         "% floor | x generate |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in RESULTS["decode"]:
        L.append(f"| {r['shape']} | {r['precision']} | {r['weights_GB']:.1f} | {r['floor_tok_s']:.0f} | "
                 f"{r['generate_tok_s']:.1f} | {r['eager_loop_tok_s']:.1f} | {r['graph_engine_tok_s']:.1f} | "
                 f"{r['graph_device_loop_tok_s']:.1f} | {r['graph_engine_tok_s'] / r['floor_tok_s']:.0%} "
                 f"(device loop {r['graph_device_loop_tok_s'] / r['floor_tok_s']:.0%}) | "
                 f"{r['graph_engine_tok_s'] / r['generate_tok_s']:.1f}x |")
    L += ["", "### Decode, batched, cuda_graph (aggregate tok/s; ratio to batch-1 model.generate)", "",
          "| shape | prec | batch | continue_batch | x generate | device loop |", "| --- | --- | --- | --- | --- | --- |"]
    for r in RESULTS["decode"]:
        for b, v in r["batched"].items():
            L.append(f"| {r['shape']} | {r['precision']} | {b} | {v['continue_batch_tok_s']:.0f} | "
                     f"{v['continue_batch_tok_s'] / r['generate_tok_s']:.0f}x | {v['device_loop_tok_s']:.0f} |")
    controls = [r for r in RESULTS["decode"] if r.get("batch_control")]
    if controls:
        L += ["", "### Batch control (cuda_graph; batched live run of prompts of different lengths, left-padded)", "",
              "| shape | prec | rows | plan seed | replicas of the plan equal | rows sampled vs batch 1 | suffix disagreements | "
              "cache disagreements |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in controls:
            c = r["batch_control"]
            L.append(f"| {r['shape']} | {r['precision']} | {c['rows']} | {c['plan_seed']} | {c['replicas_equal']} | "
                     f"{c['sampled']} | {c['suffix_disagreements']} | {c['cache_disagreements']} |")
    if RESULTS["projection"]:
        L += ["", "### Reduced run of every stage, paper-scale lengths", "",
              "| shape | prec | P/S/N | rows | step ms (whole buffer) | step ms by attended span | decode tok/s | "
              "prefill tok/s | dump GB | dump GB/s | disk alone GB/s | load GB/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for m in RESULTS["projection"]:
            by_span = ", ".join(f"{k}: {1e3 * v:.1f}" for k, v in m["span_step_s"].items())
            L.append(f"| {m['shape']} | {m['precision']} | {m['P']}/{m['S']}/{m['N']} | {m['rows']} | "
                     f"{1e3 * m['step_s']:.1f} | {by_span} | {m['decode_tok_s']:.0f} | {m['prefill_tokens_s']:.0f} | "
                     f"{m['dump_GB']:.2f} | {m['dump_GB_s']:.2f} | {m['disk_write_GB_s']:.2f} | {m['load_GB_s']:.2f} |")
        for key in ("projected", "projected_bucketed", "projected_bucketed_with_dumps"):
            pr = RESULTS.get(key)
            if not pr:
                continue
            L += ["", f"Projected paper-scale run ({pr['items']} items, divergent fraction {pr['divergent_fraction']:.2f}, "
                  f"decode attention: {pr['attention']}, dumps: {pr.get('dumps', 'divergent')}): "
                  f"**{pr['total_s'] / 3600:.2f} h**"]
            for prec, p in pr["parts"].items():
                L.append(f"- {prec}: decode {p['decode_s'] / 60:.1f} min ({p['decode_steps_per_item']:.0f} steps/item), "
                         f"prefill {p['prefill_s'] / 60:.1f} min, dumps {p['dump_s'] / 60:.1f} min"
                         + (f"; its linear maps alone at the best measured GEMM rate: "
                            f"{p['linear_floor_s'] / 60:.1f} min" if "linear_floor_s" in p else ""))
        gemm = [m for m in RESULTS["projection"] if "gemm_TFLOP_s_rows" in m]
        if gemm:
            L += ["", "| shape | prec | linear maps at the decode rows (TFLOP/s) | at 2048 rows (TFLOP/s) |",
                  "| --- | --- | --- | --- |"]
            L += [f"| {m['shape']} | {m['precision']} | {m['gemm_TFLOP_s_rows']:.1f} ({m['gemm_rows']} rows) | "
                  f"{m['gemm_TFLOP_s_large']:.1f} |" for m in gemm]
    if RESULTS["bridge"]:
        L += ["", "### Bridge on the device (package engine)", "",
              "| regime | prec | prompt | live == incremental | prefill replicas equal | prefill == live | first K layer differing | "
              "suffix live == incremental | suffix live vs prefill: first divergence |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for b in RESULTS["bridge"]:
            L.append(f"| {b['regime']} | {b['precision']} | {b['prompt']} | {b['live_equals_incremental']} | "
                     f"{b['prefill_replicas_equal']} | {b['prefill_equals_live']} | {b['first_K_layer_differing']} | "
                     f"{b['suffix_live_equals_incremental']} | {b['suffix_live_vs_prefill_first_divergence']} |")
    if RESULTS["errors"]:
        L += ["", "### Errors", ""] + [f"- {e}" for e in RESULTS["errors"]]
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="toy shape on any device (tests the script)")
    ap.add_argument("--shapes", default="1.5B,14B")
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--bridge-shape", default="1.5B")
    ap.add_argument("--bridge-prompts", type=int, default=3)
    ap.add_argument("--bridge-prompt", type=int, default=200)
    ap.add_argument("--bridge-stage", type=int, default=32)
    ap.add_argument("--bridge-suffix", type=int, default=48)
    ap.add_argument("--control-items", type=int, default=16)
    ap.add_argument("--control-sample", type=int, default=8)
    ap.add_argument("--project-shape", default="14B")
    ap.add_argument("--proj-prompt", type=int, default=256)
    ap.add_argument("--proj-stage", type=int, default=2048)
    ap.add_argument("--proj-suffix", type=int, default=1024)
    ap.add_argument("--proj-max-rows", type=int, default=256, help="cap on the projection's decode rows")
    ap.add_argument("--proj-headroom-gib", type=float, default=8.0,
                    help="device memory left beside the weights and K/V rows when sizing the projection's batch")
    ap.add_argument("--proj-prefill-rows", type=int, default=4)
    ap.add_argument("--proj-steps", type=int, default=8)
    ap.add_argument("--proj-bucket", type=int, default=256, help="attention span bucket of the projection's decoder")
    ap.add_argument("--decode-attention", default="masked", choices=list(ATTENTIONS),
                    help="the static decoder's attention (triton: each row's keys up to its position; needs Triton)")
    ap.add_argument("--decode-kernels", default="library", choices=list(KERNELS),
                    help="the static forward's small operations (fused: one Triton kernel each; needs Triton)")
    ap.add_argument("--only-projection", action="store_true", help="skip the decode-rate and bridge sections")
    ap.add_argument("--fp32-attention-config", type=json.loads, default=None,
                    help="JSON object of fp32 attention settings for the Triton kernels (see bench/fp32_attention.py)")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--divergent", type=float, default=166 / 200)
    ap.add_argument("--model-jobs", type=int, default=0, help="model-loading jobs of the projected run")
    ap.add_argument("--job-overhead-s", type=float, default=0.0,
                    help="each model job's start, imports and load (bench/pipeline_run.py measures it)")
    ap.add_argument("--transplant-specs", type=int, default=1,
                    help="transplant runs per direction (1: the all-layer one, the study's; the default sweeps: 11)")
    ap.add_argument("--minimal-budget", type=int, default=0, help="the minimal-transplant search's runs per direction")
    ap.add_argument("--floor-from", default=None,
                    help="a saved run's JSON: print each arm's floor (fp32 at the datasheet rate) and exit, no GPU")
    ap.add_argument("--scratch", default=None, help="folder for the cache-dump measurement (default: temp dir)")
    args = ap.parse_args(argv)
    if args.floor_from:
        saved = json.loads(Path(args.floor_from).read_text())
        kwargs = {"model_jobs": args.model_jobs, "job_overhead_s": args.job_overhead_s,
                  "transplant_specs": args.transplant_specs, "minimal_budget": args.minimal_budget}
        floors = fp32_floor(saved["projection"], args.items, args.divergent, saved["meta"]["copy_TB_s"], **kwargs)
        floors["whole_run"] = run_floor(saved["projection"], args.items, args.divergent, saved["meta"]["copy_TB_s"],
                                        **kwargs)
        print(json.dumps(floors, indent=1))
        return
    if not args.out:
        ap.error("--out is needed to measure (only --floor-from runs without it)")
    if args.tiny:
        args.shapes = args.bridge_shape = args.project_shape = "tiny"
        args.prompt_len, args.new_tokens, args.batches = 24, 6, "2,3"
        args.bridge_prompts, args.bridge_prompt, args.bridge_stage, args.bridge_suffix = 1, 12, 4, 4
        args.control_items, args.control_sample = 3, 2
        args.proj_prompt, args.proj_stage, args.proj_suffix, args.proj_max_rows, args.proj_steps = 8, 16, 8, 3, 2
        args.proj_bucket = 8
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.fp32_attention_config:
        from stagereplay.models import invariant_triton

        invariant_triton.CONFIGS["fp32"] = {**invariant_triton.CONFIGS["fp32"], **args.fp32_attention_config}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flags = set_determinism(os.cpu_count() if device == "cuda" else 1)
    import transformers

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu:{platform.machine()}",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "numerics": flags, "argv": sys.argv[1:],
            "weights": "random (Qwen2Config with the real shapes)"}
    if args.decode_attention == "triton":
        from stagereplay.models import invariant_triton

        meta["triton_attention_configs"] = invariant_triton.CONFIGS
    meta["copy_TB_s"] = copy_rate(device, 0.05 if args.tiny else 4.0) / 1e12
    log(f"{meta['device']}: copy rate {meta['copy_TB_s']:.2f} TB/s; torch {meta['torch']}, transformers "
        f"{meta['transformers']}")
    RESULTS["meta"] = meta

    def save():
        (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        (out / "results.md").write_text(render(meta))

    for shape in args.shapes.split(","):
        for precision in args.precisions.split(","):
            model = None
            try:
                dt, model = timed(lambda: build_model(shape, precision, device))
                log(f"{shape} {precision}: built in {dt:.1f} s")
                if not args.only_projection:
                    RESULTS["decode"].append(decode_rates(model, shape, precision, args, meta["copy_TB_s"] * 1e12))
                    save()
                if shape == args.bridge_shape and not args.only_projection:
                    RESULTS["bridge"] += bridge_study(model, precision, args, EagerDecoder(model, ()), "eager")
                    max_len = args.bridge_prompt + args.bridge_stage + args.bridge_suffix + 8
                    regime = "cuda_graph" if device == "cuda" else "static"
                    RESULTS["bridge"] += bridge_study(model, precision, args, make_decoder(
                        model, (), regime, max_len=max_len), regime)
                    save()
                if shape == args.project_shape:
                    RESULTS["projection"].append(projection_measure(model, shape, precision, args))
                    save()
            except Exception as exc:  # keep measuring the other shapes; the error goes into the results
                traceback.print_exc()
                RESULTS["errors"].append(f"{shape} {precision}: {type(exc).__name__}: {exc}")
                save()
            del model
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    if RESULTS["projection"]:
        jobs = {"model_jobs": args.model_jobs, "job_overhead_s": args.job_overhead_s,
                "transplant_specs": args.transplant_specs, "minimal_budget": args.minimal_budget}
        RESULTS["projected"] = project(RESULTS["projection"], args.items, args.divergent, **jobs)
        RESULTS["projected_without_audit"] = project(RESULTS["projection"], args.items, args.divergent, audit=False)
        RESULTS["projected_bucketed"] = project(RESULTS["projection"], args.items, args.divergent, bucketed=True,
                                                **jobs)
        RESULTS["projected_bucketed_with_dumps"] = project(RESULTS["projection"], args.items, args.divergent,
                                                           bucketed=True, dumps="divergent")
    save()
    log(render(meta))


if __name__ == "__main__":
    main()
