"""Loading a model revision at a precision, with the numerics settings that make replicas exact.

A model source is a local folder, a Hugging Face hub id (with a ``revision``) or a GGUF file. Weights load
from safetensors or GGUF only unless the caller opts into pickled checkpoints; ``trust_remote_code`` is off
unless the caller turns it on. This module knows nothing of caches, constructions or the ledger.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import struct
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stagereplay.models import invariant

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# Architectures whose every layer keeps a plain full-attention DynamicCache layer: the engine's cache code
# (fingerprints, dumps, transplants) is only correct for those.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


class ModelLoadError(ValueError):
    """A model source that cannot be loaded, with what to do about it."""


# Files a hub snapshot needs: config, tokenizer, chat template, safetensors weights (pickles only when allowed).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]


def revision_slug(name: str) -> str:
    """Filesystem-safe slug of a revision name (no path separators, no leading dots)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-.")
    if not slug:
        raise ValueError(f"revision {name!r} has no filesystem-safe characters; give it a plain name")
    return slug


def set_determinism(threads: int) -> dict:
    """Deterministic algorithms on, TF32 off, CPU threads pinned; returns the flags for provenance.

    On the GPU, replicas of a one-shot prefill were seen to differ without deterministic mode
    (docs/STUDY.md, numerics rules). Filling uninitialised memory is an avoidable cost we switch off.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    torch.set_num_threads(int(threads))
    return numerics_flags()


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
class ModelSource:
    """Where a revision's weights come from."""

    kind: str  # "local" | "gguf" | "hub"
    path: str  # folder, GGUF file, or hub id
    revision: str | None = None  # hub revision
    gguf_file: str | None = None

    def describe(self) -> str:
        if self.kind == "hub":
            return f"{self.path}@{self.revision}"
        if self.kind == "gguf":
            return str(Path(self.path) / self.gguf_file)
        return self.path


def resolve_source(model: str, revision: str | None, base_dir: str | Path = ".") -> ModelSource:
    """Turn the config's ``model`` and one of its ``revisions`` into a concrete source.

    - ``model`` a folder holding a subfolder named ``revision``: that subfolder (how the embedded toy keeps
      its primary and later revisions);
    - ``model`` a folder and ``revision`` a ``.gguf`` file in it, or ``model`` a ``.gguf`` file: GGUF;
    - ``model`` a folder with a ``config.json`` and ``revision`` empty or ``local``: the folder itself;
    - otherwise ``model`` is a hub id and ``revision`` a hub revision (branch, tag or commit).
    """
    base = Path(base_dir)
    candidate = Path(model) if Path(model).is_absolute() else base / model
    if str(model).endswith(".gguf"):
        if not candidate.is_file():
            raise ModelLoadError(f"model: GGUF file {model!r} does not exist; check the path in the config")
        return ModelSource("gguf", str(candidate.parent), gguf_file=candidate.name)
    if candidate.is_dir():
        if revision and str(revision).endswith(".gguf"):
            if not (candidate / revision).is_file():
                raise ModelLoadError(f"revisions: GGUF file {revision!r} not found in {candidate}")
            return ModelSource("gguf", str(candidate), gguf_file=str(revision))
        if revision and (candidate / revision).is_dir():
            return ModelSource("local", str(candidate / revision))
        if (candidate / "config.json").is_file() and revision in (None, "", "local"):
            return ModelSource("local", str(candidate))
        raise ModelLoadError(
            f"revisions: {revision!r} is neither a subfolder of the local model folder {candidate} "
            f"nor a GGUF file in it; name one of: "
            f"{sorted(p.name for p in candidate.iterdir() if p.is_dir() or p.suffix == '.gguf')}"
        )
    looks_like_path = str(model).startswith((".", "/", "~")) or os.sep in str(model).strip("/").replace("/", "", 1)
    if looks_like_path or str(model).count("/") != 1:
        raise ModelLoadError(
            f"model: {model!r} is not an existing folder or GGUF file, nor a hub id of the form 'org/name'; "
            "check the path"
        )
    return ModelSource("hub", str(model), revision=revision or "main")


