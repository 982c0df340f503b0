"""The direct GGUF -> safetensors converter (stagereplay.models.gguf_convert) against today's path: ``load_model``
of the GGUF file, then ``save_pretrained`` (snapshot._write_converted). Every comparison is of bytes or digests,
never a tolerance: each tensor's bytes, dtype and shape, every file the two write, and the model signature of the
folder loaded back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gguf_fixture import write_tiny_gguf
from stagereplay.models import gguf_convert, signatures, snapshot
from stagereplay.io.fingerprints import tensor_digest
from stagereplay.models.gguf_convert import GGUFConvertError, convert_gguf
from stagereplay.models.loading import load_model, set_determinism
from stagereplay.models.sources import ModelSource
from stagereplay.testing.gguf import character_vocabulary, write_gguf
from stagereplay.testing.shapes import SHAPES

PRECISIONS = ("bf16", "fp32")
# The character vocabulary with a second merge: transformers 5.17 reads a GGUF array of one merge as that merge's
# string (load_gguf_checkpoint unwraps one-element values) and fails to build the tokenizer.
MERGES = ("1 2", "3 4")


def write_case(path: Path, architecture: str = "qwen2", types=None, tied: bool = True, seed: int = 0,
               skip: tuple[str, ...] = (), label: str | None = None) -> Path:
    """A 2-layer random model (hidden 256, so that K-quant rows fit) as a GGUF file: matrices in ``types[gguf name]``
    (default Q8_0), norms and biases F32, a byte-level BPE tokenizer; no output.weight when ``tied``; GGUF tensors
    named in ``skip`` left out; ``label`` written as general.architecture (default: ``architecture``)."""
    shape = dict(SHAPES["tiny"], hidden_size=256, intermediate_size=512, max_position_embeddings=256)
    if architecture == "qwen3":  # transformers reads no head_dim from a qwen3 GGUF: Qwen3Config's 128 it is
        shape["head_dim"] = 128
    write_gguf(path, shape, vocabulary=character_vocabulary(MERGES), architecture=architecture, label=label,
               name=f"tiny-random-{architecture}", tied=tied, quant="Q8_0", types=types, skip=skip, seed=seed,
               from_model=True)
    return path


# Every ggml type of this gguf-py that a model file uses, over one file's matrices (the embedding K-quant too).
MIXED = {"token_embd.weight": "Q6_K",
         "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q5_0", "blk.0.attn_v.weight": "Q8_0",
         "blk.0.attn_output.weight": "F16", "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_K",
         "blk.0.ffn_down.weight": "Q6_K",
         "blk.1.attn_q.weight": "BF16", "blk.1.attn_k.weight": "Q4_0", "blk.1.attn_v.weight": "Q2_K",
         "blk.1.attn_output.weight": "Q3_K", "blk.1.ffn_gate.weight": "Q8_0", "blk.1.ffn_up.weight": "Q4_K",
         "blk.1.ffn_down.weight": "F32"}
CASES = {  # name: (architecture, types, tied)
    "qwen2-mixed-tied": ("qwen2", MIXED, True),
    "llama-q4k-untied": ("llama", {**{k: "Q4_K" for k in MIXED}, "output.weight": "Q6_K"}, False),
    "qwen3-q8": ("qwen3", None, True),
}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ggufs")
    return {case: write_case(folder / f"{case}.gguf", architecture, types, tied)
            for case, (architecture, types, tied) in CASES.items()}


def gguf_source(path: Path) -> ModelSource:
    return ModelSource("gguf", str(path.parent), gguf_file=path.name)


def tensor_differences(record: dict, loaded) -> list[str]:
    """Where the converter's tensors differ from the model load_model gives (empty: every tensor the same bytes,
    dtype and shape, tied ones given by the tensor they are tied to)."""
    state = loaded.model.state_dict()
    written, tied = record["tensors"], record["tied"]
    problems = [f"{name}: not written and not tied" for name in state if name not in written and name not in tied]
    problems += [f"{name}: written, not in the model" for name in written if name not in state]
    for name, t in state.items():
        digest = written.get(name, written.get(tied.get(name)))
        if digest is not None and digest != tensor_digest(t):
            problems.append(f"{name}: other bytes, dtype or shape")
    return problems


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_converter_writes_what_loading_and_saving_the_gguf_writes(ggufs, case, tmp_path, monkeypatch):
    """Every tensor equals load_model's, every file equals save_pretrained's (model.safetensors byte for byte:
    header, order, padding), and the folder loads back with the source's model signature."""
    set_determinism(1)
    monkeypatch.setattr(gguf_convert, "CHUNK_VALUES", 256 * 7)  # matrices dequantised in slices of 7 rows or fewer
    path = ggufs[case]
    records = convert_gguf(path, {p: tmp_path / p for p in PRECISIONS})
    for precision in PRECISIONS:
        record, out = records[precision], tmp_path / precision
        direct = load_model(gguf_source(path), precision, "cpu", "eager")
        assert tensor_differences(record, direct) == []
        assert record["tied"] == ({"lm_head.weight": "model.embed_tokens.weight"} if CASES[case][2] else {})
        expected = signatures.model_signature(direct)
        today = tmp_path / f"today-{precision}"
        today.mkdir()
        snapshot._write_converted(direct, gguf_source(path), None, today)
        ours, theirs = folder_bytes(out), folder_bytes(today)
        assert "model.safetensors" in ours and ours.keys() == theirs.keys()
        assert [name for name, data in ours.items() if theirs[name] != data] == []  # every file, byte for byte
        again = load_model(ModelSource("local", str(out)), precision, "cpu", "eager",
                           load_tokenizer=snapshot.verbatim_tokenizer(record["tokenizer_class"]))
        assert signatures.compare_signatures(expected, signatures.model_signature(again)) == []


