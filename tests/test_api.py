"""The library API on a tiny random Qwen2 loaded as a user loads one (CPU, seconds): it is the pipeline's recipe,
bit for bit, and ``import stagereplay`` stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import stagereplay
from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.decode.plans import Batch
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments.matched import fixed_prefix
from stagereplay.experiments.rows import RunSettings

from conftest import REPO

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
N_NEW = 10


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def user_model(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[request.param]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    return request.param, model, AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def stage(user_model):
    """The model's own first 8 greedy ids from PROMPT (the random model writes no marker: a boundary never found)."""
    _, model, _ = user_model
    [res] = decode_rows(make_decoder(model, ()), [PROMPT], matcher=BoundaryMatcher(1, token_ids=[-1]),
                        max_stage_tokens=8, max_new_tokens=1)
    assert res.stop_reason == "boundary_missing" and len(res.suffix_ids) == 8
    return res.suffix_ids


def test_import_stagereplay_imports_no_torch_until_a_function_is_used():
    code = ("import sys, stagereplay\n"
            "heavy = [m for m in ('torch', 'transformers', 'pandas', 'numpy', 'pyarrow') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert {'replay', 'transplant', 'generate_stage', 'Replay'} <= set(dir(stagereplay))\n"
            "assert callable(stagereplay.replay) and 'torch' in sys.modules\n"
            "try:\n    stagereplay.nothing\nexcept AttributeError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "has no attribute 'nothing'" in proc.stdout


def test_generate_stage_is_the_live_generation_to_its_marker(user_model, stage):
    _, model, tokenizer = user_model
    marker = stage[-1]  # its last appearance in the stage ends the stage
    got = stagereplay.generate_stage(model, tokenizer, PROMPT, marker, occurrence=stage.count(marker),
                                     max_stage_tokens=8)
    assert got == stage
    with pytest.raises(stagereplay.StageNotGeneratedError, match="without completing appearance 9"):
        stagereplay.generate_stage(model, tokenizer, PROMPT, marker, occurrence=9, max_stage_tokens=8)


def test_replay_is_the_recipe_the_ledger_records(user_model, stage):
    """Every construction's continuation, margins and K/V fingerprints are the fixed-prefix ledger rows' own; live
    equals its token-by-token rebuild (the bridge); replicas are bit-exact."""
    precision, model, tokenizer = user_model
    names = ("live", "prefill", "incremental", "chunked", "prefix_cached")
    got = stagereplay.replay(model, tokenizer, PROMPT, stage, names, max_new_tokens=N_NEW, replicas=2, chunk_size=3)
    assert list(got.continuations) == list(names) and got.precision == precision
    assert got.prompt_ids == PROMPT and got.stage_ids == stage
    rows = fixed_prefix(make_decoder(model, (1,)), Batch(None, ({"item_index": 0, "item_id": "x", "gold_answer": "1"},)),
                        [PROMPT], [stage], RunSettings("r", precision, None, N_NEW, chunk_size=3), tokenizer,
                        pair=names[1:], replicas=(1,))
    for row in rows:
        c = got.continuations[row["construction"]]
        assert (c.suffix_ids, c.suffix_text, c.margins, c.stop_reason, c.cache_fingerprint, c.cache_k_fingerprints,
                c.cache_v_fingerprints, c.suffix_fingerprint) == (
            row["suffix_ids"], row["suffix_text"], row["margins"], row["stop_reason"], row["cache_fingerprint"],
            row["cache_k_fingerprints"], row["cache_v_fingerprints"], row["suffix_fingerprint"])
    live = got.continuations["live"]
    assert (live.cache_fingerprint, live.suffix_ids) == (got.continuations["incremental"].cache_fingerprint,
                                                         got.continuations["incremental"].suffix_ids)
    assert all(c.replicas == 2 and c.replicas_exact and c.replica_difference is None
               for c in got.continuations.values())
    assert len(live.cache_k_fingerprints) == model.config.num_hidden_layers == got.provenance["num_layers"]
    assert got.provenance["decode_regime"] == "eager" and got.provenance["numerics"]["deterministic_algorithms"]
    assert got.first_divergence("live", "incremental") is None


def test_replay_takes_text_and_refuses_what_it_cannot_run(user_model, stage):
    precision, model, tokenizer = user_model
    text = tokenizer.decode(PROMPT)
    assert stagereplay.replay(model, tokenizer, text, torch.tensor(stage), ("prefill",),
                              max_new_tokens=2).prompt_ids == tokenizer(text)["input_ids"]
    other = [stage[0]] + [(stage[1] + 1) % len(tokenizer)] + stage[2:]
    with pytest.raises(stagereplay.StageNotGeneratedError, match="at its token 1 of 8"):
        stagereplay.replay(model, tokenizer, PROMPT, other, max_new_tokens=2)
    assert stagereplay.replay(model, tokenizer, PROMPT, other, ("incremental", "prefill"), max_new_tokens=2)
    wrong = "fp32" if precision == "bf16" else "bf16"
    with pytest.raises(ValueError, match=f"precision '{wrong}' was asked for"):
        stagereplay.replay(model, tokenizer, PROMPT, stage, precision=wrong)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        stagereplay.replay(model, tokenizer, PROMPT, [10_000])
    with pytest.raises(ValueError, match="unknown construction"):
        stagereplay.replay(model, tokenizer, PROMPT, stage, ("paged",))
    with pytest.raises(ValueError, match="take 1009 positions; the model has 256"):
        stagereplay.replay(model, tokenizer, PROMPT, stage, max_new_tokens=992)
    model.train()
    try:
        with pytest.raises(ValueError, match="model.eval()"):
            stagereplay.replay(model, tokenizer, PROMPT, stage)
    finally:
        model.eval()


def test_the_determinism_flags_hold_for_the_call_only(user_model, stage):
    _, model, tokenizer = user_model
    torch.use_deterministic_algorithms(False)
    try:
        got = stagereplay.replay(model, tokenizer, PROMPT, stage, ("prefill",), max_new_tokens=2)
        assert got.provenance["numerics"]["deterministic_algorithms"]
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(True)


@pytest.mark.parametrize("donor, recipient", [("prefill", "live"), ("live", "prefill")])
def test_an_all_layer_transplant_follows_its_donor(user_model, stage, donor, recipient):
    """Its outcome says ``agree`` where donor and recipient continue alike (every fp32 one here), else ``donor``."""
    _, model, tokenizer = user_model
    got = stagereplay.transplant(model, tokenizer, PROMPT, stage, donor, recipient, max_new_tokens=N_NEW)
    assert got.outcome == ("donor" if got.divergent else "agree") and got.live_fingerprint_match in (None, True)
    assert (got.donor, got.recipient, got.continuation.construction) == (donor, recipient, f"{donor}->{recipient}")
    assert got.continuation.suffix_ids == got.donor_continuation.suffix_ids
    assert got.continuation.cache_fingerprint == got.donor_continuation.cache_fingerprint
    assert got.layers == list(range(model.config.num_hidden_layers))
    own = stagereplay.replay(model, tokenizer, PROMPT, stage, ("live", "prefill"), max_new_tokens=N_NEW)
    assert got.divergent == (own.first_divergence(donor, recipient) is not None)
    assert got.donor_continuation.suffix_ids == own.continuations[donor].suffix_ids


def test_a_partial_transplant_writes_only_its_layers(user_model, stage):
    _, model, tokenizer = user_model
    got = stagereplay.transplant(model, tokenizer, PROMPT, stage, "prefill", "live", layers=[1], component="k",
                                 positions="stage", max_new_tokens=N_NEW)
    ks, recipient = got.continuation.cache_k_fingerprints, got.recipient_continuation
    assert got.continuation.cache_v_fingerprints == recipient.cache_v_fingerprints
    assert [k for i, k in enumerate(ks) if i != 1] == [k for i, k in enumerate(recipient.cache_k_fingerprints)
                                                       if i != 1]
    assert got.outcome in ("agree", "donor", "recipient", "neither") and got.layers == [1]
    with pytest.raises(ValueError, match="each of the model's 0..2"):
        stagereplay.transplant(model, tokenizer, PROMPT, stage, layers=[3])
    with pytest.raises(ValueError, match="component must be one of"):
        stagereplay.transplant(model, tokenizer, PROMPT, stage, component="q")
