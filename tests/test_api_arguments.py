"""Every bad argument of the library is refused with a clear message before the model runs (a forward hook that
raises proves it did not), and the arguments that read as something else (a construction name, a layer index, a
list span) mean what they say. Sliding-window models: a run that would outgrow the window is refused up front."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import stagereplay
from stagereplay.models.loading import context_positions, sliding_window

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]


@pytest.fixture(scope="module")
def stage(fp32_model):
    """The model's own first 6 greedy ids from PROMPT (a marker that never comes: the whole budget)."""
    model, tokenizer = fp32_model
    with pytest.raises(stagereplay.StageNotGeneratedError, match=r"generated all 6 tokens of max_stage_tokens 6"):
        stagereplay.generate_stage(model, tokenizer, PROMPT, [9999], max_stage_tokens=6, progress=False)
    from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
    from stagereplay.decode.regimes import make_decoder

    [res] = decode_rows(make_decoder(model, ()), [PROMPT], matcher=BoundaryMatcher(1, token_ids=[-1]),
                        max_stage_tokens=6, max_new_tokens=1)
    return res.suffix_ids


@contextmanager
def model_never_runs(model):
    def refuse(*_):
        raise AssertionError("the model ran before the argument was refused")

    handle = model.register_forward_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("call, error, message", [
    (lambda m, t, s: stagereplay.replay(m, t, PROMPT, s, "live", max_new_tokens=0), ValueError,
     r"max_new_tokens is 0; it must be a whole number"),
    (lambda m, t, s: stagereplay.replay(m, t, PROMPT, s, ("live", "paged")), ValueError, r"unknown construction 'paged'"),
    (lambda m, t, s: stagereplay.replay(m, t, PROMPT, s, replicas=1.0), ValueError, r"replicas is 1.0"),
    (lambda m, t, s: stagereplay.replay(m, t, PROMPT, None), ValueError, r"stage is None"),
    (lambda m, t, s: stagereplay.replay(m, t, [PROMPT, PROMPT], s), ValueError, r"give one stage per prompt"),
    (lambda m, t, s: stagereplay.replay(m, t, [PROMPT, PROMPT], [s]), ValueError, r"2 prompts and 1 stages"),
    (lambda m, t, s: stagereplay.replay(m, t, [PROMPT, PROMPT], [s, s[:3]]), ValueError,
     r"stage 1 is the start of stage 0"),
    (lambda m, t, s: stagereplay.replay(m, t, [1.5, 2], s), TypeError, r"prompt must be text or .* holds 1.5"),
    (lambda m, t, s: stagereplay.replay(m, t, PROMPT, s, logits="yes"), TypeError, r"logits is 'yes'"),
    (lambda m, t, s: stagereplay.replay(None, t, PROMPT, s), TypeError, r"model is NoneType, not a loaded"),
    (lambda m, t, s: stagereplay.replay(m, None, PROMPT, s), TypeError, r"tokenizer is NoneType, not a tokenizer"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, "prefill", "prefill"), ValueError,
     r"donor and recipient are both 'prefill'"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, layers=[True]), TypeError, r"layers holds True"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, layers="1"), TypeError, r"layers is '1'"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, layers=[3]), ValueError, r"each of the model's 0..2"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, component="q"), ValueError, r"component must be one"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, positions=(0, 31.99)), TypeError, r"whole numbers"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, positions=(0.5, 3)), TypeError, r"whole numbers"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, positions=("0", "3")), TypeError, r"whole numbers"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, positions=(0, 99)), ValueError,
     r"the cache of prompt 0 holds 14 positions .* give 0 <= lo < hi <= 14"),
    (lambda m, t, s: stagereplay.transplant(m, t, PROMPT, s, positions="suffix"), ValueError, r"positions must be"),
    (lambda m, t, s: stagereplay.generate_stage(m, t, PROMPT, ""), ValueError, r"marker is empty"),
    (lambda m, t, s: stagereplay.generate_stage(m, t, PROMPT, []), ValueError, r"marker is empty"),
    (lambda m, t, s: stagereplay.generate_stage(m, t, PROMPT, ";", occurrence=0), ValueError, r"occurrence is 0"),
    (lambda m, t, s: stagereplay.generate_stage(m, t, PROMPT, ";", max_stage_tokens=250), ValueError,
     r"the prompt \(9 tokens\), max_stage_tokens \(250\) take 259 positions; the model has 256"),
])
def test_a_bad_argument_is_refused_before_the_model_runs(fp32_model, stage, call, error, message):
    model, tokenizer = fp32_model
    with model_never_runs(model), pytest.raises(error, match=message):
        call(model, tokenizer, stage)


def test_arguments_that_read_as_something_else_mean_what_they_say(fp32_model, stage):
    model, tokenizer = fp32_model
    one = stagereplay.replay(model, tokenizer, PROMPT, stage, "prefill", max_new_tokens=2, progress=False)
    assert list(one.continuations) == ["prefill"]  # one name is one construction, not its letters
    got = stagereplay.transplant(model, tokenizer, PROMPT, stage, "live", "prefill", layers=1, positions=[0, 4],
                                 max_new_tokens=2, progress=False)
    assert got.layers == [1] and got.positions == (0, 4)


