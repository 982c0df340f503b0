"""The one place that knows how the installed transformers spells its KV-cache API.

transformers 5.24 renamed the forward/generate keyword ``past_key_values`` to ``cache`` (the old name warns);
5.17, on the GPU machines, only knows ``past_key_values``. Everything else in the package goes through the
helpers here instead of checking versions.
"""

from __future__ import annotations

import inspect

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