def go_offline() -> None:
    """No network for the hub, in this process and its children.

    huggingface_hub reads ``HF_HUB_OFFLINE`` once, when it is imported (transformers imports it), so setting
    the variable afterwards alone would leave this process online: the flag it read is set too.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: ModelSource
    precision: str
    device: torch.device
    info: dict = field(default_factory=dict)


def hub_cache_dir() -> str | None:
    """The Hugging Face hub cache, read from the environment at call time (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def fetch_hub_snapshot(source: ModelSource, offline: bool, allow_pickle: bool = False) -> tuple[ModelSource, str]:
    """A hub source as the local snapshot folder holding it, and the commit that revision resolved to.

    Offline, only the local Hugging Face cache is read; online, missing files are downloaded (and a hub that
    cannot be reached falls back to the cache). Only config, tokenizer and safetensors files are fetched.
    """
    from huggingface_hub import snapshot_download

    patterns = HUB_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
    try:
        folder = snapshot_download(source.path, revision=source.revision, cache_dir=hub_cache_dir(),
                                   local_files_only=offline, allow_patterns=patterns)
    except Exception as exc:  # LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, ...
        where = hub_cache_dir() or "the default Hugging Face cache (~/.cache/huggingface/hub)"
        if offline:
            raise ModelLoadError(
                f"model {source.describe()} is not in the local Hugging Face cache ({where}) and offline: true "
                f"forbids downloading it. Download it first on a machine with network access "
                f"(huggingface-cli download {source.path} --revision {source.revision}) into that cache, "
                f"or set offline: false ({type(exc).__name__}: {exc})"
            ) from exc
        raise ModelLoadError(f"cannot fetch {source.describe()} from the hub or find it in {where}: {exc}") from exc
    return ModelSource("local", folder), Path(folder).name


def _require_gguf():
    """gguf-py, or the error that names the optional packages to install."""
    try:
        import gguf
    except ImportError as exc:
        raise ModelLoadError("loading a GGUF file needs the optional packages gguf and accelerate: "
                             "pip install 'stagereplay[gguf]'") from exc
    return gguf


def _plain_gguf_reader_class():
    """gguf-py's ``GGUFReader`` over the file's bytes as a plain numpy array instead of a ``numpy.memmap``.

    The reader cuts every metadata value out of the mapped file as its own small arrays, several slices and views
    per string: for a Qwen2 vocabulary (151,936 tokens and 151,643 merges) millions of them, each of which a
    ``memmap`` (an ndarray subclass) sends through Python (``__getitem__``, ``__array_finalize__``). A plain view of
    the same mapping reads the same bytes, lazily, at a quarter of the time (11.8 s against 2.9 s for that file on
    the 2-core VM). Every field, value and tensor the reader gives is the same; the reader only assigns
    ``self.data`` once, in ``__init__``, before it parses anything."""
    global _PLAIN_GGUF_READER
    if _PLAIN_GGUF_READER is None:
        import numpy as np
        from gguf.gguf_reader import GGUFReader  # the class itself, even while gguf_read_once stands in for it

        class PlainArrayGGUFReader(GGUFReader):
            @property
            def data(self):
                return self._plain_data

            @data.setter
            def data(self, value):
                self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        _PLAIN_GGUF_READER = PlainArrayGGUFReader
    return _PLAIN_GGUF_READER


_PLAIN_GGUF_READER = None
# While :func:`gguf_read_once` is active: gguf-py's reader of a file, and what transformers' load_gguf_checkpoint
# made of it, by ("reader" or "checkpoint", path, size, modification time).
_GGUF_ONCE: dict | None = None


def _file_key(kind: str, path) -> tuple:
    stat = os.stat(path)
    return kind, os.path.realpath(path), stat.st_size, stat.st_mtime_ns


def _gguf_reader(path: str | Path):
    """A parsed GGUFReader of ``path``: the one :func:`gguf_read_once` keeps for it, else a new one."""
    cls = _plain_gguf_reader_class()
    if _GGUF_ONCE is None:
        return cls(str(path))
    key = _file_key("reader", path)
    if key not in _GGUF_ONCE:
        _GGUF_ONCE[key] = cls(str(path))
    return _GGUF_ONCE[key]


def _checkpoint_once(load_gguf_checkpoint):
    """transformers' ``load_gguf_checkpoint``, whose metadata-only result (``return_tensors`` false, the way its
    config and tokenizer loading call it) :func:`gguf_read_once` keeps per file and hands out as a deep copy (the
    callers change what they get); any other call, or any call outside it, is passed through."""

    @functools.wraps(load_gguf_checkpoint)
    def once(gguf_checkpoint_path, *args, **kwargs):
        metadata_only = args in ((), (False,)) and kwargs in ({}, {"return_tensors": False})
        if _GGUF_ONCE is None or not metadata_only:
            return load_gguf_checkpoint(gguf_checkpoint_path, *args, **kwargs)
        key = _file_key("checkpoint", gguf_checkpoint_path)
        if key not in _GGUF_ONCE:
            _GGUF_ONCE[key] = load_gguf_checkpoint(gguf_checkpoint_path)
        return copy.deepcopy(_GGUF_ONCE[key])

    return once


def _rebind_transformers(name: str, old, new) -> None:
    """Point every imported transformers module whose ``name`` is ``old`` at ``new`` (5.17 binds
    ``load_gguf_checkpoint`` in several modules when they are imported, 5.24 imports it where it calls it)."""
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)  # never getattr(module, name): a lazy module would import on it
        if isinstance(names, dict) and str(names.get("__name__", "")).startswith("transformers") \
                and names.get(name) is old:
            names[name] = new


