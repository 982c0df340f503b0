"""The library for real work, on a tiny random fp32 Qwen2 (CPU, seconds): a list of prompts replayed in one decode
per construction over a recorded batch plan, bit for bit what each prompt gives alone; a replay's kept caches reused
by a series of transplants (one decode each); per-step logits, KL and cache tensors on request; documented fields,
short reprs, a progress bar."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import stagereplay
from stagereplay.api import progress as progress_module
from stagereplay.api import session as session_module
from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.decode.regimes import make_decoder
from stagereplay.io.fingerprints import fingerprint_layers

PROMPTS = [[19, 18, 7, 11, 14, 8, 9, 16, 2], [4, 12, 17, 3, 9], [8, 8, 11, 6, 15, 10, 2]]
N_NEW = 4
NAMES = ("live", "incremental", "prefill")


@pytest.fixture(scope="module")
def stages(fp32_model):
    """Each prompt's own first 6 greedy ids (the random model writes no marker)."""
    model, _ = fp32_model
    results = decode_rows(make_decoder(model, ()), PROMPTS, matcher=BoundaryMatcher(1, token_ids=[-1]),
                          max_stage_tokens=6, max_new_tokens=1)
    return [res.suffix_ids for res in results]


@pytest.fixture
def decodes(monkeypatch):
    """The recipe's decodes and transplants a library call runs, counted."""
    calls = []
    run, rows = session_module.run, session_module.transplant_rows

    def counted_run(decoder, construction, prompts, *args, **kwargs):
        calls.append((construction, len(prompts)))
        return run(decoder, construction, prompts, *args, **kwargs)

    def counted_rows(decoder, prompts, *args, **kwargs):
        calls.append(("transplant", len(prompts)))
        return rows(decoder, prompts, *args, **kwargs)

    monkeypatch.setattr(session_module, "run", counted_run)
    monkeypatch.setattr(session_module, "transplant_rows", counted_rows)
    return calls


def test_a_list_of_prompts_is_one_decode_per_construction_and_each_prompt_alone(fp32_model, stages, decodes):
    model, tokenizer = fp32_model
    batch = stagereplay.replay(model, tokenizer, PROMPTS, stages, NAMES, max_new_tokens=N_NEW, progress=False)
    assert decodes == [(name, len(PROMPTS)) for name in NAMES]
    assert isinstance(batch, stagereplay.ReplayBatch) and len(batch) == len(PROMPTS)
    plan = batch.provenance["batch_plan"]
    assert plan["batch_size"] == 3 and sorted(plan["batches"][0]) == ["0", "1", "2"]
    for i, (prompt, stage) in enumerate(zip(PROMPTS, stages)):
        alone = stagereplay.replay(model, tokenizer, prompt, stage, NAMES, max_new_tokens=N_NEW, progress=False)
        assert batch[i].prompt_index == i and batch[i].prompt_ids == prompt and batch[i].stage_ids == stage
        assert batch[i].continuations == alone.continuations  # ids, margins, every fingerprint
    tensor = stagereplay.replay(model, tokenizer, torch.tensor([PROMPTS[0], PROMPTS[0]]), [stages[0], stages[0]],
                                "prefill", max_new_tokens=N_NEW, batch_size=1, progress=False)
    assert tensor.provenance["batch_plan"] is None and len(tensor) == 2  # two batches of one row
    assert tensor[0].continuations == tensor[1].continuations == {"prefill": batch[0].continuations["prefill"]}


