"""The library for real work, timed in one run: a list of prompts replayed in one call (every construction, two
replicas: the call of issue 50 that took 148 s without output), then a series of transplants on the replay's kept
caches, against one transplant built from scratch (what every transplant cost before sessions). Prints the
times and the ratio of the series to the replay; the progress bars go to stderr.

Random weights of a real Qwen2.5 shape (:mod:`stagereplay.testing.shapes`), built from its ``Qwen2Config`` on the
CPU, with the character tokenizer of ``scripts/make_random_qwen.py`` (the random model's greedy ids are fillers
``~N``, so the stage is its first ``--stage-tokens`` tokens, marker ``~``): every number is a speed, never model
quality.

    PYTHONPATH=src python bench/library_session.py [--shape qwen2.5-0.5b] [--prompts 16] [--stage-tokens 8]
        [--new-tokens 8] [--transplants 10]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from pathlib import Path

import torch

import stagereplay
from stagereplay.testing.shapes import SHAPES


def build_tokenizer(vocab_size: int):
    """scripts/make_random_qwen.py's character tokenizer (a script, not a module of the package: loaded by path)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "make_random_qwen.py"
    spec = importlib.util.spec_from_file_location("make_random_qwen", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.build_tokenizer(vocab_size)


CONSTRUCTIONS = ("live", "incremental", "prefill", "chunked", "prefix_cached")


def random_model(shape: str, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(SHAPES[shape]["vocab_size"])
    cfg = Qwen2Config(**SHAPES[shape], eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=None, use_sliding_window=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval(), tokenizer


def questions(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.randint(10, 99)}+{rng.randint(10, 99)}-{rng.randint(10, 99)}" for _ in range(n)]


def timed(what: str, call):
    start = time.perf_counter()
    out = call()
    seconds = time.perf_counter() - start
    print(f"{what}: {seconds:.1f} s", flush=True)
    return out, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--stage-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--transplants", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model, tokenizer = random_model(args.shape, args.seed)
    n_layers = model.config.num_hidden_layers
    print(f"{args.shape} (random weights, fp32, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)"
          f" on the CPU, {torch.get_num_threads()} threads; {args.prompts} prompts, stage {args.stage_tokens} "
          f"tokens, suffix {args.new_tokens} tokens", flush=True)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False) for q in questions(args.prompts, args.seed)]
    stages, _ = timed("generate_stage, every prompt in one call", lambda: stagereplay.generate_stage(
        model, tokenizer, prompts, "~", occurrence=args.stage_tokens))
    result, t_replay = timed(f"replay of {len(CONSTRUCTIONS)} constructions x 2 replicas, every prompt in one call",
                             lambda: stagereplay.replay(model, tokenizer, prompts, stages, CONSTRUCTIONS,
                                                        max_new_tokens=args.new_tokens, replicas=2))
    print(repr(result))
    layer_sets = [[round(k * (n_layers - 1) / max(args.transplants - 1, 1))] for k in range(args.transplants)]

    def series():
        return [result.transplant("prefill", "live", layers=layers) for layers in layer_sets]

    swaps, t_series = timed(f"{args.transplants} transplants prefill->live on the replay's caches (single layers "
                            f"{[s[0] for s in layer_sets]})", series)
    print(f"outcomes of the first transplant: {[t.outcome for t in swaps[0]]}")
    print(f"ratio: {args.transplants} transplants / one replay = {t_series / t_replay:.2f} (the bar: under 3)",
          flush=True)
    _, t_fresh = timed("one transplant prefill->live from scratch (stagereplay.transplant)", lambda: (
        stagereplay.transplant(model, tokenizer, prompts, stages, "prefill", "live", layers=layer_sets[0],
                               max_new_tokens=args.new_tokens)))
    print(f"{args.transplants} transplants from scratch would take about {args.transplants * t_fresh / t_replay:.2f} "
          "replays")


if __name__ == "__main__":
    main()
