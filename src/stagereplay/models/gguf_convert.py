"""A GGUF file converted to safetensors snapshots directly: one read of the file, every precision written from it.

:func:`convert_gguf` makes, for each requested precision, the folder that ``save_pretrained`` of the model
``load_model`` gives for the GGUF file would make (weights, config.json, generation_config.json, tokenizer files),
without building the model: it holds the largest tensor dequantised in float32 and one cast copy of it, not the
whole dequantised model that loading holds (about 45 GB at 14B bf16), and parses the file's metadata once
(:func:`~stagereplay.models.gguf_files.gguf_read_once`). Its digests are the snapshot manifest's
(:func:`stagereplay.io.fingerprints.tensor_digest`).

What it takes from the libraries, so that it makes what they make:

- the config and the tokenizer: ``checked_config`` and ``checked_tokenizer`` of :mod:`~stagereplay.models.loading`
  (transformers' ``AutoConfig`` / ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``, with loading's checks);
- the parameter names, shapes and which tensors a file holds: the model class built from that config on the
  ``meta`` device (no memory), and transformers' own ``remove_tied_weights_from_state_dict`` (a tied lm_head is not
  written) and ``split_torch_state_dict_into_shards`` (save_pretrained's shards, one file below 50 GB);
- the GGUF -> parameter name map and the per-architecture tensor processing (the llama Q/K permutation): the
  legacy GGUF loader's ``get_gguf_hf_weights_map`` and ``TENSOR_PROCESSORS``, called as ``load_gguf_checkpoint``
  calls them (the same in transformers 5.17 and 5.24);
- the values: gguf-py's ``dequantize`` to float32, then ``torch.Tensor.to(dtype)``, as ``load_gguf_checkpoint``;
- config.json and generation_config.json: ``save_pretrained`` of the meta model with no tensors.

The safetensors files are written here, header first (safetensors' layout: metadata ``{"format": "pt"}``, tensors
ordered by dtype then name, the header padded with spaces to 8 bytes) then each tensor's bytes as it is made, its
sha256 (:func:`tensor_digest`'s format) and the file's taken on the way.

What it does not know: architectures other than those ``loading`` supports, processors that merge or rename
tensors (MoE experts; refused), ``_keep_in_fp32_modules`` (refused), and how a later transformers release may load
a GGUF differently (5.24 loads qwen3.5/lfm2 another way): the caller's proof by loading the snapshot back is what
says the result still equals ``load_model``. A GGUF tensor that maps to no parameter, or a parameter no tensor
gives (but a tied lm_head), fails the conversion before anything is written, naming them.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
import shutil
import struct
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from stagereplay.io.fingerprints import tensor_digest, weights_sha256
from stagereplay.models.gguf_files import gguf_name_maps_once, gguf_read_once, gguf_reader
from stagereplay.models.loading import PRECISIONS, checked_config, checked_tokenizer
from stagereplay.models.sources import ModelLoadError, ModelSource

# safetensors' names of the dtypes a snapshot holds, and their rank in its Dtype enum (it writes tensors in
# descending rank, then by name)
SAFETENSORS_DTYPES = {torch.float16: ("F16", 11), torch.bfloat16: ("BF16", 12), torch.float32: ("F32", 15)}
SAFETENSORS_METADATA = {"format": "pt"}
NAMED = 8  # how many tensor names an error lists
# A matrix is dequantised this many values at a time into its float32 array (gguf-py's kernel holds a second copy
# of what it is given while it works): the same values, the float32 matrix and a slice of it in memory.
CHUNK_VALUES = 1 << 24
MAX_SHARD_SIZE = None  # save_pretrained's own default (50 GB in 5.17 and 5.24) where None


class GGUFConvertError(ModelLoadError):
    """A GGUF file whose tensors are not exactly the parameters its config describes, or that this cannot convert."""


def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _named(names) -> str:
    names = sorted(names)
    return ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")


# ---- safetensors, written as the library writes it --------------------------------------------------------------
def safetensors_layout(tensors: dict[str, tuple[torch.dtype, tuple]]) -> tuple[bytes, list[str]]:
    """The header (length prefix included) of a safetensors file of ``tensors`` (name: (dtype, shape)) and the order
    their bytes follow it in, as ``safetensors.torch.save_file(..., metadata={"format": "pt"})`` writes them."""
    unknown = sorted(n for n, (dtype, _) in tensors.items() if dtype not in SAFETENSORS_DTYPES)
    if unknown:
        raise GGUFConvertError(f"tensors of a dtype this writer does not know: {_named(unknown)}")
    order = sorted(tensors, key=lambda n: (-SAFETENSORS_DTYPES[tensors[n][0]][1], n))
    entries, offset = {"__metadata__": SAFETENSORS_METADATA}, 0
    for name in order:
        dtype, shape = tensors[name]
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype][0], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header, order


class _Output:
    """One precision's weight files: each opened with its header written, each tensor's bytes written where the
    header puts them (so tensors may come in any order) and its :func:`tensor_digest` taken. A file's sha256 is taken
    on the way where its tensors come in its own order (always, unless another precision's shards order the walk)."""

    def __init__(self, out: Path, dtype: torch.dtype, shards: dict[str, dict[str, tuple]], file_digests: bool):
        self.dtype, self.paths, self.fds, self.where, self.tensors, self.files = dtype, [], [], {}, {}, {}
        self.order, self.pending, self.digests = [], [], []
        try:
            for i, (name, tensors) in enumerate(shards.items()):
                header, order = safetensors_layout(tensors)
                self.paths.append(out / name)
                self.fds.append(os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666))
                _pwrite(self.fds[i], header, 0)
                offset = len(header)
                for n in order:
                    self.where[n] = (i, offset)
                    offset += int(np.prod(tensors[n][1], dtype=np.int64)) * dtype.itemsize
                self.order += order
                self.pending.append(list(reversed(order)))
                self.digests.append(hashlib.sha256(header) if file_digests else None)
        except BaseException:
            self.abandon()
            raise

    def add(self, name: str, values: torch.Tensor) -> None:
        t = values.to(self.dtype)  # as load_gguf_checkpoint: torch.from_numpy(...).to(torch_dtype)
        raw, self.tensors[name] = _raw(t), tensor_digest(t)
        i, offset = self.where[name]
        _pwrite(self.fds[i], raw, offset)
        in_order = self.pending[i][-1] == name
        self.pending[i].remove(name)
        if self.digests[i] is not None:
            if in_order:
                self.digests[i].update(raw)
            else:
                self.digests[i] = None  # out of the file's order: the caller hashes the file
        if not self.pending[i]:
            os.close(self.fds[i])
            self.fds[i] = None
            if self.digests[i] is not None:
                self.files[self.paths[i].name] = self.digests[i].hexdigest()

    def abandon(self) -> None:
        for i, fd in enumerate(self.fds):
            if fd is not None:
                os.close(fd)
                self.fds[i] = None
        for path in self.paths:
            path.unlink(missing_ok=True)


