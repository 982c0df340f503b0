"""The one place that knows how the installed transformers spells its KV-cache API, and how its tokenizer loading
can be told not to redo work.

transformers 5.24 renamed the forward/generate keyword ``past_key_values`` to ``cache`` (the old name warns);
5.17, on the GPU machines, only knows ``past_key_values``. Everything else in the package goes through the
helpers here instead of checking versions.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch


def cache_keyword(model) -> str:
    """The forward keyword that takes a KV cache for ``model``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(output):
    return output["cache"] if "cache" in output.keys() else output["past_key_values"]


def new_dynamic_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_from_tensors(model, layers: list[tuple[torch.Tensor, torch.Tensor]]):
    """A DynamicCache holding exactly ``layers`` (K, V) pairs; tensors are copied."""
    cache = new_dynamic_cache(model)
    for i, (k, v) in enumerate(layers):
        cache.layers[i].update(k.clone(), v.clone())
    return cache


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer, each (batch, kv_heads, seq, head_dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def set_cache_layer(cache, index: int, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
    layer = cache.layers[index]
    if keys is not None:
        layer.keys = keys.clone()
    if values is not None:
        layer.values = values.clone()


def cache_length(cache) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache, length: int) -> None:
    """Crop to ``length`` tokens; a negative argument is the only spelling every 5.x release accepts."""
    drop = cache_length(cache) - length
    if drop > 0:
        cache.crop(-drop)


# Files ``from_pretrained`` reads for added and special tokens only where tokenizer_config.json names no
# ``added_tokens_decoder`` (older saves); their contents are merged in that branch, which the keywords below skip.
LEGACY_TOKEN_FILES = ("special_tokens_map.json", "added_tokens.json")


def tokenizer_object_keywords(folder: str | Path, pipeline) -> dict:
    """Keywords for ``TokenizerClass.from_pretrained(folder, tokenizer_object=pipeline, **these)`` that keep it
    from parsing ``folder``'s tokenizer.json twice more in Python, where ``pipeline`` is that file loaded with
    ``tokenizers.Tokenizer.from_file``; the tokenizer it gives is the same (5.17 and 5.24 alike).

    - ``added_tokens_decoder``: a saved tokenizer_config.json names none, so ``from_pretrained`` reads the whole
      tokenizer.json with ``json.load`` for its ``added_tokens``; these are the pipeline's own added tokens, the
      same entries (id, content and flags). Left out where a legacy special_tokens_map.json or added_tokens.json
      is there (their branch would be skipped too).
    - ``tokenizer_file=""`` (no file): a model class with its own ``__init__`` (Qwen2Tokenizer) has
      ``convert_to_native_format`` read tokenizer.json with ``json.load`` again and builds its own BPE model from
      the vocabulary and merges in it, which ``tokenizer_object`` then replaces whole (its post-processor,
      padding and truncation, taken from the same file, are the pipeline's own). The empty name is not a file,
      so that is skipped; the argument goes no further (the method pops it).
    """
    if any((Path(folder) / name).exists() for name in LEGACY_TOKEN_FILES):
        return {}
    return {"added_tokens_decoder": pipeline.get_added_tokens_decoder(), "tokenizer_file": ""}