@contextmanager
def gguf_read_once():
    """Within it, a GGUF file's metadata is parsed once and what transformers makes of it is made once, for every
    reader of the file: the architecture check here, and transformers' config and tokenizer loading, each of which
    parses the whole file again through ``load_gguf_checkpoint`` and gguf-py's reader (twice on 5.24 for a model
    config and a tokenizer, three times on 5.17), about 150,000-string arrays each time for a Qwen2 vocabulary.

    Two things are shared, both from the libraries and both read-only: gguf-py's reader of the file (the
    plain-array one above; ``load_gguf_checkpoint`` imports ``gguf.GGUFReader`` when called, which stands for the
    kept reader in here), and ``load_gguf_checkpoint``'s metadata-only result, handed out as a deep copy. transformers
    only reads the reader's fields and tensor list, so what it builds is what it builds on its own
    (``test_the_preflight_of_a_gguf_gives_the_config_and_tokenizer_a_job_loads``). On leaving, ``gguf.GGUFReader``
    and transformers' functions are restored and the cache dropped. Not thread-safe (the preflight is one thread)."""
    global _GGUF_ONCE
    if _GGUF_ONCE is not None:  # inside another: share its cache
        yield
        return
    gguf = _require_gguf()
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original_reader, original_checkpoint = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint

    def reader(path, mode="r"):
        return _gguf_reader(path) if mode == "r" else original_reader(path, mode)

    once = _checkpoint_once(original_checkpoint)
    _GGUF_ONCE = {}
    gguf.GGUFReader = reader
    _rebind_transformers("load_gguf_checkpoint", original_checkpoint, once)
    try:
        yield
    finally:
        gguf.GGUFReader, _GGUF_ONCE = original_reader, None
        _rebind_transformers("load_gguf_checkpoint", once, original_checkpoint)  # those imported in here too


def gguf_architecture(path: str | Path) -> str:
    """The ``general.architecture`` a GGUF file declares, refusing a file that is not whole.

    gguf-py's reader parses the metadata and the tensor table and maps every tensor: a file cut short anywhere
    (in the metadata, the table or the tensor data) does not parse."""
    _require_gguf()
    try:
        field = _gguf_reader(path).get_field("general.architecture")
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file, or is cut short ({type(exc).__name__}: {exc}); "
                             "copy or download it again") from exc
    if field is None:
        raise ModelLoadError(f"{path} declares no general.architecture; it is not a model GGUF file")
    return field.contents()


