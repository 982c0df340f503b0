"""Loading a model revision at a precision, with the numerics settings that make replicas exact.

A source (:mod:`stagereplay.models.sources`) is read here through transformers: its config and tokenizer, checked
(:func:`checked_config`, :func:`checked_tokenizer`), then its weights (:func:`load_model`), refused unless they are
exactly the tensors the config describes. Weights load from safetensors or GGUF only unless the caller opts into
pickled checkpoints; ``trust_remote_code`` is off unless the caller turns it on. Jobs load a prepared snapshot of
the source from the model store (:mod:`stagereplay.models.store`) through :func:`load_model` too. This module knows
nothing of caches, constructions or the ledger.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stagereplay.models import invariant
from stagereplay.models.gguf_files import check_gguf, unused_gguf_tensors
from stagereplay.models.sources import (
    SUPPORTED_MODEL_TYPES,
    ModelLoadError,
    ModelSource,
    check_weights_format,
    fetch_hub_snapshot,
    go_offline,
)

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def set_determinism(threads: int) -> dict:
    """Deterministic algorithms on, TF32 off, CPU threads pinned; returns the flags for provenance.

    On the GPU, replicas of a one-shot prefill were seen to differ without deterministic mode
    (docs/STUDY.md, numerics rules). Filling uninitialised memory is an avoidable cost we switch off.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    _set_flags(_DETERMINISTIC)
    torch.set_num_threads(int(threads))
    return numerics_flags()


# (deterministic algorithms, their warn-only mode, fill uninitialised memory, TF32 matmul, TF32 cuDNN, cuDNN
# benchmark, fp32 matmul precision)
_DETERMINISTIC = (True, False, False, False, False, False, "highest")


def _flags() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision())


def _set_flags(flags: tuple) -> None:
    deterministic, warn_only, fill, tf32_matmul, tf32_cudnn, benchmark, fp32_precision = flags
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.backends.cuda.matmul.allow_tf32 = tf32_matmul
    torch.backends.cudnn.allow_tf32 = tf32_cudnn
    torch.backends.cudnn.benchmark = benchmark
    torch.set_float32_matmul_precision(fp32_precision)


