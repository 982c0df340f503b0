"""Which items of the default selection split between live and prefill on the embedded toy, on this machine.

The toy's bf16 split comes from the CPU kernels (a one-token decode step and a one-shot prefill reduce in different
orders), and those depend on the CPU: with an earlier toy the same torch build found items 63 and 99 of the default
selection divergent on one machine and 69, 114 and 152 (not 63 or 99) on another with AMX tile instructions. Tests
that need divergent items ask here instead of naming them: the items are found by the package's own recipe with
the workflow's settings, the known ones tried first, and the answer is kept for the test process.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = yaml.safe_load((REPO / "config.yaml").read_text())
DEFAULT_BOUNDARY = DEFAULT_CONFIG["boundary"]  # where toy_items cuts: a test that rebuilds its items cuts there too
KNOWN = (15, 18, 22, 23, 38)  # divergent early in the suffix on an AMX machine (2026-12-01), tried first


@functools.lru_cache(maxsize=None)
def toy_items(max_new_tokens: int, want: int = 2) -> tuple[tuple[int, ...], int]:
    """``want`` item indexes of the default selection whose bf16 live and prefill suffixes differ within
    ``max_new_tokens`` (the default config's boundary and stage budget, one thread, eager regime, batch 1), and
    one whose do not. Fails the test, naming the machine's kernels, if no item of the selection splits."""
    import pytest
    import torch

    from stagereplay.data.datasets import choose_items, load_synthetic
    from stagereplay.data.prompts import Prompter
    from stagereplay.decode.greedy import matcher_from_config
    from stagereplay.decode.regimes import make_decoder
    from stagereplay.experiments.recipe import run
    from stagereplay.experiments.rows import RunSettings
    from stagereplay.models.loading import eos_token_ids, load_model, set_determinism
    from stagereplay.models.sources import resolve_source

    cfg = DEFAULT_CONFIG
    ds = cfg["dataset"]
    selection = choose_items(load_synthetic(int(ds["size"]), int(ds["seed"])), int(cfg["n_items"]), int(cfg["seed"]))
    questions = dict(zip(selection["item_index"], selection["question"]))
    threads = torch.get_num_threads()
    set_determinism(int(cfg["threads"]))
    try:
        loaded = load_model(resolve_source(str(REPO / cfg["model"]), cfg["revisions"][0]), "bf16", "cpu",
                            cfg["attn_implementation"])
        decoder = make_decoder(loaded.model, tuple(eos_token_ids(loaded)), "eager")
        prompter, matcher = Prompter(loaded.tokenizer), matcher_from_config(DEFAULT_BOUNDARY, loaded.tokenizer)
        settings = RunSettings("primary", "bf16", int(cfg["max_stage_tokens"]), max_new_tokens)
        divergent, agreeing = [], None
        order = list(KNOWN) + [i for i in sorted(questions) if i not in KNOWN]
        for index in order:
            prompt = prompter(questions[index])
            live = run(decoder, "live", [prompt], settings, matcher=matcher)[0]
            if not live.stage_ids:
                continue
            prefill = run(decoder, "prefill", [prompt], settings, stages=[live.stage_ids])[0]
            if prefill.suffix_ids != live.suffix_ids:
                divergent.append(int(index))
            elif agreeing is None:
                agreeing = int(index)
            if len(divergent) >= want and agreeing is not None:
                break
    finally:
        torch.set_num_threads(threads)
    if len(divergent) < want or agreeing is None:
        pytest.fail(f"{len(divergent)} items of the default selection (fewer than {want}), or none agreeing, split between live and prefill in bf16 within "
                    f"{max_new_tokens} tokens on this machine (torch {torch.__version__}, CPU capability "
                    f"{torch.backends.cpu.get_cpu_capability()}): the toy's split depends on the CPU's bf16 kernels")
    return tuple(divergent[:want]), agreeing
