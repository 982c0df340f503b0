"""The llama.cpp engine: a GGUF file's boundary state built by llama.cpp itself (through ``llama-cpp-python``, the
optional extra ``engines``) in each of five constructions, continued greedily: the engine protocol
(:mod:`stagereplay.engines.protocol`) on llama.cpp. Its rows, replicas and their check are the engine stage's
(:mod:`stagereplay.engines.rows`); its config block is :class:`LlamaCppConfig` (the schema's ``llama_cpp``).

Two kinds of stage ids (the ledger's ``stage_source``):

- ``engine``: llama.cpp's own stage. ``live`` generates it: the prompt in one call, then greedy (argmax, lowest id on
  ties) one token per call until the boundary, with the pipeline's own stage rule and budget
  (:func:`stagereplay.decode.greedy.stage_end`, the config's ``boundary`` and ``max_stage_tokens``); its boundary
  state is the context that generation leaves, continued in place. The other constructions rebuild the state from
  those ids: what a llama.cpp user gets who cuts llama.cpp's trajectory at the stage and prefills it again.
- ``reference``: the pipeline's stage ids (its generation at the reference precision). There is no ``live`` on them:
  ``incremental`` (the same forwards as ``live``, teacher-forced) is the reference, for the cross-engine table.

The constructions run the forwards of the pipeline's own constructions (:mod:`stagereplay.experiments.constructions`),
each forward one ``llama_decode`` call:

- ``live``: llama.cpp's own generation (above); its forwards are ``incremental``'s, over ids it chose itself.
- ``incremental``: the prompt in one call, then the given stage ids one per call.
- ``prefill``: every boundary-cache id in one call, in a cleared context.
- ``prompt_cache``: the prompt in one call, the context's state saved (``save_state``), the context cleared and the
  state restored (``load_state``), then the stage in one call: a server's prompt cache.
- ``chunked``: every boundary-cache id in pieces of ``chunk_size`` tokens, one call each: a server's ``n_batch``.

A call longer than the context's effective ``n_ubatch`` (``llama_n_ubatch``) would be split by llama.cpp into several
compute graphs: it is refused (:class:`ForwardTooLongError`), so a ``prefill`` is one graph or is not run.

The boundary state is the pipeline's (docs/STUDY.md): the cache over the prefix but its last token, which is fed as
the first suffix step. Every suffix step is one single-token call whose last-position logits (float32, llama.cpp's
own) give the greedy id and the top-2 margin. The KV cache type (``f16`` or ``f32``) is the precision factor: the
ledger's ``precision`` is ``kv_f16`` or ``kv_f32``; weights and activations are the GGUF's and llama.cpp's own.

Fingerprints are of the sequence's state as llama.cpp writes it (:func:`state_fingerprints`). They compare engine
rows with engine rows only; the pipeline's own fingerprints hash torch tensors.

Knows nothing of items or rows, nothing of Snakemake and nothing of the report.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow as pa

from stagereplay import catalogue
from stagereplay.catalogue import EngineConstruction
from stagereplay.decode.greedy import BoundaryMatcher, RowResult, stage_end
from stagereplay.engines.llama_cpp_binding import (  # noqa: F401 - the engine's errors and binding, named here too
    BINDING,
    BINDING_VERSION,
    INSTALL,
    EngineRefusedError,
    EngineUnavailableError,
    LogCapture,
    SharedContext,
    ggml_string,
    gpu_count,
    require_binding,
    state_fingerprints,
)
from stagereplay.engines.protocol import PlannedPrefix, block_field
from stagereplay.engines.rows import ledger_schema
from stagereplay.experiments import constructions as registry

ENGINE = "llama_cpp"
KV_TYPES = ("f16", "f32")
DECODE_REGIME = ENGINE  # the ledger's decode_regime: the engine's kernels are part of the construction


def precision_of(kv_type: str) -> str:
    """The ledger's precision of a KV cache type: ``kv_f16`` or ``kv_f32``."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type {kv_type!r}: llama.cpp's KV cache types here are {list(KV_TYPES)}")
    return f"kv_{kv_type}"


