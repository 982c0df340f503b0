"""Decode rates at batch 1 and batched: ``model.generate`` against the package's greedy loop in the eager and
CUDA-graph regimes (the loop's own host work included, and a device loop without it), and the batch control
(replicas of one batch plan, and rows against batch 1). ``bench/benchmark.py``'s first section.
"""

from __future__ import annotations

import time

import torch

from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import decode_rows
from stagereplay.decode.plans import batch_plan
from stagereplay.decode.static import StaticDecoder
from stagereplay.experiments import constructions
from stagereplay.io.ids import first_divergence

from batch_invariance import StageOfLength, batch_invariance, live_rows
from random_models import log, prompts_for, sync, timed, weight_bytes


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
