"""A random model of a given shape written as a GGUF file with gguf-py, the way llama.cpp's converter lays one out:
its tensor names, 2-D weights in a ggml type, norms and biases F32, and a byte-level BPE tokenizer (``gpt2``, pre
``qwen2``) with Qwen2's chat format. One writer for the tests and the bench scripts (:func:`write_gguf`).

The weights come from one of two places. ``from_model``: a transformers model of the shape built on the CPU
(seeded by torch, biases and norms randomised so that they are exercised), which is returned so that a test can
compare what loads from the file against it. Otherwise numpy's seeded generator, with no model in memory (the
tensors' names and shapes come from one on torch's meta device): 2-D weights normal with std 0.02, norms one, biases
zero, as transformers initialises a Qwen2.
Either way the outputs mean nothing.

gguf-py is imported inside the functions that need it: it is the optional extra ``gguf``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stagereplay.testing.shapes import SHAPES

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen2's chat format
USER_DEFINED = ["<think>", "</think>"]  # a reasoning model's stage markers
SPECIALS = CONTROL + USER_DEFINED
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_REGULAR_TOKENS = 151643  # Qwen2's byte-level BPE tokens before its special tokens
# The transformers class name of each architecture a file can hold.
ARCHITECTURES = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}
# Offsets of the fp16 scale fields in a block of each K-quant type, which gguf-py cannot quantise to: such a
# matrix is random blocks whose scales are set to small finite values, so that every value dequantises finite.
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@dataclass(frozen=True)
class Vocabulary:
    """A GGUF tokenizer's arrays: the tokens, their merges, and each token's ``gguf.TokenType``."""

    tokens: list[str]
    merges: list[str]
    types: list = field(repr=False)


@dataclass(frozen=True)
class WrittenGGUF:
    path: Path
    model: object | None  # the transformers model whose tensors were written (``from_model``), else None
    parameters: int  # values in the tensors written
    tensor_types: dict[str, int]  # ggml type name: tensors written in it, in the order first written


def qwen2_token_types(regular: int, unused: int = 0) -> list:
    """Qwen2's token types: ``regular`` NORMAL tokens, the CONTROL and USER_DEFINED specials, ``unused`` padding."""
    import gguf

    return ([gguf.TokenType.NORMAL] * regular + [gguf.TokenType.CONTROL] * len(CONTROL)
            + [gguf.TokenType.USER_DEFINED] * len(USER_DEFINED) + [gguf.TokenType.UNUSED] * unused)


def character_vocabulary(merges: tuple[str, ...] = ("1 2",)) -> Vocabulary:
    """Every printable ASCII character and the newline in GPT-2's byte alphabet, a token for each of ``merges``,
    then the specials: every character of a toy prompt is a token of its own."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    chars = [spelling[b] for b in range(32, 127)] + [spelling[10]]
    merged = [m.replace(" ", "") for m in merges]
    return Vocabulary(chars + merged + SPECIALS, list(merges), qwen2_token_types(len(chars) + len(merged)))


def byte_level_vocabulary(size: int, regular: int | None = None, seed: int = 0) -> Vocabulary:
    """A vocabulary of Qwen2's kind and size: the 256 byte tokens, random merged pairs up to ``regular`` tokens (each
    with its merge; default Qwen2's 151,643, or as many as ``size`` leaves room for), the specials, then padding
    tokens ``[PADn]`` (UNUSED) up to ``size``. What makes a GGUF's metadata slow to read is the size of these
    arrays."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    regular = min(QWEN2_REGULAR_TOKENS, size - len(SPECIALS)) if regular is None else regular
    rng = random.Random(seed)
    tokens = [bytes_to_unicode()[b] for b in range(256)]
    seen, merges = set(tokens), []
    while len(tokens) < regular:
        a, b = rng.choice(tokens), rng.choice(tokens[:4096])
        if len(a) + len(b) > 12 or a + b in seen:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    tokens += SPECIALS
    padding = size - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(padding)]
    return Vocabulary(tokens, merges, qwen2_token_types(regular, padding))


# Two merges (runs of two and four spaces, which no prompt holds): a file without merges reads back as having none to
# give, and transformers then derives them from scores this file does not have; one merge alone reads back in
# transformers 5.17 as a string, not a list of one.
FILLER_MERGES = ["\u0120 \u0120", "\u0120\u0120 \u0120\u0120"]


def prompt_characters() -> list[str]:
    """The characters a prompt holds: the toy's (its questions) and the chat template's text around a user
    message with the generation prompt (the role names, newlines), and a space."""
    import jinja2

    from stagereplay.data.toy import CHARS

    text = jinja2.Template(CHAT_TEMPLATE).render(messages=[{"role": "user", "content": ""}],
                                                 add_generation_prompt=True)
    for special in SPECIALS:
        text = text.replace(special, "")
    return sorted(set(CHARS) | set(text) | {" "})


