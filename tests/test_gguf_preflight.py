"""The preflight's check of a GGUF source (no prepared snapshot yet): the config and tokenizer a job loads, from
gguf-py's one parse of the file's metadata, and bad files refused.

The vocabulary here is 30,000 byte-level BPE tokens with their merges, not Qwen2's 151,643: the path is the same
(gguf-py's reader, transformers' GGUF config and tokenizer conversion), and loading it the slow way, as a job does,
takes 6 s instead of 40 on the 2-core VM. bench/gguf_preflight.py compares the two at the real size.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import gguf.gguf_reader
import pytest
import transformers.modeling_gguf_pytorch_utils as gguf_utils

from gguf_fixture import TINY, write_tiny_gguf, write_vocab_gguf
from stagereplay.models import gguf_files
from stagereplay.models.loading import checked_config, checked_tokenizer
from stagereplay.models.sources import ModelLoadError, ModelSource
from stagereplay.models.signatures import IGNORED_CONFIG_KEYS, tokenizer_signature
from stagereplay.stages.preflight import check_model
from stagereplay.testing.gguf import write_gguf

# Beyond the snapshot signature's probes: specials alone and inside words, a long digit run, bytes outside ASCII.
MORE_PROBES = ["<think>3+4=7</think><|im_end|>", "x<|im_start|>y", "1234567890" * 20, "naïve café — ≈ 3½ €",
               "  leading and trailing  ", "\n\n\t", ""]


@pytest.fixture(scope="module")
def vocab_gguf(tmp_path_factory) -> ModelSource:
    folder = tmp_path_factory.mktemp("vocab_gguf")
    write_vocab_gguf(folder / "vocab.gguf", regular=30_000)
    return ModelSource("gguf", str(folder), gguf_file="vocab.gguf")


def config_values(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}


def test_the_preflight_of_a_gguf_gives_the_config_and_tokenizer_a_job_loads(vocab_gguf, monkeypatch):
    # What load_model builds (a job, or preparing the snapshot every job then loads): gguf-py's own reader, once
    # per transformers call, nothing shared.
    resolved, _, job_config, common = checked_config(vocab_gguf)
    job_tokenizer = checked_tokenizer(resolved, vocab_gguf, common, job_config.vocab_size)

    parses, conversions = [], []
    real_init = gguf.gguf_reader.GGUFReader.__init__
    monkeypatch.setattr(gguf.gguf_reader.GGUFReader, "__init__",
                        lambda self, *a, **k: (parses.append(a[0]), real_init(self, *a, **k))[1])
    real_checkpoint = gguf_utils.load_gguf_checkpoint

    def counted(*args, **kwargs):
        conversions.append(args[0])
        return real_checkpoint(*args, **kwargs)

    gguf_files._rebind_transformers("load_gguf_checkpoint", real_checkpoint, counted)
    try:
        config, tokenizer = check_model(vocab_gguf)
        assert gguf_utils.load_gguf_checkpoint is counted  # restored to what it was
    finally:
        gguf_files._rebind_transformers("load_gguf_checkpoint", counted, real_checkpoint)
    # The architecture check, transformers' config and its tokenizer share one parse and one conversion of it.
    assert len(parses) == 1 and len(conversions) == 1
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader and gguf_files._GGUF_ONCE is None

    assert config_values(config) == config_values(job_config)
    assert config.vocab_size == 30_000 + 5 + 64 and config.model_type == "qwen2"
    assert type(tokenizer) is type(job_tokenizer)
    assert tokenizer_signature(tokenizer) == tokenizer_signature(job_tokenizer)  # pipeline, vocab, specials, template
    for text in MORE_PROBES:
        assert tokenizer(text)["input_ids"] == job_tokenizer(text)["input_ids"]
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == job_tokenizer.decode(job_tokenizer(text)["input_ids"])


def test_the_plain_array_reader_reads_what_gguf_py_reads(vocab_gguf):
    path = Path(vocab_gguf.path) / vocab_gguf.gguf_file
    plain, mapped = gguf_files.gguf_reader(path), gguf.GGUFReader(str(path))
    assert list(plain.fields) == list(mapped.fields)
    for name in ("general.architecture", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                 "qwen2.context_length", "tokenizer.chat_template"):
        assert plain.fields[name].contents() == mapped.fields[name].contents()
        assert plain.fields[name].types == mapped.fields[name].types
    assert [(t.name, t.tensor_type, t.data_offset, t.data.shape) for t in plain.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.data.shape) for t in mapped.tensors]
    assert all((a.data == b.data).all() for a, b in zip(plain.tensors, mapped.tensors))


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory) -> tuple[bytes, int]:
    path = tmp_path_factory.mktemp("tiny_gguf") / "whole.gguf"
    write_tiny_gguf(path)
    return path.read_bytes(), gguf.GGUFReader(str(path)).data_offset


@pytest.mark.parametrize("where", ["tensor data", "tensor table", "metadata", "header"])
def test_a_gguf_cut_short_is_refused_by_the_preflight(tiny_gguf_bytes, tmp_path, where):
    data, data_offset = tiny_gguf_bytes
    keep = {"tensor data": len(data) - 100, "tensor table": data_offset - 40, "metadata": 2000, "header": 10}[where]
    (tmp_path / "cut.gguf").write_bytes(data[:keep])
    with pytest.raises(ModelLoadError, match=r"cut.gguf is not a readable GGUF file, or is cut short \(.*\); copy or "
                                             "download it again"):
        check_model(ModelSource("gguf", str(tmp_path), gguf_file="cut.gguf"))
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader and gguf_files._GGUF_ONCE is None


def test_a_gguf_without_a_tokenizer_is_refused_by_the_preflight(tmp_path):
    write_gguf(tmp_path / "untokenized.gguf", dict(TINY, num_hidden_layers=1), vocabulary=None, from_model=True)
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer of .*untokenized.gguf"):
        check_model(ModelSource("gguf", str(tmp_path), gguf_file="untokenized.gguf"))