@contextmanager
def determinism():
    """The flags of :func:`set_determinism` (its threads aside) inside the block, the caller's restored after it:
    for a library call in a process that is not the pipeline's. Yields the flags for provenance."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    saved = _flags()
    _set_flags(_DETERMINISTIC)
    try:
        yield numerics_flags()
    finally:
        _set_flags(saved)


def numerics_flags() -> dict:
    return {
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "bf16_reduced_precision_reduction": bool(
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
        "fp16_reduced_precision_reduction": bool(
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "cpu_threads": int(torch.get_num_threads()),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
    }


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device {device!r} was asked for but CUDA is not available on this machine (torch {torch.__version__}, "
            f"{'no GPU visible' if torch.version.cuda else 'a build without CUDA'}); set device: cpu or auto"
        )
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(f"device {device!r} was asked for but this machine has {torch.cuda.device_count()} "
                             "CUDA devices; name one of them, or set device: cuda or auto")
    return dev


# CPU features that change how bf16 matrix products are computed (oneDNN picks its kernels by them), so that the
# toy's bf16 split between live and prefill differs between processors that have them and those that do not
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def device_name(device: torch.device) -> str:
    """The device as provenance records it: the GPU's name, or for a CPU its architecture, the kernels torch picks
    (``AVX512``, ``AVX2``, ...) and the bf16 features present (read from /proc/cpuinfo where there is one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    present = [f for f in BF16_CPU_FLAGS if f in flags]
    return (f"cpu:{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
            + (f" ({', '.join(present)})" if present else ""))



@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: ModelSource
    precision: str
    device: torch.device
    info: dict = field(default_factory=dict)



def checked_config(source: ModelSource, trust_remote_code: bool = False, allow_pickle: bool = False,
                   offline: bool = True):
    """Resolve ``source`` and read its model config, refusing what the cache code cannot handle.

    Returns (resolved source, hub commit or None, config, keyword arguments for ``from_pretrained``). Shared by
    :func:`load_model` and the preflight check, which reads configs without loading weights.
    """
    from transformers import AutoConfig

    if offline:
        go_offline()
    requested, resolved_commit = source, None
    if source.kind == "hub":
        source, resolved_commit = fetch_hub_snapshot(source, offline, allow_pickle)
    if source.kind == "gguf":
        check_gguf(source)
    check_weights_format(source, allow_pickle)
    common = {"trust_remote_code": trust_remote_code}
    if source.kind == "gguf":
        common["gguf_file"] = source.gguf_file
    try:
        config = AutoConfig.from_pretrained(source.path, **common)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError depending on the cause
        raise ModelLoadError(f"cannot read the model config of {requested.describe()}: {exc}") from exc
    reason = unsupported(config)
    if reason is not None:
        raise ModelLoadError(f"{requested.describe()} {reason}")
    return source, resolved_commit, config, common


def unsupported(config) -> str | None:
    """Why the cache code cannot handle a model of ``config`` (its model type), as the end of a sentence naming the
    model; None when it can. A sliding window is a limit on a run's length (:func:`context_positions`)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"is a {model_type!r} model; the cache code supports {list(SUPPORTED_MODEL_TYPES)} (decoder-only, "
                "every layer full attention): point model at one of those")
    return None


def sliding_window(config) -> int | None:
    """The sliding window of the model's attention in positions, None without one. Mistral's configs set
    ``sliding_window`` alone (4096 for Mistral-7B-v0.1), Qwen2's and Qwen3's turn theirs on with
    ``use_sliding_window``."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    return int(window)


def context_positions(config) -> int | None:
    """The most positions one run may take (prompt, stage and suffix together) on a model of ``config``: its
    ``max_position_embeddings``, or its sliding window where that is shorter; None when neither is known.

    Within the window no position ever falls out of any token's attention, so the model computes full attention
    and its cache holds every position. Past it the window's cache drops the oldest positions, and a boundary cache
    must hold the whole prefix: such a run is refused before it starts, not failed deep in the decode."""
    limits = [int(n) for n in (getattr(config, "max_position_embeddings", None), sliding_window(config)) if n]
    return min(limits) if limits else None


# Text every tokenizer of a model that reasons about numbers turns into tokens.
TOKENIZER_PROBE = "0123456789"


def checked_tokenizer(source: ModelSource, requested: ModelSource, common: dict, vocab_size: int | None,
                      load_tokenizer=None):
    """The tokenizer of resolved ``source``, refused when it has more tokens than the model's vocabulary.

    ``requested`` is what the user named (for messages); ``common`` the ``from_pretrained`` keywords from
    :func:`checked_config`; ``load_tokenizer(folder)``, when given, loads it instead of ``AutoTokenizer`` (a
    prepared snapshot's, :mod:`stagereplay.models.snapshot`). Shared by :func:`load_model` and the preflight check."""
    from transformers import AutoTokenizer

    try:
        if load_tokenizer is not None:
            tokenizer = load_tokenizer(source.path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source.path, **common)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {requested.describe()}: {exc}") from exc
    # A folder without tokenizer files still gives a tokenizer (transformers 5 builds an empty one), which turns
    # every prompt into no tokens: the job would fail deep in the model ("cannot reshape tensor of 0 elements").
    if not tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]:
        where = Path(source.path)
        found = sorted(p.name for p in where.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges"))) \
            if source.kind == "local" and where.is_dir() else []
        raise ModelLoadError(
            f"{requested.describe()} has no usable tokenizer: it turns {TOKENIZER_PROBE!r} into no tokens "
            f"(tokenizer files found: {found or 'none'}); put the tokenizer saved with the model "
            "(tokenizer.json and tokenizer_config.json, or vocab.json and merges.txt) in the model folder"
        )
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ModelLoadError(
            f"the tokenizer of {requested.describe()} has {len(tokenizer)} tokens but the model's vocabulary has "
            f"{vocab_size}: they do not belong together; point model at a folder holding both"
        )
    return tokenizer


# How many tensor names an error lists before it gives only the count.
NAMED_TENSORS = 6


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:NAMED_TENSORS])
    return shown + (f" and {len(names) - NAMED_TENSORS} more" if len(names) > NAMED_TENSORS else "")


def check_weights_match_config(loading_info: dict, requested: ModelSource, config) -> None:
    """Refuse a model whose weights are not exactly the tensors its config describes.

    transformers initialises at random every tensor the config asks for and the weights lack (a config saying
    6 layers over weights of 4), reinitialises a tensor of another shape, and drops tensors it has no place
    for; each would give results from a model that is not the checkpoint. ``loading_info`` is what
    ``from_pretrained(..., output_loading_info=True)`` returns: tied weights and buffers computed at load
    (rotary ``inv_freq``) are not counted missing there.
    """
    missing = sorted(loading_info.get("missing_keys") or [])
    unexpected = sorted(loading_info.get("unexpected_keys") or [])
    mismatched = sorted(loading_info.get("mismatched_keys") or [])
    errors = [str(e) for e in loading_info.get("error_msgs") or []]
    if not (missing or unexpected or mismatched or errors):
        return
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors the config needs are missing from the weights "
                        f"(they would be random): {_named(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors in the weights have no place in the config's model: "
                        f"{_named(unexpected)}")
    if mismatched:
        shapes = [f"{name} ({list(saved)} in the weights, {list(wanted)} by the config)"
                  for name, saved, wanted in mismatched]
        problems.append(f"{len(mismatched)} tensors have another shape than the config gives: {_named(shapes)}")
    if errors:
        problems.append(f"errors: {_named(errors)}")
    layers = getattr(config, "num_hidden_layers", None)
    raise ModelLoadError(
        f"the weights of {requested.describe()} do not match its model config (num_hidden_layers: {layers}, "
        f"hidden_size: {getattr(config, 'hidden_size', None)}): " + "; ".join(problems) + ". The config and "
        "the weights must come from the same checkpoint: restore the config.json saved with these weights, or "
        "the weights it describes"
    )


