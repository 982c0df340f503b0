"""A tiny random Qwen2 written as a GGUF file with gguf-py, the way llama.cpp's converter lays it out.

The vocabulary is byte-level BPE (as Qwen2's): every printable ASCII character in GPT-2's byte alphabet,
one merge, and the special tokens of Qwen2's chat format plus ``<think>``/``</think>``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bench_scripts import load_bench

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_vocab() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    chars = [spelling[b] for b in range(32, 127)] + [spelling[10]]  # printable ASCII and newline
    merges = ["1 2"]
    return chars + ["12"] + SPECIALS, merges


def tiny_qwen2_model(vocab_size: int, seed: int = 0, layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # biases start at zero and norms at one: randomise them so they are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_tiny_gguf(path: Path, seed: int = 0, architecture: str = "qwen2", layers: int = 2, raw_types=None):
    """Write a tiny random Qwen2-shaped model to ``path`` (F32 tensors); return the in-memory HF model.

    ``architecture`` is written as the file's ``general.architecture`` (tests write an unsupported one);
    ``raw_types`` (GGUF tensor name: ggml type name) writes those tensors as zero blocks of that type.
    """
    tokens, merges = byte_level_vocab()
    model = tiny_qwen2_model(len(tokens), seed, layers)
    normal = len(tokens) - len(SPECIALS)
    write_qwen2_gguf(path, model, tokens, merges, normal, "tiny-random-qwen2", architecture, rope_base=10000.0,
                     raw_types=raw_types)
    return model


def write_qwen2_gguf(path: Path, model, tokens: list[str], merges: list[str], normal: int, name: str,
                     architecture: str = "qwen2", rope_base: float = 10000.0, unused: int = 0,
                     raw_types: dict | None = None) -> None:
    """``model``'s tensors (F32) and a byte-level BPE tokenizer as llama.cpp's converter lays a Qwen2 GGUF out:
    ``tokens`` are ``normal`` regular tokens, then the specials, then ``unused`` padding tokens."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * normal + [gguf.TokenType.CONTROL] * 3
                           + [gguf.TokenType.USER_DEFINED] * 2 + [gguf.TokenType.UNUSED] * unused)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for tensor_name, tensor in model.state_dict().items():
        base, suffix = tensor_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if name in (raw_types or {}):
            kind = gguf.GGMLQuantizationType[raw_types[name]]
            block, size = gguf.GGML_QUANT_SIZES[kind]
            rows, cols = tensor.shape
            writer.add_tensor(name, np.zeros((rows, cols // block * size), dtype=np.uint8), raw_dtype=kind)
            continue
        writer.add_tensor(name, tensor.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_vocab_gguf(path: Path, regular: int, seed: int = 0, padding: int = 64):
    """A one-layer random Qwen2 (F32) whose vocabulary is large: ``regular`` byte-level BPE tokens with their
    merges, the specials, then ``padding`` unused ``[PADn]`` tokens (as Qwen2's vocabulary of 151,936 pads its
    151,643 + 22 tokens); what makes a GGUF's metadata slow to read is the size of these arrays."""
    tokens, merges = load_bench("prepared_load").byte_level_tokens(regular, regular + len(SPECIALS) + padding, seed)
    model = tiny_qwen2_model(len(tokens), seed, layers=1)
    write_qwen2_gguf(path, model, tokens, merges, regular, "random-qwen2-vocab", rope_base=1000000.0, unused=padding)