def test_the_file_digests_are_those_of_the_files_written(ggufs, tmp_path):
    from stagereplay.io.file_hashes import sha256_of_file

    records = convert_gguf(ggufs["qwen3-q8"], {"fp32": tmp_path / "fp32"})
    assert records["fp32"]["files"] == {"model.safetensors": sha256_of_file(tmp_path / "fp32" / "model.safetensors")}
    assert records["fp32"]["weights_sha256"] == snapshot.weights_sha256(records["fp32"]["tensors"])


def test_the_comparison_catches_a_wrong_cast_and_a_skipped_processor(ggufs, tmp_path, monkeypatch):
    """Controls: bf16 by truncation instead of round-to-nearest-even, and the llama Q/K permutation left out, are
    each seen by the comparison above (so its passing says something)."""
    set_determinism(1)
    path = ggufs["qwen2-mixed-tied"]
    direct = load_model(gguf_source(path), "bf16", "cpu", "eager")

    def truncating(values, dtype):  # the upper 16 bits of each float32: bf16 rounded toward zero
        if dtype != torch.bfloat16:
            return values.to(dtype)
        return (values.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)

    original_add = gguf_convert._Output.add
    monkeypatch.setattr(gguf_convert._Output, "add",
                        lambda self, name, values: original_add(self, name, truncating(values, self.dtype)))
    wrong = convert_gguf(path, {"bf16": tmp_path / "truncated"})["bf16"]
    caught = tensor_differences(wrong, direct)
    assert len(caught) >= 10 and all("other bytes" in line for line in caught)
    monkeypatch.setattr(gguf_convert._Output, "add", original_add)

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    path = ggufs["llama-q4k-untied"]
    direct = load_model(gguf_source(path), "fp32", "cpu", "eager")
    assert tensor_differences(convert_gguf(path, {"fp32": tmp_path / "ok"})["fp32"], direct) == []
    monkeypatch.setitem(gguf_utils.TENSOR_PROCESSORS, "llama", gguf_utils.TensorProcessor)
    skipped = convert_gguf(path, {"fp32": tmp_path / "unpermuted"})["fp32"]
    assert sorted(tensor_differences(skipped, direct)) == sorted(
        f"model.layers.{i}.self_attn.{p}_proj.weight: other bytes, dtype or shape" for i in (0, 1) for p in "qk")