def meta_model(config):
    """The model ``from_pretrained`` builds for ``config``, on the meta device: its parameter names, no memory."""
    import copy

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))


def check_gguf_tensors_used(model, source: ModelSource, requested: ModelSource) -> None:
    """Refuse a GGUF file of which a tensor gives no parameter of the model loaded from it (transformers drops it
    silently): the file's architecture field names another model than its tensors are (the safetensors path refuses
    such tensors in :func:`check_weights_match_config`, the converter in its plan)."""
    unused = unused_gguf_tensors(model, Path(source.path) / source.gguf_file)
    if unused:
        raise ModelLoadError(
            f"{requested.describe()}: {len(unused)} GGUF tensors give no parameter of the {model.config.model_type!r} "
            f"model its general.architecture field names, and would be dropped: {_named(unused)}. The file's "
            "architecture field and its tensors must describe the same model: convert the checkpoint again (with "
            "llama.cpp's convert_hf_to_gguf.py), or point model at the checkpoint it was made from"
        )


def load_model(
    source: ModelSource,
    precision: str,
    device: str = "auto",
    attn_implementation: str = "eager",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    offline: bool = True,
    numerics: str = "default",
    load_tokenizer=None,
) -> LoadedModel:
    """Load ``source`` at ``precision`` on ``device``, in eval mode, greedy generation defaults neutralised.

    ``numerics: invariant`` switches the model to the batch-invariant regime of :mod:`stagereplay.invariant`.
    """
    from transformers import AutoModelForCausalLM

    if precision not in PRECISIONS:
        raise ModelLoadError(f"precision {precision!r} is not one of {sorted(PRECISIONS)}")
    if numerics not in ("default", "invariant"):
        raise ModelLoadError(f"numerics {numerics!r} is not one of ['default', 'invariant']")
    dev = resolve_device(device)
    requested = source
    source, resolved_commit, config, common = checked_config(source, trust_remote_code, allow_pickle, offline)
    model_type = config.model_type
    # Mismatched shapes are reported in the loading info (and refused below, naming them) instead of raising
    # transformers' own error, which names no tensor; nothing reinitialised survives the check.
    kwargs = dict(common, dtype=PRECISIONS[precision], attn_implementation=attn_implementation,
                  output_loading_info=True, ignore_mismatched_sizes=True)
    if source.kind != "gguf" and not allow_pickle:
        kwargs["use_safetensors"] = True
    try:
        model, loading_info = AutoModelForCausalLM.from_pretrained(source.path, **kwargs)
    except ImportError as exc:
        raise ModelLoadError(f"loading {requested.describe()} needs an optional package: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"cannot load {requested.describe()}: {exc}") from exc
    check_weights_match_config(loading_info, requested, config)
    if source.kind == "gguf":
        check_gguf_tensors_used(model, source, requested)
    tokenizer = checked_tokenizer(source, requested, common, model.config.vocab_size, load_tokenizer)
    model.to(dev).eval()
    model.requires_grad_(False)
    regime = {"numerics": "default"}
    if numerics == "invariant":
        try:
            regime = invariant.apply(model)
        except invariant.InvariantRegimeError as exc:
            raise ModelLoadError(f"{source.describe()}: {exc}") from exc
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=requested,
        precision=precision,
        device=dev,
        info={
            "model_source": requested.describe(),
            **({"model_commit": resolved_commit} if resolved_commit else {}),
            "model_type": model_type,
            "num_layers": int(config.num_hidden_layers),
            "attn_implementation": model.config._attn_implementation,
            "dtype": str(PRECISIONS[precision]).replace("torch.", ""),
            "device": device_name(dev),
            "numerics_regime": regime,  # "numerics" in provenance holds the determinism flags
        },
    )


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    """Every id that ends a suffix: the tokenizer's EOS and the generation config's (possibly several)."""
    return eos_ids_of(loaded.model, loaded.tokenizer)


def eos_ids_of(model, tokenizer) -> list[int]:
    """:func:`eos_token_ids` of a model and tokenizer loaded by anyone."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    return sorted(ids)
