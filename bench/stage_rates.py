"""The rates the projection prices (``stagereplay.projection.rates``): a reduced run of every stage at paper-scale
lengths on one random-weight model, at one batch size for every precision: batched decode steps timed at a few
attended spans and fitted as a + b * span, a batched one-shot prefill, a boundary cache dumped to disk and read
back, and the GEMM rate of the linear maps. ``bench/benchmark.py --only-projection`` writes them as its
``projection`` list.
"""

from __future__ import annotations

import gc
import os
import tempfile

import torch

from stagereplay.decode.fused import fuse_layer
from stagereplay.decode.static import StaticDecoder
from stagereplay.models.loading import PRECISIONS

from bucketed import BucketedDecoder
from random_models import log, prompts_for, timed


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
    out.update(decode_step_rates(model, shape, precision, args, rows, max_len))
    prefill, pdec, pcache = prefill_rate(model, shape, precision, args, rows)
    out.update(prefill)
    layers = pdec.row_layers(pcache, 0, pcache.length)  # row 0's boundary cache, as views of the buffer
    out.update(dump_rates(model, shape, precision, args, layers))
    del pdec, pcache, layers
    out.update(gemm_rates(model, rows))
    log(f"  projection {shape} {precision}: linear maps at {rows} rows {out['gemm_TFLOP_s_rows']:.1f} TFLOP/s, at "
        f"{out['gemm_large_rows']} rows {out['gemm_TFLOP_s_large']:.1f} TFLOP/s")
    return out


def decode_step_rates(model, shape, precision, args, rows: int, max_len: int) -> dict:
    """Batched decode steps of ``rows`` rows timed at a few attended spans and fitted as a + b * span; the
    decoder's graphs and buffer are freed before it returns."""
    regime = "cuda_graph" if torch.cuda.is_available() else "static"
    triton_attention = args.decode_attention == "triton"
    # the triton attention reads each row's keys up to its position: its "bucket" is one position
    bucket = 1 if triton_attention else args.proj_bucket
    dec = BucketedDecoder(model, (), max_len=max_len, max_rows=rows, regime=regime,
                          bucket=None if triton_attention else bucket, attention=args.decode_attention,
                          kernels=args.decode_kernels)
    out = {"decode_attention": args.decode_attention, "decode_kernels": args.decode_kernels}
    prompts = prompts_for(rows, 16, model.config.vocab_size, 7)
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
    return out


def prefill_rate(model, shape, precision, args, rows: int) -> tuple[dict, StaticDecoder, object]:
    """One-shot prefill of boundary prefixes (P + S - 1 tokens), a few rows at once: its tokens/s, and the
    decoder and batch it leaves (their row 0 is the boundary cache the dump measures)."""
    P, S = args.proj_prompt, args.proj_stage
    prows = min(args.proj_prefill_rows, rows)
    pdec = StaticDecoder(model, (), max_len=P + S + 8, max_rows=prows, regime="static", kernels=args.decode_kernels)
    pp = prompts_for(prows, P + S - 1, model.config.vocab_size, 8)
    dt, _ = timed(lambda: pdec.open(pp))  # the rows, left-padded, in one forward
    dt, (pcache, _) = timed(lambda: pdec.open(pp))
    out = {"prefill_tokens_s": prows * (P + S - 1) / dt}
    log(f"  projection {shape} {precision}: prefill {prows} x {P + S - 1} tokens in {dt:.2f} s "
        f"({out['prefill_tokens_s']:.0f} tok/s)")
    return out, pdec, pcache


def dump_rates(model, shape, precision, args, layers) -> dict:
    """One boundary cache (``layers``: each layer's keys and values) dumped to disk and read back, as a
    transplant's donor is, against the disk's own write rate for the same bytes."""
    from safetensors.torch import load_file, save_file

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
    out = dict(dump_GB=size / 1e9, dump_GB_s=size / 1e9 / dt_dump, load_GB_s=size / 1e9 / dt_load,
               dump_roundtrip_exact=bool(same), disk_write_GB_s=len(raw) / 1e9 / dt_raw)
    log(f"  projection {shape} {precision}: cache dump {size / 1e9:.2f} GB at {out['dump_GB_s']:.2f} GB/s "
        f"(disk alone {out['disk_write_GB_s']:.2f} GB/s), load at {out['load_GB_s']:.2f} GB/s, exact {same}")
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
