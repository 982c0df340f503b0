"""The llama.cpp engine: a GGUF file's boundary state built by llama.cpp itself (through ``llama-cpp-python``, the
optional extra ``engines``) in each of four constructions, continued greedily, with replicas that must be exact.

The constructions run the forwards of the pipeline's own constructions (:mod:`stagereplay.experiments.constructions`)
over the same ids, each forward one ``llama_decode`` call:

- ``live``: the prompt in one batch, then the stage one token per call: the cache llama.cpp's own generation of these
  ids holds (the pipeline's ``incremental`` schedule; the ids are the fixed prefix's, not the engine's choices).
- ``prefill``: every boundary-cache id in one batch, in a cleared context.
- ``prompt_cache``: the prompt in one batch, the context's state saved (``save_state``), the context cleared and the
  state restored (``load_state``), then the stage in one batch: a server's prompt cache.
- ``chunked``: every boundary-cache id in pieces of ``chunk_size`` tokens, one call each: a server's ``n_batch``.

The boundary state is the pipeline's (docs/STUDY.md): the cache over the prefix but its last token, which is fed as
the first suffix step. Every suffix step is one single-token call whose last-position logits (float32, llama.cpp's
own) give the greedy id (lowest index on ties) and the top-2 margin. The KV cache type (``f16`` or ``f32``) is the
precision factor: the ledger's ``precision`` is ``kv_f16`` or ``kv_f32``; weights and activations are the GGUF's and
llama.cpp's own.

Fingerprints are of the sequence's state as llama.cpp writes it (``llama_state_seq_get_data``): the whole blob
(cell positions and every layer's K and V bytes in the cache's type and cell layout), and each layer's K and V bytes.
They compare engine rows with engine rows only; the pipeline's own fingerprints hash torch tensors.

Knows nothing of items beyond the ledger row it fills, nothing of Snakemake and nothing of the report.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from stagereplay.decode.greedy import RowResult
from stagereplay.decode.plans import Batch
from stagereplay.experiments import constructions as registry
from stagereplay.experiments.recipe import ReplicaMismatchError
from stagereplay.experiments.rows import LEDGER_SCHEMA, RunSettings, ledger_row

ENGINE = "llama_cpp"
EXPERIMENT = "engine_llama_cpp"  # the ledger's experiment of every row made here
BINDING = "llama-cpp-python"
BINDING_VERSION = "0.3.36"  # the version the extra pins, and the one whose state layout the parser below reads
INSTALL = 'pip install -e ".[engines]"'
KV_TYPES = ("f16", "f32")
DECODE_REGIME = "llama_cpp"  # the ledger's decode_regime: the engine's kernels are part of the construction


def precision_of(kv_type: str) -> str:
    """The ledger's precision of a KV cache type: ``kv_f16`` or ``kv_f32``."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type {kv_type!r}: llama.cpp's KV cache types here are {list(KV_TYPES)}")
    return f"kv_{kv_type}"


@dataclass(frozen=True)
class EngineConstruction:
    name: str
    label: str
    forwards_of: str  # the pipeline's construction whose forwards it runs
    restores_prompt: bool = False  # the prompt's state is saved and restored after the prompt's forward


CONSTRUCTIONS = {c.name: c for c in (
    EngineConstruction("live", "llama.cpp token by token", "incremental"),
    EngineConstruction("prefill", "llama.cpp one batch", "prefill"),
    EngineConstruction("prompt_cache", "llama.cpp prompt cache (save_state/load_state)", "prefix_cached", True),
    EngineConstruction("chunked", "llama.cpp chunked (n_batch pieces)", "chunked"),
)}

# Per row, beside the ledger's columns: the engine and the context that made it.
ENGINE_FIELDS = [
    ("engine", pa.string()),
    ("binding_version", pa.string()),  # llama-cpp-python
    ("llama_cpp_commit", pa.string()),  # the vendored llama.cpp's commit, as ggml_commit() reports it
    ("ggml_version", pa.string()),
    ("system_info", pa.string()),  # llama_print_system_info(): the backends and CPU features it was built with
    ("kv_type", pa.string()),
    ("n_ctx", pa.int32()),
    ("n_batch", pa.int32()),
    ("n_ubatch", pa.int32()),
    ("n_threads", pa.int32()),
    ("n_gpu_layers", pa.int32()),  # offload: 0 none, -1 every layer
    ("flash_attn", pa.bool_()),
    ("chunk_size", pa.int32()),  # the chunked construction's pieces
]
ENGINE_LEDGER_SCHEMA = pa.schema([*LEDGER_SCHEMA, *ENGINE_FIELDS])


class EngineUnavailableError(ImportError):
    """The binding is not installed, or is a version without what the engine needs."""