def greedy_margin(logits: np.ndarray) -> tuple[int, float]:
    """The greedy id of finite float32 ``logits`` (the lowest index on ties) and the top-2 margin: the largest value
    less the second largest, in float32 (0 where the largest occurs twice). Two reductions beside the greedy id, not a
    sort (``np.partition`` took 0.9 ms over a 151,936-id vocabulary, more than llama.cpp's step on a GPU); the same
    float32 bytes as ``np.partition(logits, -2)`` gives (``tests/test_engine_llama_cpp.py``)."""
    token = int(np.argmax(logits))
    below, above = logits[:token], logits[token + 1:]
    second = max(below.max(initial=-np.inf), above.max(initial=-np.inf))
    return token, float(np.float32(logits[token] - second))


class ForwardTooLongError(ValueError):
    """A construction's forward longer than the context's ``n_ubatch``: llama.cpp would split it."""


# The engine's constructions, as the catalogue declares them (name, label, the pipeline construction whose forwards
# each runs, whether it restores the prompt's state or generates its own stage).
CONSTRUCTIONS: dict[str, EngineConstruction] = {c.name: c for c in catalogue.engine(ENGINE).constructions}

# Per row, after the stage's columns (engines.rows.STAGE_FIELDS): the engine and the context that made it.
FIELDS = [
    ("binding_version", pa.string()),  # llama-cpp-python
    ("llama_cpp_commit", pa.string()),  # the vendored llama.cpp's commit, as ggml_commit() reports it
    ("ggml_version", pa.string()),
    ("system_info", pa.string()),  # llama_print_system_info(): the backends and CPU features it was built with
    ("kv_type", pa.string()),
    ("n_ctx", pa.int32()),
    ("n_batch", pa.int32()),  # the context's, as llama.cpp reports it (llama_n_batch)
    ("n_ubatch", pa.int32()),  # the context's (llama_n_ubatch): no forward is longer
    ("n_threads", pa.int32()),
    ("n_gpu_layers", pa.int32()),  # offload: 0 none, -1 every layer
    ("flash_attn", pa.bool_()),
    ("chunk_size", pa.int32()),  # the chunked construction's pieces
]


def get(name: str) -> EngineConstruction:
    if name not in CONSTRUCTIONS:
        raise ValueError(f"unknown llama.cpp construction {name!r}; known: {sorted(CONSTRUCTIONS)}")
    return CONSTRUCTIONS[name]


def forward_sizes(construction: str, prompt_len: int, n_cached: int, chunk_size: int) -> list[int]:
    """Tokens per ``llama_decode`` call of the construction's boundary cache (``n_cached`` stage ids beyond the
    prompt; ``live`` generates them one per call, as ``incremental`` feeds them)."""
    return list(registry.get(get(construction).forwards_of).segments(prompt_len, n_cached, chunk_size))


@dataclass(frozen=True, kw_only=True)
class LlamaCppConfig:
    """The config block ``llama_cpp`` beyond the stage's keys (:class:`stagereplay.engines.protocol.EngineConfig`):
    the KV types a job runs, one context each, and what every context is opened with."""

    inherited: ClassVar[tuple[str, ...]] = ("threads", "chunk_size")

    kv_types: tuple[str, ...] = block_field("llama_cpp.kv_types")
    n_ctx: int | None = block_field("llama_cpp.n_ctx")  # None: what the selection needs
    n_batch: int | None = block_field("llama_cpp.n_batch")
    n_ubatch: int | None = block_field("llama_cpp.n_ubatch")
    threads: int = 1  # null in the config: the config's threads
    n_gpu_layers: int = block_field("llama_cpp.n_gpu_layers")
    flash_attn: bool = block_field("llama_cpp.flash_attn")
    chunk_size: int = 16  # null in the config: the config's chunk_size

    def precisions(self) -> tuple[str, ...]:
        return tuple(precision_of(kv_type) for kv_type in self.kv_types)

    def gpus(self) -> int:
        return 1 if self.n_gpu_layers else 0

    def context(self, kv_type: str, n_ctx: int, main_gpu: int | None = None) -> EngineSettings:
        """One context's settings: the block's, at ``kv_type``, holding ``n_ctx`` positions where n_ctx is null."""
        return EngineSettings(kv_type=kv_type, n_ctx=self.n_ctx or n_ctx, n_batch=self.n_batch,
                              n_ubatch=self.n_ubatch, threads=self.threads, n_gpu_layers=self.n_gpu_layers,
                              flash_attn=self.flash_attn, chunk_size=self.chunk_size, main_gpu=main_gpu)