def _check_gguf(source: ModelSource) -> None:
    path = Path(source.path) / source.gguf_file
    architecture = gguf_architecture(path)
    if architecture not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"GGUF file {path} holds a {architecture!r} model; the cache code supports "
            f"{list(SUPPORTED_MODEL_TYPES)} (decoder-only, every layer full attention): point model at one of those"
        )
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loading needs it)
    except ImportError as exc:
        raise ModelLoadError("loading a GGUF file needs accelerate: pip install 'stagereplay[gguf]'") from exc


def _check_weights_format(source: ModelSource, allow_pickle: bool) -> None:
    if source.kind != "local":
        return
    folder = Path(source.path)
    has_safetensors = any(folder.glob("*.safetensors"))
    has_pickle = any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth"))
    if not has_safetensors and has_pickle and not allow_pickle:
        raise ModelLoadError(
            f"{folder} holds only pickled weights (*.bin/*.pt), which can run code when loaded; convert them "
            "to safetensors, or set allow_pickle: true in the model config if you trust the file"
        )
    if not has_safetensors and not has_pickle:
        raise ModelLoadError(f"{folder} holds no weights (*.safetensors); is this the right folder?")
    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors_file(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a readable safetensors index ({exc}); copy it again") from exc
        absent = sorted(s for s in shards if not (folder / s).is_file())
        if absent:
            raise ModelLoadError(f"{index} names weight files that are not in {folder}: {absent}; copy or "
                                 "download them (every shard the index lists)")


# A safetensors header is JSON of a few KB to a few MB; a larger length means the file is something else.
MAX_SAFETENSORS_HEADER = 100 * 2**20


def check_safetensors_file(path: str | Path) -> None:
    """Refuse a safetensors file that is cut short or is not one, reading its header only (never the weights).

    The file is an 8-byte little-endian header length, the JSON header, then the tensor data; every tensor's
    ``data_offsets`` index into that data, so the file's size must be exactly 8 + header + the largest end.
    A copy or download that stopped early is smaller.
    """
    path = Path(path)
    size = path.stat().st_size
    fix = "copy or download it again"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path} is not a safetensors file (only {size} bytes); {fix}")
        (n_header,) = struct.unpack("<Q", head)
        if n_header > min(MAX_SAFETENSORS_HEADER, size - 8):
            raise ModelLoadError(f"{path} is truncated or not a safetensors file: its header claims {n_header} "
                                 f"bytes of a {size}-byte file; {fix}")
        try:
            header = json.loads(f.read(n_header))
            ends = [int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ModelLoadError(f"{path} has an unreadable safetensors header ({exc}); {fix}") from exc
    expected = 8 + n_header + max(ends, default=0)
    if size != expected:
        raise ModelLoadError(
            f"{path} is {'truncated' if size < expected else 'longer than its header says'}: it has {size} bytes, "
            f"its header describes {expected} ({len(ends)} tensors); {fix}"
        )


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
        _check_gguf(source)
    _check_weights_format(source, allow_pickle)
    common = {"trust_remote_code": trust_remote_code}
    if source.kind == "gguf":
        common["gguf_file"] = source.gguf_file
    try:
        config = AutoConfig.from_pretrained(source.path, **common)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError depending on the cause
        raise ModelLoadError(f"cannot read the model config of {requested.describe()}: {exc}") from exc
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{requested.describe()} is a {model_type!r} model; the cache code supports "
            f"{list(SUPPORTED_MODEL_TYPES)} (decoder-only, every layer full attention): point model at one of those"
        )
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ModelLoadError(
            f"{requested.describe()} uses sliding-window attention, which the cache code does not support"
        )
    return source, resolved_commit, config, common


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
    ids = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    gen_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    return sorted(ids)