class EngineRefusedError(ValueError):
    """llama.cpp refuses the file (an architecture it cannot run, a GGUF it cannot read) or exposes no logits."""


def require_binding():
    """The ``llama_cpp`` module, or an error naming the command that installs it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise EngineUnavailableError(
            f"the llama.cpp engine needs {BINDING}=={BINDING_VERSION}, which is not installed ({exc}); install it "
            f"with {INSTALL} (it builds llama.cpp from source: 5 to 14 minutes on 2 CPU cores; with CUDA on a GPU "
            'node: CMAKE_ARGS="-DGGML_CUDA=on" ' + INSTALL + "; docs/ENGINES.md)") from exc
    needed = ("llama_get_logits_ith", "llama_state_seq_get_size", "llama_state_seq_get_data", "llama_memory_clear",
              "llama_get_memory", "llama_vocab_is_eog", "llama_log_set")
    missing = [name for name in needed if not hasattr(llama_cpp, name)]
    if missing:
        raise EngineUnavailableError(
            f"{BINDING} {getattr(llama_cpp, '__version__', '?')} lacks {missing}; the engine needs "
            f"{BINDING}=={BINDING_VERSION}: {INSTALL}")
    return llama_cpp


@dataclass(frozen=True)
class EngineSettings:
    """The context every construction runs in: one per KV type, recorded on every row."""

    kv_type: str = "f16"
    n_ctx: int = 1024
    n_batch: int | None = None  # None: n_ctx, so that a one-batch prefill is one call
    n_ubatch: int | None = None  # None: n_batch, so that it is one ubatch too
    threads: int = 1
    n_gpu_layers: int = 0
    flash_attn: bool = False
    chunk_size: int = 16

    def __post_init__(self):
        precision_of(self.kv_type)
        for key in ("n_ctx", "n_batch", "n_ubatch", "threads", "chunk_size"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"llama_cpp.{key} is {value!r}; it must be a whole number, at least 1")
        if self.batch > self.n_ctx or self.ubatch > self.batch:
            raise ValueError(f"llama_cpp: need n_ubatch ({self.ubatch}) <= n_batch ({self.batch}) <= n_ctx "
                             f"({self.n_ctx})")

    @property
    def batch(self) -> int:
        return self.n_ctx if self.n_batch is None else self.n_batch

    @property
    def ubatch(self) -> int:
        return self.batch if self.n_ubatch is None else self.n_ubatch


def _sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


def state_fingerprints(blob: bytes) -> tuple[str, list[str], list[str]]:
    """(sha256 of the whole sequence state, each layer's K bytes', each layer's V bytes') of what
    ``llama_state_seq_get_data`` wrote for one sequence: magic, seq id, streams; per stream its cells (position,
    sequence ids), then per layer K (type, row size, rows), then per layer V (rows, or by element when transposed).
    Refuses a blob it does not read to its last byte (a llama.cpp of another layout)."""
    view, at = memoryview(blob), 0

    def take(fmt: str):
        nonlocal at
        values = struct.unpack_from("<" + fmt, view, at)
        at += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def data(size: int) -> memoryview:
        nonlocal at
        if at + size > len(view):
            raise EOFError
        at += size
        return view[at - size:at]

    ks, vs = [], []
    try:
        take("I")  # the io magic
        take("i")  # the sequence id
        for _ in range(take("I")):  # streams
            cells = take("I")
            if not cells:
                continue
            if ks:
                raise EngineRefusedError("the sequence's cells lie in more than one KV stream; the engine runs one")
            for _ in range(cells):
                take("i")  # position
                data(4 * take("I"))  # its sequence ids
            transposed, n_layers = take("II")
            for _ in range(n_layers):
                take("i")  # ggml type
                ks.append(_sha(data(cells * take("Q"))))
            for _ in range(n_layers):
                take("i")
                if transposed:
                    element, width = take("II")
                    vs.append(_sha(data(cells * element * width)))
                else:
                    vs.append(_sha(data(cells * take("Q"))))
    except (struct.error, EOFError):
        at = -1
    if at != len(view):
        raise EngineRefusedError(
            f"llama.cpp's sequence state ({len(view)} bytes) is not in the layout this reader knows ({BINDING} "
            f"{BINDING_VERSION}'s llama.cpp); install that version: {INSTALL}")
    return _sha(view), ks, vs


class _LogCapture:
    """llama.cpp's log lines while loading a file: its reason for refusing one is logged, not raised."""

    def __init__(self, llama_cpp):
        self.lines: list[str] = []
        self._lib = llama_cpp

        @llama_cpp.llama_log_callback
        def collect(level, text, user_data):
            self.lines.append(text.decode("utf-8", "replace"))

        self._callback = collect  # kept alive while llama.cpp holds it

    def __enter__(self):
        self._lib.llama_log_set(self._callback, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc):
        from llama_cpp import _logger  # the binding's own callback, which it sets on import

        self._lib.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))

    def errors(self) -> str:
        lines = [line.strip() for line in "".join(self.lines).splitlines()]
        wanted = [line for line in lines if any(w in line.lower() for w in ("error", "failed"))]
        return "; ".join(wanted[-4:]) or "(llama.cpp logged no reason)"


