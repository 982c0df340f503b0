"""llama-cpp-python, the llama.cpp engine's binding: importing it with a clear error, reading what llama.cpp writes
of a sequence's state (its fingerprints), further contexts over a loaded model, its log while a file loads, and
ggml's version strings.

Knows nothing of constructions, items or rows (:mod:`stagereplay.engines.llama_cpp` builds on it).
"""

from __future__ import annotations

import ctypes
import hashlib
import struct

BINDING = "llama-cpp-python"
BINDING_VERSION = "0.3.36"  # the version the extra pins, and the one whose state layout the parser below reads
INSTALL = 'pip install -e ".[engines]"'


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


class SharedContext:
    """A further llama.cpp context over an open ``Llama``'s model (loaded once, its weights shared), with the calls of
    ``Llama``'s that the engine makes, each making the llama.cpp calls ``Llama`` makes (llama-cpp-python 0.3.36):
    ``eval`` (``llama_memory_seq_rm`` past the tokens held, then ``llama_decode`` of a batch whose last token alone
    outputs logits), ``reset``, ``save_state`` / ``load_state`` (``llama_state_get_data`` / ``llama_state_set_data``:
    the whole context's state), and the model's own tokenizer. Its context has the ``Llama``'s context parameters.
    Close it before the ``Llama``."""

    def __init__(self, llm):
        from llama_cpp import _internals

        self._llm = llm
        self._ctx = _internals.LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
        self._batch = _internals.LlamaBatch(n_tokens=llm.n_batch, embd=0, n_seq_max=llm.context_params.n_ctx,
                                            verbose=False)
        self.n_batch, self.n_tokens = llm.n_batch, 0

    @property
    def ctx(self):
        return self._ctx.ctx

    @property
    def model(self):
        return self._llm.model

    def n_ctx(self) -> int:
        return self._ctx.n_ctx()

    def n_vocab(self) -> int:
        return self._llm.n_vocab()

    def tokenize(self, *args, **kw):
        return self._llm.tokenize(*args, **kw)

    def detokenize(self, *args, **kw):
        return self._llm.detokenize(*args, **kw)

    def eval(self, tokens) -> None:
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        for i in range(0, len(tokens), self.n_batch):
            batch = tokens[i:i + self.n_batch]
            self._batch.set_batch(batch=batch, n_past=self.n_tokens, logits_all=False)
            self._ctx.decode(self._batch)
            self.n_tokens += len(batch)

    def reset(self) -> None:
        self.n_tokens = 0

    def save_state(self) -> tuple[bytes, int]:
        import llama_cpp

        size = llama_cpp.llama_state_get_size(self.ctx)
        buffer = (ctypes.c_uint8 * int(size))()
        written = int(llama_cpp.llama_state_get_data(self.ctx, buffer, size))
        if written > int(size):
            raise RuntimeError("llama_state_get_data wrote more than llama_state_get_size")
        return bytes(buffer)[:written], self.n_tokens

    def load_state(self, saved: tuple[bytes, int]) -> None:
        import llama_cpp

        data, n_tokens = saved
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if llama_cpp.llama_state_set_data(self.ctx, buffer, len(data)) != len(data):
            raise RuntimeError("llama_state_set_data did not read the whole state")
        self.n_tokens = n_tokens

    def close(self) -> None:
        self._batch.close()
        self._ctx.close()


class LogCapture:
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


def ggml_string(name: str) -> str:
    """ggml's ``ggml_version()`` or ``ggml_commit()`` (the vendored llama.cpp's commit), read from its library."""
    try:
        from llama_cpp import _ggml

        function = getattr(_ggml.libggml, name)
        function.restype = ctypes.c_char_p
        return function().decode()
    except (ImportError, AttributeError, OSError):
        return "unknown"


GPU_DEVICE_TYPE = 1  # ggml_backend_dev_type's GGML_BACKEND_DEVICE_TYPE_GPU


def gpu_count() -> int:
    """The GPUs llama.cpp's build sees (ggml's backend devices of type GPU): 0 in a build without CUDA."""
    try:
        from llama_cpp import _ggml

        lib = _ggml.libggml
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        return sum(lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i)) == GPU_DEVICE_TYPE
                   for i in range(lib.ggml_backend_dev_count()))
    except (ImportError, AttributeError, OSError):
        return 0
