"""The suffix-only schedule: in a static batch of several rows a built construction continues each row from its own
boundary (rows stepping together, each at its own position) and gives every row the bytes the lockstep live
schedule gives it: token ids, margins as float32 bytes, boundary-cache fingerprints and bytes, layout, transplant
edits. The control shows that the comparison can fail: the same rows in another layout (each alone) differ in fp32.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from stagereplay.decode.greedy import decode_rows
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments import constructions

ROWS = 5


def batch(vocab, rows=ROWS, seed=3):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 20))] for _ in range(rows)]
    stages = [None if r == 2 else [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 15))] for r in range(rows)]
    return prompts, stages


def raw(t) -> bytes:
    import torch

    return t.contiguous().view(torch.uint8).numpy().tobytes()


def record(res):
    layers = None if res.layers is None else [(raw(k), raw(v)) for k, v in res.layers]
    return (res.stage_ids, res.suffix_ids, np.asarray(res.margins, "<f4").tobytes(), res.stop_reason, res.pad,
            res.position, res.fingerprints, layers)


class Steps:
    """Counts the one-token steps the loop feeds."""

    def __init__(self, decoder):
        self.inner, self.count = decoder, 0

    def step(self, batch, tokens):
        self.count += 1
        return self.inner.step(batch, tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def both(decoder, prompts, stages, name, **kw):
    out = {}
    for schedule in ("lockstep", "suffix"):
        decoder.suffix_schedule = schedule == "suffix"
        counted = Steps(decoder)
        res = decode_rows(counted, prompts, stages=stages, build=constructions.get(name).cache_build(3), **kw)
        out[schedule] = ([record(r) for r in res], counted.count)
    decoder.suffix_schedule = True
    return out


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def loaded(request, loaded_fp32, loaded_bf16):
    return {"fp32": loaded_fp32, "bf16": loaded_bf16}[request.param]


@pytest.mark.parametrize("name", ["prefill", "chunked", "prefix_cached"])
def test_built_rows_from_their_boundaries_are_the_lockstep_rows(loaded, name):
    model = loaded.model
    prompts, stages = batch(model.config.vocab_size)
    decoder = make_decoder(model, (), "static", max_len=64, max_rows=ROWS)
    keep = {r for r, s in enumerate(stages) if s is not None}
    got = both(decoder, prompts, stages, name, max_new_tokens=8, keep=keep)
    assert got["suffix"][0] == got["lockstep"][0]
    lengths = [len(s) for s in stages if s is not None]
    # by construction: the suffix schedule feeds the pending tokens, then 7 more steps; lockstep feeds the stage
    # steps from the batch's first boundary on as well
    assert got["suffix"][1] == 8 and got["lockstep"][1] == 8 + max(lengths) - min(lengths)
    assert len({r[5] for r in got["suffix"][0] if r[5] is not None}) > 1  # rows at their own positions


def test_eos_a_transplant_and_no_suffix_are_the_same_in_both_schedules(loaded_fp32):
    model = loaded_fp32.model
    prompts, stages = batch(model.config.vocab_size, seed=5)
    probe = make_decoder(model, (), "static", max_len=64, max_rows=ROWS)
    plain = decode_rows(probe, prompts, stages=stages, build=constructions.get("prefill").cache_build(3),
                        max_new_tokens=8)
    eos = plain[0].suffix_ids[3]  # ends row 0 (and any row that chooses it) early
    decoder = make_decoder(model, (eos,), "static", max_len=64, max_rows=ROWS)
    keep = {r for r, s in enumerate(stages) if s is not None}
    donor = decode_rows(decoder, prompts, stages=stages, build=constructions.get("incremental").cache_build(3),
                        max_new_tokens=8, keep=keep)

    def edit(r, layers):
        for i in range(decoder.n_layers // 2 + 1):
            layers[i][0].copy_(donor[r].layers[i][0])

    moved = both(decoder, prompts, stages, "prefill", max_new_tokens=8, edit=edit)
    assert moved["suffix"][0] == moved["lockstep"][0]
    assert moved["suffix"][0][0][3] == "eos"
    none = both(decoder, prompts, stages, "chunked", max_new_tokens=0, keep=keep)
    assert none["suffix"][0] == none["lockstep"][0]
    assert all(r[1] == [] for r in none["suffix"][0])


def test_the_control_a_row_alone_has_other_bits_in_fp32(loaded_fp32):
    """The comparison can fail: the same built row continued in a batch of its own (another layout) gives other
    float32 margins on the CPU than in its batch of several rows."""
    model = loaded_fp32.model
    prompts, stages = batch(model.config.vocab_size)
    decoder = make_decoder(model, (), "static", max_len=64, max_rows=ROWS)
    build = constructions.get("prefill").cache_build(3)
    together = decode_rows(decoder, prompts, stages=stages, build=build, max_new_tokens=8)
    alone = [decode_rows(decoder, [prompts[r]], stages=[stages[r]], build=build, max_new_tokens=8)[0]
             for r in (0, 1)]
    assert any(record(a)[2] != record(together[r])[2] for r, a in zip((0, 1), alone))


def test_the_live_schedules_own_construction_stays_in_lockstep(loaded_fp32):
    """incremental is the live schedule's own cache: a multi-row build of one-token segments would run one row at
    a time (another shape), so it is still made by the schedule, whatever the decoder offers."""
    model = loaded_fp32.model
    prompts, stages = batch(model.config.vocab_size)
    decoder = make_decoder(model, (), "static", max_len=64, max_rows=ROWS)
    got = both(decoder, prompts, stages, "incremental", max_new_tokens=4)
    lengths = [len(s) for s in stages if s is not None]
    assert got["suffix"] == got["lockstep"] and got["suffix"][1] == max(lengths) + 4 - 1


def test_the_benchmark_proves_the_cpu_combinations(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, str(repo / "bench/suffix_schedule.py"), "--precision", "fp32",
                           "--rows", "4", "--suffix", "6", "--json", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    combo = json.loads(out.read_text())["combinations"]["fp32/static/masked/library/default"]
    assert combo["differs"] == [] and combo["control"]["differs"] > 0
