"""Bad model inputs and run settings (docs/BAD_INPUTS.md): weights that do not match their config, a model
folder without a tokenizer, truncated weights, CUDA asked for where there is none, settings across keys that
cannot work, a results folder that is a file, and the checks of a dry run.

Each is caught before any result is computed and named with its fix; the checks run on the package functions,
and the workflow only where Snakemake itself is what is tested.
"""

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from snakemake.utils import validate

from conftest import make_tiny_model
from gguf_fixture import write_tiny_gguf
from stagereplay.models.loading import ModelLoadError, ModelSource, load_model
from stagereplay.stages.preflight import check_model, check_run
from workflow_runner import snakemake, tiny_config

REPO = Path(__file__).resolve().parents[1]
SCHEMA = str(REPO / "workflow/schemas/config.schema.yaml")


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("four") / "model", layers=4)


def copy_with_config(folder: Path, dest: Path, **changes) -> Path:
    """A copy of a model folder whose config.json has ``changes`` (the weights untouched)."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(changes)
    if "num_hidden_layers" in changes:
        cfg["layer_types"] = ["full_attention"] * changes["num_hidden_layers"]
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def load_local(folder, precision="fp32"):
    return load_model(ModelSource("local", str(folder)), precision, "cpu")


def valid_config(**overrides):
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(n_items=4, dataset={"source": "synthetic", "size": 50, "seed": 0})
    cfg.update(overrides)
    validate(cfg, SCHEMA, set_default=True)
    cfg["model"] = str(REPO / cfg["model"]) if cfg["model"] == "data/toy" else cfg["model"]
    return cfg


# --- weights that do not match their config -----------------------------------------------------------------

def test_a_config_with_more_layers_than_the_weights_is_refused_naming_the_tensors(tmp_path, four_layers):
    folder = copy_with_config(four_layers, tmp_path / "six", num_hidden_layers=6)
    with pytest.raises(ModelLoadError) as err:
        load_local(folder)
    message = str(err.value)
    assert "24 tensors the config needs are missing from the weights" in message  # 2 layers x 12 tensors
    assert "model.layers.4.input_layernorm.weight" in message
    assert "and 18 more" in message  # the list is capped, the count is whole
    assert "restore the config.json saved with these weights" in message


def test_a_config_with_fewer_layers_or_other_sizes_is_refused_naming_the_tensors(tmp_path, four_layers):
    fewer = copy_with_config(four_layers, tmp_path / "three", num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match=r"12 tensors in the weights have no place .*model\.layers\.3\."):
        load_local(fewer)
    narrower = copy_with_config(four_layers, tmp_path / "narrow", intermediate_size=96)
    with pytest.raises(ModelLoadError) as err:
        load_local(narrower)
    assert "12 tensors have another shape than the config gives" in str(err.value)
    assert "model.layers.0.mlp.down_proj.weight [64, 128] in the weights, [64, 96] in the config" in str(err.value)


def test_tied_embeddings_saved_buffers_and_gguf_are_not_refused(tmp_path, four_layers):
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM

    # lm_head tied to the embeddings: not saved, not missing
    cfg = AutoConfig.from_pretrained(four_layers)
    cfg.tie_word_embeddings = True
    tied = tmp_path / "tied"
    Qwen2ForCausalLM(cfg).save_pretrained(tied)
    AutoTokenizer.from_pretrained(four_layers).save_pretrained(tied)
    loaded = load_local(tied)
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()

    # an older checkpoint that saved each layer's rotary inv_freq buffer: transformers computes it, not unexpected
    old = tmp_path / "old"
    shutil.copytree(four_layers, old)
    weights = load_file(old / "model.safetensors")
    inv_freq = loaded.model.model.rotary_emb.inv_freq.clone()
    weights.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone() for i in range(4)})
    save_file(weights, old / "model.safetensors", metadata={"format": "pt"})
    load_local(old)

    write_tiny_gguf(tmp_path / "tiny.gguf")
    load_model(ModelSource("gguf", str(tmp_path), gguf_file="tiny.gguf"), "fp32", "cpu")
