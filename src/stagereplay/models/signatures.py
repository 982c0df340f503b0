"""What a prepared snapshot is compared on against its source: the signature of a loaded model (every tensor and
buffer by digest, the weight tying, the model and generation configs without the keys that only say where and how
it was loaded (:data:`IGNORED_CONFIG_KEYS`), the tokenizer's whole pipeline, special tokens, chat template and the
encodings of :data:`PROBE_TEXTS`, the end-of-text ids), the comparison of two signatures that names what differs
(:func:`compare_signatures`), and the versions of the packages a snapshot's bytes depend on (:func:`software_versions`,
recorded in its manifest). Used by :mod:`stagereplay.models.snapshot` to prove a snapshot before it is kept; knows
nothing of Snakemake, stages or the ledger.
"""

from __future__ import annotations

import json

import torch

from stagereplay.io.fingerprints import tensor_digest
from stagereplay.models.loading import LoadedModel, eos_token_ids
from stagereplay.models.store import installed_versions

# Config keys that say where a model was loaded from and how, not what it computes: ``_name_or_path`` (the
# folder), ``quantization_config`` (the GGUF marker transformers leaves on a model whose tensors it fully
# dequantised at load), ``architectures`` (save_pretrained names the class; loading picks it from model_type).
IGNORED_CONFIG_KEYS = ("_name_or_path", "quantization_config", "architectures", "transformers_version")
# Texts the tokenizers must encode alike: special tokens inside text, digits, a decomposed accent (a
# normaliser changes it), whitespace runs and a newline.
PROBE_TEXTS = ("Q: 12+7=? A: <think>12+7=19;</think> 19", "e\u0301t\u00e9  x\n\ty", "<|im_end|><|endoftext|>")


def software_versions() -> dict:
    """The packages a snapshot's bytes depend on (a new version of any may convert the source differently), read
    from their installed metadata: the workflow takes them when it plans, without importing them."""
    return installed_versions(("torch", "transformers", "safetensors", "tokenizers", "gguf"))


# ---- What a loaded model is, as bytes and settings -------------------------------------------------------------------
def tensor_digests(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter and buffer (persistent or computed at load, as rotary ``inv_freq``) by name."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update({f"buffer:{n}": b for n, b in model.named_buffers(remove_duplicate=False)})
    return {name: tensor_digest(t) for name, t in sorted(named.items())}


def _plain(value):
    """A JSON-comparable copy (enums, dtypes and other objects as their strings)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def tokenizer_signature(tokenizer) -> dict:
    """What decides the ids a tokenizer gives and the text it decodes, as JSON-comparable values."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    messages = [{"role": "user", "content": PROBE_TEXTS[0]}]
    template = getattr(tokenizer, "chat_template", None)
    signature = {
        "pipeline": json.loads(backend.to_str()) if backend is not None else None,
        "vocab": tokenizer.get_vocab(),
        "length": len(tokenizer),
        "special_tokens": _plain(tokenizer.special_tokens_map),
        "special_ids": sorted(int(i) for i in tokenizer.all_special_ids),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "chat_template": template,
        "model_input_names": list(tokenizer.model_input_names),
        "padding_side": tokenizer.padding_side,
        "probes": [{key: list(value) for key, value in tokenizer(text).items()} for text in PROBE_TEXTS],
        "probes_plain": [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROBE_TEXTS],
        "decoded": [tokenizer.decode(tokenizer(text)["input_ids"]) for text in PROBE_TEXTS],
    }
    if template:
        signature["chat_prompt"] = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return signature


def model_signature(loaded: LoadedModel) -> dict:
    """Everything a job computes with, from a loaded model: tensors, tying, configs, tokenizer, end-of-text ids."""
    model = loaded.model
    config = {k: v for k, v in model.config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}
    generation = getattr(model, "generation_config", None)
    generation = {k: v for k, v in (generation.to_dict() if generation is not None else {}).items()
                  if k != "transformers_version"}
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    return {
        "tensors": tensor_digests(model),
        "tied_embeddings": outputs is not None and outputs.weight is inputs.weight,
        "class": type(model).__name__,
        "config": _plain(config),
        "generation_config": _plain(generation),
        "tokenizer": tokenizer_signature(loaded.tokenizer),
        "eos_token_ids": eos_token_ids(loaded),
        "info": {k: loaded.info[k] for k in ("model_type", "num_layers", "dtype", "attn_implementation")},
    }


def compare_signatures(source: dict, snapshot: dict) -> list[str]:
    """What differs between a source's and a snapshot's :func:`model_signature`, one line each (empty: equal)."""
    problems = []
    a, b = source["tensors"], snapshot["tensors"]
    if a.keys() != b.keys():
        problems.append(f"tensors only in the source: {sorted(a.keys() - b.keys())[:6]}, only in the snapshot: "
                        f"{sorted(b.keys() - a.keys())[:6]}")
    differing = sorted(n for n in a.keys() & b.keys() if a[n] != b[n])
    if differing:
        problems.append(f"{len(differing)} tensors differ in bytes, dtype or shape: {differing[:6]}")
    for part in ("tied_embeddings", "class", "eos_token_ids", "info"):
        if source[part] != snapshot[part]:
            problems.append(f"{part}: {source[part]!r} from the source, {snapshot[part]!r} from the snapshot")
    for part in ("config", "generation_config", "tokenizer"):
        x, y = source[part], snapshot[part]
        keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
        if keys:
            shown = "; ".join(f"{k}: {str(x.get(k))[:120]!s} vs {str(y.get(k))[:120]!s}" for k in keys[:4])
            problems.append(f"{part} differs in {keys}: {shown}")
    return problems
