"""stagereplay.testing.gguf: the file it writes loads with transformers' own GGUF loader (no stagereplay code in
between) as a model of the shape asked for, its tensors in the ggml types asked for."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stagereplay.testing.gguf import byte_level_vocabulary, write_gguf
from stagereplay.testing.shapes import SHAPES

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "max_position_embeddings", "vocab_size", "tie_word_embeddings")


def transformers_load(path):
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def tensor_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_a_named_shape_loads_with_that_shape_and_its_types(tmp_path):
    path = tmp_path / "tiny.gguf"
    written = write_gguf(path, "tiny", vocabulary=byte_level_vocabulary(512), quant="Q8_0")
    model, tokenizer = transformers_load(path)
    assert {k: getattr(model.config, k) for k in CONFIG_KEYS} == {k: SHAPES["tiny"][k] for k in CONFIG_KEYS}
    assert model.config.rope_parameters["rope_theta"] == SHAPES["tiny"]["rope_theta"]
    assert np.float32(model.config.rms_norm_eps) == np.float32(SHAPES["tiny"]["rms_norm_eps"])  # a GGUF float32
    assert len(tokenizer) == 512 and tokenizer.eos_token == "<|im_end|>"
    assert written.model is None and written.parameters == sum(p.numel() for p in model.parameters())
    types = tensor_types(path)
    assert types["output.weight"] == types["blk.1.ffn_down.weight"] == "Q8_0"  # the shape's untied embeddings
    assert types["blk.0.attn_q.bias"] == types["output_norm.weight"] == "F32"
    assert written.tensor_types == {"Q8_0": 2 + 7 * 2, "F32": 1 + 5 * 2}  # embedding, output; 7 matrices a layer


def test_from_model_writes_the_models_own_values(tmp_path):
    """F32 tensors: what transformers loads is the returned model, tensor for tensor, byte for byte."""
    path = tmp_path / "m.gguf"
    shape = dict(SHAPES["tiny"], num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    written = write_gguf(path, shape, vocabulary=byte_level_vocabulary(300), seed=3, from_model=True)
    loaded, _ = transformers_load(path)
    ours, theirs = written.model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and written.model.config.vocab_size == 300
    assert [k for k in ours if ours[k].numpy().tobytes() != theirs[k].numpy().tobytes()] == []


def test_a_k_quant_falls_back_where_a_row_is_not_whole_blocks_and_tied_embeddings_write_no_output(tmp_path):
    path = tmp_path / "q4.gguf"
    shape = dict(SHAPES["tiny"], intermediate_size=256)  # ffn_down's rows: 256 values, one Q4_K block
    write_gguf(path, shape, vocabulary=byte_level_vocabulary(512), tied=True, quant="Q4_K", fallback="Q4_0")
    types = tensor_types(path)
    assert "output.weight" not in types
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.0.ffn_up.weight"] == "Q4_0"
    model, _ = transformers_load(path)
    assert model.config.tie_word_embeddings and model.config.intermediate_size == 256
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(ValueError, match="token_embd.weight: a row of 64 values is not a whole number of Q4_K"):
        write_gguf(tmp_path / "no.gguf", shape, vocabulary=byte_level_vocabulary(512), quant="Q4_K")