@dataclass(frozen=True)
class EngineSettings:
    """The context every construction runs in: one per KV type, recorded on every row."""

    kv_type: str = "f16"
    n_ctx: int = 1024
    n_batch: int | None = None  # None: n_ctx, so that a one-batch prefill is one call
    n_ubatch: int | None = None  # None: n_batch, so that it is one compute graph too
    threads: int = 1
    n_gpu_layers: int = 0
    flash_attn: bool = False
    chunk_size: int = 16
    main_gpu: int | None = None  # every offloaded layer on this GPU; None: llama.cpp's own split over all it sees

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


class LlamaCppEngine:
    """One GGUF file in one llama.cpp context (:class:`EngineSettings`): an :class:`stagereplay.engines.protocol.
    Engine`. Use as a context manager, or ``close()``."""

    name: ClassVar[str] = ENGINE
    label: ClassVar[str] = "llama.cpp"
    config_class: ClassVar[type] = LlamaCppConfig
    fields: ClassVar[list] = FIELDS

    @classmethod
    def require(cls) -> None:
        require_binding()

    @classmethod
    def model_file(cls, model: str, revision: str | None, base_dir: str) -> str:
        from stagereplay.models.sources import resolve_source

        source = resolve_source(model, revision, base_dir)
        if source.kind != "gguf":
            raise ValueError(f"engines: [llama_cpp] replays a GGUF file; revision {revision!r} of model "
                             f"{model!r} is a {source.kind} model. Give model a .gguf file (or a folder and "
                             "revisions naming .gguf files), or leave engines empty")
        return f"{source.path}/{source.gguf_file}"

    @classmethod
    def open(cls, path: str, config: LlamaCppConfig, precision: str, n_ctx: int,
             main_gpu: int | None) -> LlamaCppEngine:
        kv_type = next(k for k in config.kv_types if precision_of(k) == precision)
        return cls(path, config.context(kv_type, n_ctx, main_gpu))

    @classmethod
    def visible_gpus(cls) -> int:
        return gpu_count()

    @property
    def precision(self) -> str:
        return precision_of(self.settings.kv_type)

    def __init__(self, path: str | Path, settings: EngineSettings, share: LlamaCppEngine | None = None):
        llama_cpp = require_binding()
        self._lib, self.settings, self.path = llama_cpp, settings, Path(path)
        if share is not None:  # a further context over share's model: see sibling()
            self.llm = SharedContext(share.llm)
            self._opened()
            return
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[settings.kv_type]
        placement = {} if settings.main_gpu is None else {"split_mode": llama_cpp.LLAMA_SPLIT_MODE_NONE,
                                                           "main_gpu": settings.main_gpu}
        with LogCapture(llama_cpp) as log:
            try:
                self.llm = llama_cpp.Llama(
                    str(self.path), n_ctx=settings.n_ctx, n_batch=settings.batch, n_ubatch=settings.ubatch,
                    n_threads=settings.threads, n_threads_batch=settings.threads, n_gpu_layers=settings.n_gpu_layers,
                    flash_attn=settings.flash_attn, type_k=kv, type_v=kv, logits_all=False, verbose=False,
                    **placement)
            except (ValueError, RuntimeError) as exc:
                raise EngineRefusedError(self._refusal(log.errors(), exc)) from exc
        self._opened()

    def _opened(self) -> None:
        llama_cpp = self._lib
        self.n_vocab = self.llm.n_vocab()
        # the context's own limits, which llama.cpp may set otherwise than asked: every check below reads these
        self.n_batch = int(llama_cpp.llama_n_batch(self.llm.ctx))
        self.n_ubatch = int(llama_cpp.llama_n_ubatch(self.llm.ctx))
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._provenance = self._read_provenance()
        self._probe()

    def _refusal(self, reason: str, exc: Exception) -> str:
        architecture = "?"
        with contextlib.suppress(Exception):
            from stagereplay.models.gguf_files import gguf_architecture

            architecture = gguf_architecture(self.path)
        return (f"llama.cpp ({BINDING} {self._lib.__version__}, llama.cpp {ggml_string('ggml_commit')}) "
                f"refuses {self.path} (general.architecture {architecture!r}): {reason} [{exc}]. llama.cpp must run "
                "the file's architecture and find every tensor it needs, in a type it reads")

    def _probe(self) -> None:
        """One token through the context before any work: llama.cpp must expose its logits."""
        self._clear()
        self.llm.eval([0])
        self._logits()
        self._clear()

    def sibling(self) -> LlamaCppEngine:
        """A further context with this one's settings over this one's model, which is not loaded again (one copy of
        the weights for every context of a job): close it before this one."""
        return type(self)(self.path, self.settings, share=self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.close()

    def provenance(self) -> dict:
        """What every row records of the engine and its context: read once, when the context opened."""
        return dict(self._provenance)

    def _read_provenance(self) -> dict:
        """Read on the thread that opens the context, never on a context's own thread: llama.cpp builds
        ``llama_print_system_info()`` in one static buffer, which contexts on threads would write at once (at 16
        contexts on one H100 a row read it empty)."""
        s = self.settings
        return {"engine": ENGINE, "binding_version": self._lib.__version__,
                "llama_cpp_commit": ggml_string("ggml_commit"),
                "ggml_version": ggml_string("ggml_version"),
                "system_info": self._lib.llama_print_system_info().decode("utf-8", "replace").strip(),
                "kv_type": s.kv_type, "n_ctx": self.llm.n_ctx(), "n_batch": self.n_batch,
                "n_ubatch": self.n_ubatch, "n_threads": s.threads, "n_gpu_layers": s.n_gpu_layers,
                "flash_attn": s.flash_attn, "chunk_size": s.chunk_size}

    def _clear(self) -> None:
        """An empty context: no cells, and the cache buffers zeroed, as a fresh context's."""
        self.llm.reset()
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.llm.ctx), True)

    def _eval(self, ids: list[int]) -> None:
        self.check_forward(len(ids), "a forward")
        self.llm.eval(ids)

    def check_forward(self, size: int, what: str) -> None:
        """Refuse a forward that llama.cpp would split: the binding cuts a call longer than ``n_batch`` into
        calls, and ``llama_decode`` a call longer than ``n_ubatch`` into compute graphs, so that a ``prefill``
        would silently be a chunked one."""
        limit = min(self.n_batch, self.n_ubatch)
        if size > limit:
            raise ForwardTooLongError(
                f"{what} of {size} tokens is longer than this llama.cpp context's n_ubatch {self.n_ubatch} (n_batch "
                f"{self.n_batch}): llama.cpp would split it into pieces of at most {limit}, so it would not be one "
                f"forward. Raise llama_cpp.n_ubatch and llama_cpp.n_batch to at least {size} (or leave both null: "
                "the context's size)")

    def longest_forward(self, constructions, prompt_len: int, n_cached: int) -> tuple[int, str]:
        """The longest forward of the constructions' boundary caches over ``n_cached`` stage ids, and whose it is:
        what :meth:`check_forward` must allow, for a check before any work."""
        return max((max(forward_sizes(name, prompt_len, n_cached, self.settings.chunk_size), default=0), name)
                   for name in constructions)

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
        sizes = forward_sizes(construction, len(prompt_ids), len(stage_ids) - 1, self.settings.chunk_size)
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

    def check_prefixes(self, prefixes: list[PlannedPrefix]) -> None:
        """Every forward of every planned prefix's constructions in one compute graph, else an error naming the
        prefix with the longest."""
        if prefixes:
            size, construction, what = max(((*self.longest_forward(p.constructions, p.prompt_len, p.n_cached),
                                              p.what) for p in prefixes), key=lambda x: x[0])
            self.check_forward(size, f"{what}: {construction}'s longest forward")

    def decode(self, ids) -> str:
        """llama.cpp's own detokenizer."""
        return self.llm.detokenize(list(ids), special=True).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def replay(self, construction: str, prompt_ids: list[int], stage_ids: list[int],
               max_new_tokens: int) -> RowResult:
        """One run from scratch over given stage ids: build, fingerprint the boundary cache, continue greedily from
        the pending token."""
        if get(construction).generates:
            raise ValueError("live generates its own stage: use generate(), not replay() over given ids")
        if not stage_ids:
            raise ValueError("a replay needs the stage's ids, the boundary token last")
        self._check_context(len(prompt_ids), len(stage_ids), max_new_tokens)
        self.build(construction, prompt_ids, stage_ids)
        return self._continue(prompt_ids, list(stage_ids), max_new_tokens)

    def generate(self, prompt_ids: list[int], matcher: BoundaryMatcher, max_stage_tokens: int,
                 max_new_tokens: int) -> RowResult:
        """``live``, from scratch: the prompt in one call, then llama.cpp's own greedy ids one per call until
        :func:`stage_end` finds the boundary; the context it leaves (the boundary id chosen, not yet fed) is the
        boundary state, fingerprinted and continued in place. Without a boundary: no state, the ids generated."""
        self._check_context(len(prompt_ids), max_stage_tokens, max_new_tokens)
        self._clear()
        self._eval(list(prompt_ids))
        generated: list[int] = []
        while True:
            logits = self._logits()
            if not np.isfinite(logits).all():
                return RowResult([], generated, [], "nonfinite")
            token = int(np.argmax(logits))  # lowest index on ties
            generated.append(token)
            ended = stage_end(matcher, generated, max_stage_tokens, self.is_eog(token))
            if ended == "boundary":
                return self._continue(prompt_ids, generated, max_new_tokens)
            if ended == "boundary_missing":
                return RowResult([], generated, [], "boundary_missing")
            self._eval([token])

    def _check_context(self, prompt_len: int, stage_len: int, max_new_tokens: int) -> None:
        if prompt_len + stage_len + max_new_tokens > self.llm.n_ctx():
            raise ValueError(f"{prompt_len} prompt + {stage_len} stage + {max_new_tokens} suffix tokens exceed "
                             f"llama_cpp.n_ctx {self.llm.n_ctx()}")

    def _continue(self, prompt_ids: list[int], stage_ids: list[int], max_new_tokens: int) -> RowResult:
        """The boundary state in the context now (every prefix id but the last): fingerprinted, then continued."""
        fingerprints = state_fingerprints(self.sequence_state())
        suffix, margins, stop = [], [], "max_new_tokens"
        token = stage_ids[-1]
        for _ in range(max_new_tokens):
            self._eval([token])
            logits = self._logits()
            if not np.isfinite(logits).all():
                stop = "nonfinite"
                break
            token, margin = greedy_margin(logits)
            suffix.append(token)
            margins.append(margin)
            if self.is_eog(token):
                stop = "eos"
                break
        return RowResult(list(stage_ids), suffix, margins, stop, pad=0,
                         position=len(prompt_ids) + len(stage_ids) - 1, fingerprints=fingerprints)


ENGINE_LEDGER_SCHEMA = ledger_schema(LlamaCppEngine)