def test_tensors_the_model_has_no_place_for_fail_the_conversion(tmp_path):
    """Qwen2's tensors in a file labelled llama: the q/k/v biases have no parameter in a llama model."""
    write_tiny_gguf(tmp_path / "labelled-llama.gguf", architecture="llama")
    out = tmp_path / "out"
    with pytest.raises(GGUFConvertError, match="6 GGUF tensors map to no parameter") as error:
        convert_gguf(tmp_path / "labelled-llama.gguf", {"bf16": out})
    for name in ("blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.1.attn_v.bias"):
        assert name in str(error.value)
    assert not (out / "model.safetensors").exists()


def test_a_parameter_the_file_lacks_fails_the_conversion(tmp_path):
    path = write_case(tmp_path / "short.gguf", skip=("blk.1.ffn_down.weight", "blk.0.attn_norm.weight"))
    with pytest.raises(GGUFConvertError, match="2 parameters the config needs are not in the file") as error:
        convert_gguf(path, {"fp32": tmp_path / "out"})
    assert "model.layers.0.input_layernorm.weight" in str(error.value)
    assert "model.layers.1.mlp.down_proj.weight" in str(error.value)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_shards_are_the_ones_save_pretrained_writes(ggufs, tmp_path, monkeypatch):
    """Beyond save_pretrained's shard size (50 GB: a 14B model at fp32, not at bf16) the weights go to its shards
    and index; here with the limit lowered for both, so that fp32 is sharded and bf16 is not, from one read."""
    from stagereplay.io.file_hashes import sha256_of_file

    set_determinism(1)
    path = ggufs["llama-q4k-untied"]
    monkeypatch.setattr(gguf_convert, "MAX_SHARD_SIZE", "3MB")
    records = convert_gguf(path, {p: tmp_path / f"new-{p}" for p in PRECISIONS})
    for precision in PRECISIONS:
        direct = load_model(gguf_source(path), precision, "cpu", "eager")
        snapshot._plain_gguf_model(direct.model)
        direct.model.save_pretrained(tmp_path / f"saved-{precision}", max_shard_size="3MB")
        written, saved = (folder_bytes(tmp_path / f"{what}-{precision}") for what in ("new", "saved"))
        assert written.keys() - saved.keys() == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
        assert {name: written[name] for name in saved} == saved
        weight_files = sorted(name for name in saved if name.endswith(".safetensors"))
        assert len(weight_files) == {"fp32": 2, "bf16": 1}[precision]
        assert all(records[precision]["files"][name] == sha256_of_file(tmp_path / f"new-{precision}" / name)
                   for name in records[precision]["files"])
    # the walk follows fp32's shards, whose digests come on the way; bf16's one file is written out of its order
    assert sorted(records["fp32"]["files"]) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_the_header_is_the_one_safetensors_writes(tmp_path):
    from safetensors.torch import save_file

    tensors = {"b.weight": torch.randn(3, 5).to(torch.bfloat16), "a": torch.randn(7), "e": torch.zeros(0, 4),
               "model.layers.10.x": torch.randn(2, 2), "model.layers.2.x": torch.randn(3).half(),
               "s": torch.tensor(2.0)}
    save_file(tensors, tmp_path / "lib.safetensors", metadata={"format": "pt"})
    header, order = gguf_convert.safetensors_layout({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    ours = header + b"".join(tensors[n].reshape(-1).view(torch.uint8).numpy().tobytes() for n in order)
    assert ours == (tmp_path / "lib.safetensors").read_bytes()