def _pwrite(fd: int, data, offset: int) -> None:
    data = memoryview(data).cast("B")
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


# ---- What transformers makes of the file -------------------------------------------------------------------------
def _meta_model(config, dtype: torch.dtype):
    """The model class ``from_pretrained`` builds for ``config``, on the meta device (no memory), in ``dtype``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype, attn_implementation="eager")
    if getattr(model, "_keep_in_fp32_modules", None):
        raise GGUFConvertError(f"{type(model).__name__} keeps modules in float32 ({model._keep_in_fp32_modules}), "
                               "which this converter does not do; load the GGUF instead")
    return model


def _saved_tensors(model) -> dict[str, tuple[torch.dtype, tuple]]:
    """The tensors ``save_pretrained`` writes for ``model`` (a tied lm_head dropped), by name: (dtype, shape), in the
    order it splits them into shards (its ``revert_weight_conversion`` sorts them, as it does for a model loaded from
    a GGUF file, which ``from_pretrained`` leaves with no weight conversion matched: ``_weight_conversions = []``)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model._weight_conversions = []
    state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(model.state_dict(), model))
    return {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}


def _shards(model, tensors: dict[str, tuple]) -> tuple[dict[str, dict[str, tuple]], dict | None]:
    """save_pretrained's split of the weights into files (its default shard size) and the index it writes, if any."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import PreTrainedModel

    limit = MAX_SHARD_SIZE or inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (dtype, shape) in tensors.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=limit)
    shards = {file: {n: tensors[n] for n in names} for file, names in split.filename_to_tensors.items()}
    index = None
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
    return shards, index


def _write_configs(model, out: Path) -> None:
    """config.json and generation_config.json as ``save_pretrained`` writes them (it writes no weights here)."""
    from transformers.utils import logging as hf_logging

    scratch = out / ".configs"
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(scratch, state_dict={})
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    for name in ("config.json", "generation_config.json"):
        if (scratch / name).exists():
            os.replace(scratch / name, out / name)
    shutil.rmtree(scratch)


def _read(f, tensor, path) -> np.ndarray:
    """A tensor's bytes, read from the file into memory of its own, shaped as gguf-py's reader shapes them (read,
    not mapped: the file's pages do not stay in the process's memory as the walk goes on)."""
    buf = bytearray(tensor.data.nbytes)
    f.seek(tensor.data_offset)
    if f.readinto(buf) != len(buf):
        raise GGUFConvertError(f"{path} is cut short in tensor {tensor.name}; copy or download it again")
    return np.frombuffer(buf, dtype=tensor.data.dtype).reshape(tensor.data.shape)


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """gguf-py's ``dequantize`` of ``data``, a matrix's rows :data:`CHUNK_VALUES` values at a time (blocks never
    span rows: each row's values are what dequantising the whole matrix gives)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_from_byte_shape

    if qtype == GGMLQuantizationType.F32 or data.ndim != 2:
        return dequantize(data, qtype)
    cols = data.shape[1] if qtype == GGMLQuantizationType.F16 else quant_shape_from_byte_shape(data.shape, qtype)[1]
    step = max(1, CHUNK_VALUES // cols)
    if data.shape[0] <= step:
        return dequantize(data, qtype)
    out = np.empty((data.shape[0], cols), dtype=np.float32)
    for start in range(0, data.shape[0], step):
        out[start:start + step] = dequantize(data[start:start + step], qtype)
    return out


def _tensor(f, path: Path, tensor, processor, name_map: dict) -> torch.Tensor:
    """One GGUF tensor as ``load_gguf_checkpoint`` makes it before the cast: dequantised to float32 by gguf-py,
    then transformers' processing for the architecture (the llama Q/K permutation)."""
    aside = {"tensors": {}}  # where the MoE processors put what they merge
    result = processor.process(weights=_dequantize(_read(f, tensor, path), tensor.tensor_type), name=tensor.name,
                               tensor_key_mapping=name_map, parsed_parameters=aside)
    if result.name != tensor.name or aside["tensors"]:
        raise GGUFConvertError(f"transformers' {type(processor).__name__} renames or merges {tensor.name} "
                               f"({result.name}); this converter does not follow that")
    weights = result.weights
    if not weights.flags.writeable:
        weights = np.copy(weights)  # as load_gguf_checkpoint (torch wants memory it may write)
    return torch.from_numpy(weights)


def _plan(reader, name_map: dict[str, str], wanted: dict[str, tuple], tied: dict[str, str]) -> dict[str, object]:
    """Parameter name -> the GGUF tensor that gives it; refuses leftovers, missing parameters and other shapes."""
    by_param, leftover, twice, shapes = {}, [], [], []
    for tensor in reader.tensors:
        target = name_map.get(tensor.name)
        if target is None or target not in wanted:
            leftover.append(tensor.name + (f" (-> {target}, tied to {tied[target]})" if target in tied else ""))
        elif target in by_param:
            twice.append(f"{target} ({by_param[target].name}, {tensor.name})")
        else:
            by_param[target] = tensor
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            if shape != wanted[target][1]:
                shapes.append(f"{tensor.name} -> {target} ({list(shape)} in the file, {list(wanted[target][1])} "
                              "by the config)")
    missing = sorted(set(wanted) - set(by_param))
    problems = []
    if leftover:
        problems.append(f"{len(leftover)} GGUF tensors map to no parameter of the config's model: {_named(leftover)}")
    if missing:
        problems.append(f"{len(missing)} parameters the config needs are not in the file: {_named(missing)}")
    if twice:
        problems.append(f"parameters given by two tensors: {_named(twice)}")
    if shapes:
        problems.append(f"tensors of another shape than the config gives: {_named(shapes)}")
    if problems:
        raise GGUFConvertError("; ".join(problems))
    return by_param


def convert_gguf(path: str | Path, outs: dict[str, str | Path], *, file_digests: bool = True) -> dict:
    """Convert the GGUF file ``path`` into one snapshot folder per precision (``outs``: precision -> folder, made if
    missing), reading the file once. Each folder gets the weights (model.safetensors, or save_pretrained's shards
    and index beyond 50 GB), config.json, generation_config.json and the tokenizer's files.

    Returns, per precision: ``tensors`` (name -> :func:`tensor_digest` of every tensor written), ``weights_sha256``
    (:func:`weights_sha256` of those), ``tied`` (parameter -> the written one it is tied to, not written itself),
    ``files`` (weight file -> sha256 of its bytes, taken while writing; empty unless ``file_digests``),
    ``tokenizer_class`` (load the folder's tokenizer as that class, verbatim), ``dtype``, ``model_type`` and
    ``cpu_seconds`` (process CPU time of the metadata part and of the tensor walk, for all precisions together).
    Raises :class:`GGUFConvertError` (a ModelLoadError) before writing weights for a file whose tensors are not the
    config's parameters; on any failure the weight files written so far are removed."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    path = Path(path)
    outs = {precision: Path(out) for precision, out in outs.items()}
    bad = sorted(p for p in outs if p not in PRECISIONS)
    if bad or not outs:
        raise GGUFConvertError(f"precisions {bad or '(none)'}: each must be one of {sorted(PRECISIONS)}")
    source = ModelSource("gguf", str(path.parent), gguf_file=path.name)
    started = time.process_time()
    with gguf_read_once():  # config, tokenizer and the processors' config from one parse of the metadata
        _, _, config, common = checked_config(source)
        reader = gguf_reader(path)
        parsed = gguf_utils.load_gguf_checkpoint(str(path))["config"]  # metadata only, as its config loading does
        architecture = gguf_utils.read_field(reader, "general.architecture")[0]
        processor = gguf_utils.TENSOR_PROCESSORS.get(architecture, gguf_utils.TensorProcessor)(config=parsed)
        models = {p: _meta_model(config, PRECISIONS[p]) for p in outs}
        saved = {p: _saved_tensors(model) for p, model in models.items()}
        first, wanted = models[next(iter(outs))], saved[next(iter(outs))]
        tied = {name: source_name for name, source_name in _tied(first).items() if name not in wanted}
        try:
            with gguf_name_maps_once():
                name_map = gguf_utils.get_gguf_hf_weights_map(first, processor)
        except NotImplementedError as exc:  # a model type gguf-py has no tensor names for (as load_model fails)
            raise GGUFConvertError(f"cannot map the tensors of {path}: {exc}") from exc
        by_param = _plan(reader, name_map, wanted, tied)  # refused here, before the tokenizer is built
        tokenizer = checked_tokenizer(source, source, common, getattr(config, "vocab_size", None))
    tokenizer_class = type(tokenizer).__name__
    outputs, seconds = {}, {}
    try:
        for precision, out in outs.items():
            out.mkdir(parents=True, exist_ok=True)
            model = models[precision]
            shards, index = _shards(model, saved[precision])
            outputs[precision] = _Output(out, PRECISIONS[precision], shards, file_digests)
            _write_configs(model, out)
            tokenizer.save_pretrained(out)
            if index is not None:
                (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        del reader, tokenizer  # the metadata they hold (the vocabulary) is not needed for the walk
        seconds["metadata"] = round(time.process_time() - started, 3)
        started = time.process_time()
        # The walk follows the widest precision's files (one dtype per file: the same order at every precision
        # unless one of them is sharded), so that the digest of the most bytes comes without reading them again.
        with open(path, "rb") as f:
            for name in max(outputs.values(), key=lambda o: o.dtype.itemsize).order:
                values = _tensor(f, path, by_param[name], processor, name_map)
                if tuple(values.shape) != wanted[name][1]:
                    raise GGUFConvertError(f"{by_param[name].name} dequantises to {list(values.shape)}, {name} is "
                                           f"{list(wanted[name][1])}")
                for output in outputs.values():
                    output.add(name, values)
                del values
    except BaseException:
        for output in outputs.values():
            output.abandon()
        raise
    seconds["tensors"] = round(time.process_time() - started, 3)
    return {precision: {"tensors": output.tensors, "weights_sha256": weights_sha256(output.tensors), "tied": tied,
                        "files": output.files, "tokenizer_class": tokenizer_class,
                        "dtype": str(PRECISIONS[precision]).replace("torch.", ""), "model_type": config.model_type,
                        "cpu_seconds": seconds}
            for precision, output in outputs.items()}


def _tied(model) -> dict[str, str]:
    """Parameter name -> the first name of the same parameter (the tied lm_head -> embed_tokens)."""
    named, first = list(model.named_parameters(remove_duplicate=False)), {}
    for name, param in named:
        first.setdefault(id(param), name)
    return {name: first[id(param)] for name, param in named if first[id(param)] != name}