def test_a_model_without_weights_is_refused(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir)).eval()
    with pytest.raises(ValueError, match="on the meta device"):
        stagereplay.replay(model, AutoTokenizer.from_pretrained(tiny_model_dir), PROMPT, [3, 4])


def test_generate_stage_on_the_toy_with_its_defaults_and_at_eos(fp32_model, stage):
    """The bundled toy (a context of 256) takes the default budget; a model that ends at EOS before the marker is
    told so, not to raise max_stage_tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import REPO

    toy = AutoModelForCausalLM.from_pretrained(REPO / "data/toy/primary", dtype=torch.float32)
    toy_tokenizer = AutoTokenizer.from_pretrained(REPO / "data/toy/primary")
    prompt = toy_tokenizer.apply_chat_template([{"role": "user", "content": "52-46+33+21"}],
                                               add_generation_prompt=True, tokenize=False)
    ids = stagereplay.generate_stage(toy, toy_tokenizer, prompt, ";", occurrence=2, progress=False)
    assert toy_tokenizer.decode(ids).count(";") == 2 and toy_tokenizer.decode(ids).endswith(";")
    two = stagereplay.generate_stage(toy, toy_tokenizer, [prompt, prompt], ";", progress=False)
    assert two[0] == two[1] and ids[:len(two[0])] == two[0]
    model, tokenizer = fp32_model
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = stage[2]
    try:
        with pytest.raises(stagereplay.StageNotGeneratedError, match=r"ended its generation \(EOS id .*a larger "
                                                                     r"budget would not help"):
            stagereplay.generate_stage(model, tokenizer, PROMPT, [9999], max_stage_tokens=6, progress=False)
    finally:
        model.generation_config.eos_token_id = saved


def mistral(window: int):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=256, sliding_window=window)).eval()


def test_a_sliding_window_is_a_limit_on_a_run_checked_up_front(fp32_model):
    """Mistral's config sets ``sliding_window`` alone (no ``use_sliding_window``): within the window the run is full
    attention and goes through; past it, it is refused before it starts instead of failing deep ("its cache holds
    11 positions, not 15")."""
    from transformers import MistralConfig, Qwen2Config

    assert sliding_window(MistralConfig()) == context_positions(MistralConfig()) == 4096  # Mistral-7B-v0.1
    assert sliding_window(Qwen2Config(sliding_window=64)) is None  # use_sliding_window off
    assert context_positions(Qwen2Config(use_sliding_window=True, sliding_window=64)) == 64
    _, tokenizer = fp32_model
    prompt, stage = [1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12]  # 8 + 8 + 8 new: 24 positions
    for window in (24, 4096):
        got = stagereplay.replay(mistral(window), tokenizer, prompt, stage, ("prefill", "incremental"),
                                 max_new_tokens=8, progress=False)
        assert len(got.continuations["prefill"].suffix_ids) == 8
    model = mistral(12)
    with model_never_runs(model), pytest.raises(ValueError, match=r"take 24 positions; the model's sliding window "
                                                                  r"is 12 positions"):
        stagereplay.replay(model, tokenizer, prompt, stage, ("prefill", "incremental"), max_new_tokens=8)


def test_the_pipeline_measures_prompts_against_a_sliding_window(tmp_path):
    """reconstruct_prefixes (and the preflight, through the same limit) refuses a prompt whose budgets outgrow a
    Mistral model's window, naming the item, before any batch is decoded."""
    from transformers import MistralConfig, MistralForCausalLM

    from stagereplay.data.prompts import PromptTooLongError
    from stagereplay.data.toy import build_tokenizer
    from stagereplay.stages.reconstruct import reconstruct_prefixes
    from stagereplay.stages.select import select_items
    from stagereplay.stages.settings import ReconstructSettings, from_params

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256, sliding_window=24, eos_token_id=1,
                                             pad_token_id=0, bos_token_id=None))
    model.save_pretrained(tmp_path / "mistral")
    tokenizer.save_pretrained(tmp_path / "mistral")
    items = tmp_path / "items.parquet"
    select_items({"source": "synthetic", "size": 50, "seed": 0}, 2, 0, str(items))
    params = dict(model=str(tmp_path / "mistral"), revision="local", precision="fp32", boundary={"marker": ";"},
                  max_stage_tokens=8, max_new_tokens=8, device="cpu", progress=False, bridge={"n_rows": 0, "seed": 0})
    out = [str(tmp_path / name) for name in ("l.parquet", "p.parquet", "b.parquet")]
    with pytest.raises(PromptTooLongError, match=r"max_new_tokens 8 exceeds the model's context of 24"):
        reconstruct_prefixes(str(items), *out, from_params(ReconstructSettings, params))