def filler_vocabulary(size: int) -> Vocabulary:
    """The prompt characters in GPT-2's byte alphabet (a space is ``Ġ``, a newline ``Ċ``; every one a token of its
    own), the merged space runs, the specials, then fillers ``~0``, ``~1``, ... up to ``size``: a random model's
    greedy tokens are almost all fillers, so ``{marker: "~", occurrence: N}`` ends a stage at about N tokens."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    chars = ["".join(spelling[b] for b in c.encode()) for c in prompt_characters()]
    chars += [m.replace(" ", "") for m in FILLER_MERGES]
    base = chars + SPECIALS
    tokens = base + [f"~{i}" for i in range(size - len(base))]
    types = qwen2_token_types(len(chars)) + [gguf.TokenType.NORMAL] * (len(tokens) - len(base))
    return Vocabulary(tokens, list(FILLER_MERGES), types)


def model_class(architecture: str):
    """The transformers causal-LM and config classes of ``architecture``."""
    import transformers

    name = ARCHITECTURES[architecture]
    return getattr(transformers, f"{name}ForCausalLM"), getattr(transformers, f"{name}Config")


def random_model(shape: Mapping, architecture: str = "qwen2", seed: int = 0):
    """A transformers model of ``shape`` (``Config`` keyword arguments) in eval mode, initialised after
    ``torch.manual_seed(seed)``, its biases and norms then moved off zero and one."""
    import torch

    model_cls, config_cls = model_class(architecture)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**shape)).eval()
    with torch.no_grad():  # biases start at zero and norms at one: randomise them so they are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K permutation for llama, which transformers' LlamaTensorProcessor undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _matrix(values: np.ndarray | None, dims: tuple[int, int], kind: str, rng: np.random.Generator):
    """(data, raw ggml type or None) of a 2-D weight stored as ``kind``; ``values`` may be None for a K-quant."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return values.astype(np.float32), None
    if kind not in K_SCALES:
        return gguf.quants.quantize(values.astype(np.float32), qtype), qtype
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = dims
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in K_SCALES[kind]:
        scale = rng.uniform(0.001, 0.01, size=(rows, cols // block, 1)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, -1), qtype


def write_gguf(path: Path, shape: str | Mapping = "tiny", *, vocabulary: Vocabulary | None,
               architecture: str = "qwen2", label: str | None = None, name: str | None = None,
               tied: bool | None = None, quant: str = "F32", types: Mapping[str, str] | None = None,
               fallback: str | None = None, raw_types: Mapping[str, str] | None = None, skip: tuple[str, ...] = (),
               seed: int = 0, from_model: bool = False) -> WrittenGGUF:
    """Write a random ``architecture`` model of ``shape`` (a name in :data:`SHAPES`, or ``Config`` keyword arguments
    of the same keys) to ``path``.

    ``vocabulary``: the tokenizer written (its size is the model's vocabulary size), or None for a file without one.
    ``label``: the file's ``general.architecture`` (default ``architecture``; a test writes one that lies).
    ``name``: ``general.name`` (default ``random-<shape name>``). ``tied``: tied embeddings, no ``output.weight``
    (default: the shape's). ``quant``: the ggml type of every 2-D weight but those ``types`` names (GGUF tensor
    name: type); where a row is not a whole number of the type's blocks, ``fallback``. ``raw_types`` (GGUF tensor
    name: type) writes those tensors as zero blocks of that type, whatever gguf-py can read; ``skip`` leaves GGUF
    tensors out. ``seed``: torch's seed for ``from_model``'s weights, numpy's for the rest (the weights otherwise,
    the K-quant blocks).
    """
    import gguf
    import torch

    shape_name = shape if isinstance(shape, str) else None
    shape = dict(SHAPES[shape] if isinstance(shape, str) else shape)
    if vocabulary is not None:
        shape["vocab_size"] = len(vocabulary.tokens)
    if tied is not None:
        shape["tie_word_embeddings"] = tied
    if from_model:
        model = random_model(shape, architecture, seed)
    else:
        model_cls, config_cls = model_class(architecture)
        with torch.device("meta"):  # the tensors' names and shapes, no memory
            model = model_cls(config_cls(**shape))

    writer = gguf.GGUFWriter(str(path), label or architecture)
    writer.add_name(name or f"random-{shape_name or architecture}")
    _write_hyperparameters(writer, shape, architecture, quant)
    if vocabulary is not None:
        _write_tokenizer(writer, vocabulary)
    tensors = _Tensors(architecture, shape, quant, types or {}, fallback, raw_types or {}, skip, from_model,
                       np.random.default_rng(seed))
    parameters, written = _write_tensors(writer, model, tensors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return WrittenGGUF(Path(path), model if from_model else None, parameters, dict(written))


def _write_hyperparameters(writer, shape: dict, architecture: str, quant: str) -> None:
    """The model's shape, RoPE and norm settings and file type as llama.cpp's converter writes them."""
    import gguf

    heads, hidden = shape["num_attention_heads"], shape["hidden_size"]
    head_dim = shape.get("head_dim") or hidden // heads
    file_type = "ALL_F32" if quant == "F32" else f"MOSTLY_{quant}"
    writer.add_context_length(shape["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(shape["num_key_value_heads"])
    if architecture != "qwen2":  # llama's loader reads it as head_dim; Qwen3's head is not hidden / heads
        writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["rms_norm_eps"])
    if file_type in gguf.LlamaFileType.__members__:  # a K-quant's is named by its mix (Q4_K_M): none written
        writer.add_file_type(gguf.LlamaFileType[file_type])


def _write_tokenizer(writer, vocabulary: Vocabulary) -> None:
    """A byte-level BPE tokenizer (``gpt2``, pre ``qwen2``) with Qwen2's special tokens and chat format."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    writer.add_token_merges(vocabulary.merges)
    writer.add_eos_token_id(vocabulary.tokens.index("<|im_end|>"))
    writer.add_pad_token_id(vocabulary.tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(vocabulary.tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


@dataclass(frozen=True)
class _Tensors:
    """How :func:`write_gguf` writes the model's tensors (its arguments of the same names; ``rng`` numpy's seeded
    generator, drawn from in the tensors' order)."""

    architecture: str
    shape: dict
    quant: str
    types: Mapping[str, str]
    fallback: str | None
    raw_types: Mapping[str, str]
    skip: tuple[str, ...]
    from_model: bool
    rng: np.random.Generator


def _write_tensors(writer, model, how: _Tensors) -> tuple[int, Counter]:
    """Each of the model's tensors under its GGUF name, in the model's order: the values written and the tensors
    written in each ggml type."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[how.architecture.upper()], how.shape["num_hidden_layers"])
    parameters, written = 0, Counter()
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if gguf_name in how.skip or (how.shape["tie_word_embeddings"] and gguf_name == "output.weight"):
            continue
        dims = tuple(tensor.shape)
        if gguf_name in how.raw_types:
            kind = how.raw_types[gguf_name]
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            writer.add_tensor(gguf_name, np.zeros((dims[0], dims[1] // block * size), dtype=np.uint8),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
        elif len(dims) == 1:
            kind = "F32"
            values = tensor.float().numpy() if how.from_model else np.full(dims, 1.0 if "norm" in hf_name else 0.0)
            writer.add_tensor(gguf_name, values.astype(np.float32))
        else:
            kind = _matrix_type(gguf_name, dims, how)
            data, raw = _matrix(_matrix_values(tensor, gguf_name, dims, kind, how), dims, kind, how.rng)
            writer.add_tensor(gguf_name, data, raw_dtype=raw)
        parameters += int(np.prod(dims))
        written[kind] += 1
    return parameters, written


def _matrix_type(gguf_name: str, dims: tuple[int, int], how: _Tensors) -> str:
    """The ggml type a 2-D weight is written in: its own in ``types``, else ``quant``; ``fallback`` where a row is
    not a whole number of that type's blocks."""
    import gguf

    kind = how.types.get(gguf_name, how.quant)
    if dims[1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]:
        if how.fallback is None:
            raise ValueError(f"{gguf_name}: a row of {dims[1]} values is not a whole number of {kind} "
                             "blocks, and no fallback type was given")
        kind = how.fallback
    return kind


def _matrix_values(tensor, gguf_name: str, dims: tuple[int, int], kind: str, how: _Tensors) -> np.ndarray | None:
    """A 2-D weight's values as llama.cpp's converter writes them (llama's Q and K permuted): the model's, or drawn
    normal with std 0.02; None for a K-quant written as random blocks."""
    if how.from_model:
        values = tensor.float().numpy()
    elif kind in K_SCALES:
        values = None  # random blocks: no values to draw
    else:
        values = how.rng.standard_normal(dims, dtype=np.float32) * np.float32(0.02)
    if how.architecture == "llama" and values is not None and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
        heads, kv = how.shape["num_attention_heads"], how.shape["num_key_value_heads"]
        values = llama_cpp_permute(values, heads if "attn_q" in gguf_name else kv)
    return values