def _ggml_string(name: str) -> str:
    """ggml's ``ggml_version()`` or ``ggml_commit()`` (the vendored llama.cpp's commit), read from its library."""
    try:
        from llama_cpp import _ggml

        function = getattr(_ggml.libggml, name)
        function.restype = ctypes.c_char_p
        return function().decode()
    except (ImportError, AttributeError, OSError):
        return "unknown"


class LlamaCppEngine:
    """One GGUF file in one llama.cpp context (:class:`EngineSettings`). Use as a context manager, or ``close()``."""

    def __init__(self, path: str | Path, settings: EngineSettings):
        llama_cpp = require_binding()
        self._lib, self.settings, self.path = llama_cpp, settings, Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[settings.kv_type]
        with _LogCapture(llama_cpp) as log:
            try:
                self.llm = llama_cpp.Llama(
                    str(self.path), n_ctx=settings.n_ctx, n_batch=settings.batch, n_ubatch=settings.ubatch,
                    n_threads=settings.threads, n_threads_batch=settings.threads, n_gpu_layers=settings.n_gpu_layers,
                    flash_attn=settings.flash_attn, type_k=kv, type_v=kv, logits_all=False, verbose=False)
            except (ValueError, RuntimeError) as exc:
                raise EngineRefusedError(self._refusal(log.errors(), exc)) from exc
        self.n_vocab = self.llm.n_vocab()
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._probe()

    def _refusal(self, reason: str, exc: Exception) -> str:
        architecture = "?"
        with contextlib.suppress(Exception):
            from stagereplay.models.gguf_files import gguf_architecture

            architecture = gguf_architecture(self.path)
        return (f"llama.cpp ({BINDING} {self._lib.__version__}, llama.cpp {_ggml_string('ggml_commit')}) "
                f"refuses {self.path} (general.architecture {architecture!r}): {reason} [{exc}]. llama.cpp must run "
                "the file's architecture and find every tensor it needs, in a type it reads")

    def _probe(self) -> None:
        """One token through the context before any work: llama.cpp must expose its logits."""
        self._clear()
        self.llm.eval([0])
        self._logits()
        self._clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.close()

    def provenance(self) -> dict:
        """What every row records of the engine and its context."""
        s = self.settings
        return {"engine": ENGINE, "binding_version": self._lib.__version__,
                "llama_cpp_commit": _ggml_string("ggml_commit"),
                "ggml_version": _ggml_string("ggml_version"),
                "system_info": self._lib.llama_print_system_info().decode("utf-8", "replace").strip(),
                "kv_type": s.kv_type, "n_ctx": self.llm.n_ctx(), "n_batch": s.batch, "n_ubatch": s.ubatch,
                "n_threads": s.threads, "n_gpu_layers": s.n_gpu_layers, "flash_attn": s.flash_attn,
                "chunk_size": s.chunk_size}

    def _clear(self) -> None:
        """An empty context: no cells, and the cache buffers zeroed, as a fresh context's."""
        self.llm.reset()
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.llm.ctx), True)

    def _eval(self, ids: list[int]) -> None:
        if len(ids) > self.settings.batch:
            raise ValueError(f"a forward of {len(ids)} tokens exceeds n_batch {self.settings.batch}: llama.cpp "
                             "would split it; raise llama_cpp.n_batch")
        self.llm.eval(ids)

    def _logits(self) -> np.ndarray:
        pointer = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        if not pointer:
            raise EngineRefusedError(f"llama.cpp exposes no logits for {self.path} (an embedding or pooling "
                                     "model?); stage replay needs the last position's logits at every step")
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).astype(np.float32, copy=True)  # (vocab,)

    def sequence_state(self) -> bytes:
        """The sequence's state as llama.cpp writes it (``llama_state_seq_get_data``): what the fingerprints hash."""
        size = self._lib.llama_state_seq_get_size(self.llm.ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = self._lib.llama_state_seq_get_data(self.llm.ctx, buffer, size, 0)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return bytes(buffer)

    def build(self, construction: str, prompt_ids: list[int], stage_ids: list[int]) -> None:
        """The boundary cache of ``construction``: every prefix id but the last, in the construction's forwards."""
        c = get(construction)
        ids = list(prompt_ids) + list(stage_ids[:-1])
        sizes = registry.get(c.forwards_of).segments(len(prompt_ids), len(stage_ids) - 1, self.settings.chunk_size)
        self._clear()
        start = 0
        for i, size in enumerate(sizes):
            self._eval(ids[start:start + size])
            start += size
            if c.restores_prompt and i == 0:
                saved = self.llm.save_state()
                self._clear()
                self.llm.load_state(saved)
        assert start == len(ids), (sizes, len(ids))

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def replay(self, construction: str, prompt_ids: list[int], stage_ids: list[int],
               max_new_tokens: int) -> RowResult:
        """One run from scratch: build, fingerprint the boundary cache, continue greedily from the pending token."""
        if not stage_ids:
            raise ValueError("a replay needs the stage's ids, the boundary token last")
        if len(prompt_ids) + len(stage_ids) + max_new_tokens > self.llm.n_ctx():
            raise ValueError(f"{len(prompt_ids)} prompt + {len(stage_ids)} stage + {max_new_tokens} suffix tokens "
                             f"exceed llama_cpp.n_ctx {self.llm.n_ctx()}")
        self.build(construction, prompt_ids, stage_ids)
        fingerprints = state_fingerprints(self.sequence_state())
        suffix, margins, stop = [], [], "max_new_tokens"
        token = stage_ids[-1]
        for _ in range(max_new_tokens):
            self._eval([token])
            logits = self._logits()
            if not np.isfinite(logits).all():
                stop = "nonfinite"
                break
            token = int(np.argmax(logits))  # lowest index on ties
            second, first = np.partition(logits, -2)[-2:]
            suffix.append(token)
            margins.append(float(np.float32(first - second)))
            if self.is_eog(token):
                stop = "eos"
                break
        return RowResult(list(stage_ids), suffix, margins, stop, pad=0,
                         position=len(prompt_ids) + len(stage_ids) - 1, fingerprints=fingerprints)


def get(name: str) -> EngineConstruction:
    if name not in CONSTRUCTIONS:
        raise ValueError(f"unknown llama.cpp construction {name!r}; known: {sorted(CONSTRUCTIONS)}")
    return CONSTRUCTIONS[name]


def replica_difference(a: RowResult, b: RowResult) -> str | None:
    """What two runs of one row differ in (suffix ids, margins as float32 bytes, boundary cache, stop), or None."""
    if a.suffix_ids != b.suffix_ids:
        return "suffix_ids"
    if np.asarray(a.margins, "<f4").tobytes() != np.asarray(b.margins, "<f4").tobytes():
        return "margins"
    if a.fingerprints != b.fingerprints:
        layer = next((i for i, (x, y) in enumerate(zip(a.fingerprints[1], b.fingerprints[1])) if x != y), "?")
        return f"cache_fingerprint (K differs from layer {layer})"
    if a.stop_reason != b.stop_reason:
        return "stop_reason"
    return None


class Detokenizer:
    """llama.cpp's own detokenizer in the shape ledger rows decode with (``decode(ids) -> str``)."""

    def __init__(self, engine: LlamaCppEngine):
        self.engine = engine

    def decode(self, ids) -> str:
        return self.engine.llm.detokenize(list(ids), special=True).decode("utf-8", "replace")


def engine_rows(engine: LlamaCppEngine, item: dict, prompt_ids: list[int], stage_ids: list[int],
                settings: RunSettings, constructions=tuple(CONSTRUCTIONS), replicas=(1, 2)) -> list[dict]:
    """Ledger rows of one item for each construction, each replica a run from scratch, bit-identical to replica 1
    or :class:`ReplicaMismatchError`. ``settings.precision`` must be the engine's KV type's."""
    if settings.precision != precision_of(engine.settings.kv_type):
        raise ValueError(f"settings.precision {settings.precision!r} is not the engine's "
                         f"{precision_of(engine.settings.kv_type)!r}")
    extra, decoder, rows = engine.provenance(), Detokenizer(engine), []
    for name in constructions:
        get(name)
        runs = [engine.replay(name, prompt_ids, stage_ids, settings.max_new_tokens) for _ in replicas]
        for replica, res in zip(replicas[1:], runs[1:]):
            differs = replica_difference(runs[0], res)
            if differs:
                raise ReplicaMismatchError(
                    f"item {item['item_id']!r}: llama.cpp {name} replicas {replicas[0]} and {replica} at "
                    f"{settings.precision} differ in {differs}. Replicas must be bit-exact; the rows record the "
                    "llama.cpp build (system_info) and context that did not make them so")
        rows += [dict(ledger_row(item, settings, EXPERIMENT, name, replica, prompt_ids, res, decoder,
                                 Batch(None, (item,)), 0), **extra)
                 for replica, res in zip(replicas, runs)]
    return rows