def test_a_series_of_transplants_reuses_the_replay_caches(fp32_model, stages, decodes):
    model, tokenizer = fp32_model
    batch = stagereplay.replay(model, tokenizer, PROMPTS, stages, NAMES, max_new_tokens=N_NEW, progress=False)
    decodes.clear()
    swaps = [batch.transplant("prefill", "live", layers=layer) for layer in range(model.config.num_hidden_layers)]
    assert decodes == [("transplant", len(PROMPTS))] * model.config.num_hidden_layers  # nothing built again
    one = batch[1].transplant("live", "prefill", layers=[0, 2], component="v", positions=[0, 3])
    assert decodes[-1] == ("transplant", len(PROMPTS)) and one.prompt_index == 1 and one.positions == (0, 3)
    decodes.clear()
    fresh = stagereplay.transplant(model, tokenizer, PROMPTS[1], stages[1], "live", "prefill", layers=[0, 2],
                                   component="v", positions=(0, 3), max_new_tokens=N_NEW, progress=False)
    assert [name for name, _ in decodes] == ["live", "incremental", "prefill", "transplant"]  # built from scratch
    assert dataclasses.replace(one, provenance={}, prompt_index=0) == dataclasses.replace(fresh, provenance={})
    for per_prompt in swaps:
        assert [t.prompt_index for t in per_prompt] == [0, 1, 2]
        assert all(t.outcome in ("agree", "donor", "recipient", "neither") for t in per_prompt)
    whole = batch.transplant("prefill", "live")
    for t, replayed in zip(whole, batch):
        assert t.continuation.suffix_ids == replayed.continuations["prefill"].suffix_ids
        assert t.outcome == ("donor" if replayed.first_divergence("prefill", "live") is not None else "agree")


def test_logits_kl_and_cache_tensors_on_request(fp32_model, stages):
    model, tokenizer = fp32_model
    got = stagereplay.replay(model, tokenizer, PROMPTS[0], stages[0], NAMES, max_new_tokens=N_NEW, logits=True,
                             caches=True, progress=False)
    for c in got.continuations.values():
        assert c.logits.dtype == torch.float32 and c.logits.shape == (len(c.suffix_ids), model.config.vocab_size)
        assert torch.argmax(c.logits, dim=-1).tolist() == c.suffix_ids
        top = torch.topk(c.logits, 2, dim=-1).values
        assert (top[:, 0] - top[:, 1]).tolist() == c.margins
        assert fingerprint_layers(c.cache)[0] == c.cache_fingerprint  # the very bytes the continuation read
        assert c.cache[0][0].shape[2] == len(PROMPTS[0]) + len(stages[0]) - 1
    assert got.kl("live", "incremental") == [0.0] * N_NEW  # the bridge: bit-exact logits
    kl = got.kl("live", "prefill")
    split = got.first_divergence("live", "prefill")
    assert len(kl) == (N_NEW if split is None else split + 1) and all(v >= 0 for v in kl)
    plain = stagereplay.replay(model, tokenizer, PROMPTS[0], stages[0], ("prefill",), max_new_tokens=N_NEW,
                               progress=False)
    assert plain.continuations["prefill"].logits is None and plain.continuations["prefill"].cache is None
    assert plain.continuations["prefill"] == got.continuations["prefill"]  # the same decode, logits aside
    with pytest.raises(ValueError, match=r"logits=True"):
        plain.kl("prefill", "prefill")


def test_every_result_field_is_documented_and_reprs_are_short(fp32_model, stages):
    for cls in (stagereplay.Continuation, stagereplay.Replay, stagereplay.ReplayBatch, stagereplay.Transplant):
        for f in dataclasses.fields(cls):
            assert re.search(rf"^\s+{f.name}: \S", cls.__doc__, re.M), (cls.__name__, f.name)
    model, tokenizer = fp32_model
    batch = stagereplay.replay(model, tokenizer, PROMPTS[:2], stages[:2], NAMES, max_new_tokens=N_NEW, replicas=2,
                               progress=False)
    swap = batch[0].transplant("prefill", "live")
    for thing in (batch, batch[0], batch[0].continuations["live"], swap):
        text = repr(thing)
        assert len(text) < 200 and not re.search(r"[0-9a-f]{40}", text), text
    assert "2 replicas exact" in repr(batch[0].continuations["live"])
    assert repr(swap).endswith(f"all layers, kv, positions all: {swap.outcome})")


def test_a_long_call_shows_a_progress_bar(fp32_model, stages, capsys, monkeypatch):
    model, tokenizer = fp32_model
    monkeypatch.setattr(progress_module, "DELAY", 0.0)
    stagereplay.replay(model, tokenizer, PROMPTS, stages, ("prefill",), max_new_tokens=N_NEW)
    assert re.search(r"replay of 3 prompt\(s\): 100%.*1/1", capsys.readouterr().err)
    stagereplay.replay(model, tokenizer, PROMPTS, stages, ("prefill",), max_new_tokens=N_NEW, progress=False)
    assert capsys.readouterr().err == ""
