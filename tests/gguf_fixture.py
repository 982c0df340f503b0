"""The tests' GGUF files, written by stagereplay.testing.gguf: a tiny random Qwen2 (F32) with a byte-level
vocabulary of printable ASCII, one merge and Qwen2's specials, and one whose vocabulary is large."""

from __future__ import annotations

from pathlib import Path

import os

from stagereplay.testing.gguf import SPECIALS, byte_level_vocabulary, character_vocabulary, write_gguf
from stagereplay.testing.shapes import SHAPES

TINY = dict(SHAPES["tiny"], max_position_embeddings=256)


def write_tiny_gguf(path: Path, seed: int = 0, architecture: str = "qwen2", layers: int = 2, raw_types=None):
    """Write a tiny random Qwen2-shaped model to ``path`` (F32 tensors); return the in-memory HF model.

    ``architecture`` is written as the file's ``general.architecture`` (tests write an unsupported one);
    ``raw_types`` (GGUF tensor name: ggml type name) writes those tensors as zero blocks of that type.
    """
    return write_gguf(path, dict(TINY, num_hidden_layers=layers), vocabulary=character_vocabulary(),
                      label=architecture, name="tiny-random-qwen2", raw_types=raw_types, seed=seed,
                      from_model=True).model


def write_vocab_gguf(path: Path, regular: int, seed: int = 0, padding: int = 64):
    """A one-layer random Qwen2 (F32) whose vocabulary is large: ``regular`` byte-level BPE tokens with their
    merges, the specials, then ``padding`` unused ``[PADn]`` tokens (as Qwen2's vocabulary of 151,936 pads its
    151,643 + 22 tokens)."""
    vocabulary = byte_level_vocabulary(regular + len(SPECIALS) + padding, regular, seed)
    write_gguf(path, dict(TINY, num_hidden_layers=1, rope_theta=1000000.0), vocabulary=vocabulary,
               name="random-qwen2-vocab", seed=seed, from_model=True)


def llama_cpp_or_skip():
    """llama-cpp-python, imported; a test module that needs it calls this at import: without the binding it is
    skipped saying so, and fails where ``CI`` is set (CI installs the extra ``engines``)."""
    import pytest

    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - which branch runs depends on the machine
        why = (f"llama-cpp-python is not installed ({exc}); install it with pip install -e '.[engines]' "
               "(docs/ENGINES.md)")
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why, allow_module_level=True)
    return llama_cpp
