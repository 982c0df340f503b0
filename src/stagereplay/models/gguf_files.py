"""Reading a GGUF file: gguf-py's reader, parsed once per process for every reader of the file
(:func:`gguf_read_once`), and the checks a GGUF source gets before anything loads it.

Imports no torch; transformers only inside :func:`gguf_read_once`.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from stagereplay.models.sources import SUPPORTED_MODEL_TYPES, ModelLoadError, ModelSource

def require_gguf():
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


def gguf_reader(path: str | Path):
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
    gguf = require_gguf()
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original_reader, original_checkpoint = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint

    def reader(path, mode="r"):
        return gguf_reader(path) if mode == "r" else original_reader(path, mode)

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
    require_gguf()
    try:
        field = gguf_reader(path).get_field("general.architecture")
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file, or is cut short ({type(exc).__name__}: {exc}); "
                             "copy or download it again") from exc
    if field is None:
        raise ModelLoadError(f"{path} declares no general.architecture; it is not a model GGUF file")
    return field.contents()


@functools.lru_cache(maxsize=None)
def dequantizable(qtype) -> bool:
    """Whether gguf-py dequantises a block of ``qtype`` into the values it holds (it raises for some types it knows,
    and an older gguf-py gives an empty array for some others)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    block, size = GGML_QUANT_SIZES[qtype]
    try:
        return dequantize(np.zeros((1, size), dtype=np.uint8), qtype).size == block
    except Exception:  # NotImplementedError, or whatever a half-supported type raises
        return False


def unreadable_gguf_tensors(reader) -> list[str]:
    """The tensors of a parsed GGUF file that cannot be dequantised, each with its type and why, from the header
    alone: a type gguf-py cannot dequantise, or rows whose length is not a whole number of the type's blocks."""
    from gguf import GGML_QUANT_SIZES

    found = []
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        if not dequantizable(qtype):
            found.append(f"{tensor.name} ({qtype.name}, which gguf-py cannot dequantise)")
            continue
        block = GGML_QUANT_SIZES[qtype][0]
        row = int(tensor.shape[0])  # the GGUF order: the length of a row first
        if row % block or not row:
            found.append(f"{tensor.name} ({qtype.name}, rows of {row} values: not a whole number of its "
                         f"{block}-value blocks)")
    return found


def check_gguf(source: ModelSource) -> None:
    path = Path(source.path) / source.gguf_file
    architecture = gguf_architecture(path)
    if architecture not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"GGUF file {path} holds a {architecture!r} model; the cache code supports "
            f"{list(SUPPORTED_MODEL_TYPES)} (decoder-only, every layer full attention): point model at one of those"
        )
    unreadable = unreadable_gguf_tensors(gguf_reader(path))
    if unreadable:
        from importlib.metadata import version

        shown = ", ".join(unreadable[:8]) + (f" and {len(unreadable) - 8} more" if len(unreadable) > 8 else "")
        raise ModelLoadError(
            f"GGUF file {path}: {len(unreadable)} tensors cannot be read (transformers dequantises a GGUF through "
            f"gguf-py {version('gguf')}): {shown}. Use a file quantised to a type it reads (F32, F16, BF16, Q8_0, "
            "Q4_K, Q6_K, ...), or a newer gguf package where it reads this type"
        )
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loading needs it)
    except ImportError as exc:
        raise ModelLoadError("loading a GGUF file needs accelerate: pip install 'stagereplay[gguf]'") from exc




@contextmanager
def gguf_name_maps_once():
    """gguf-py's ``get_tensor_name_map`` made once per (architecture, layers) while transformers' name map is made:
    ``get_gguf_hf_weights_map`` calls it again for every submodule (319 times at 24 layers, 4 s on the 2-core VM;
    quadratic in the layers). The map is read only; the names it gives are the same."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def unused_gguf_tensors(model, path: str | Path) -> list[str]:
    """The tensors of the GGUF file ``path`` that give no parameter of ``model`` (loaded from it), with the parameter
    they would map to where there is one. transformers' ``load_gguf_checkpoint`` skips such a tensor without a word:
    Qwen2's six ``attn_{q,k,v}.bias`` tensors in a file labelled ``llama`` were dropped and the logits changed."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    reader = gguf_reader(path)
    architecture = gguf_utils.read_field(reader, "general.architecture")[0]
    # the name map does not depend on the processor's config (only the tensor processing does)
    processor = gguf_utils.TENSOR_PROCESSORS.get(architecture, gguf_utils.TensorProcessor)(config={})
    with gguf_name_maps_once():
        name_map = gguf_utils.get_gguf_hf_weights_map(model, processor)
    parameters = set(model.state_dict())
    return sorted(t.name for t in reader.tensors if name_map.get(t.name) not in parameters)
