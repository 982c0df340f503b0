"""The benchmarks' models and clock: random-weight Qwen2.5 models of the real shapes built on the device from
Qwen2Config (no weights are downloaded: every number made with them is a speed or an exactness check, never model
quality), the bytes a decode step reads of them, the device's copy rate, random prompts, and timing that waits for
the device.
"""

from __future__ import annotations

import time

import torch

from stagereplay.models.loading import PRECISIONS

SHAPES = {
    # Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads / 2 KV heads, tied embeddings
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    # Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads / 2 KV heads, tied embeddings
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    # Qwen2.5-7B: hidden 3584, 28 layers, 28 heads / 4 KV heads, untied embeddings
    "7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    # Qwen2.5-14B: hidden 5120, 48 layers, 40 heads / 8 KV heads, untied embeddings
    "14B": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=13824, vocab_size=152064, tie_word_embeddings=False),
    # a toy shape that exercises every path on a CPU in seconds
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
}


def log(*a):
    print(*a, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t, out


def build_model(shape: str, precision: str, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1_000_000.0, eos_token_id=None,
                      pad_token_id=0, bos_token_id=None, use_sliding_window=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(cfg, dtype=PRECISIONS[precision], attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every parameter once; an untied input embedding only by one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def copy_rate(device: str, gbytes: float) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    n = int(gbytes * 2**30) // 4
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    times = []
    for i in range(13):
        dt, _ = timed(lambda: y.copy_(x))
        if i >= 3:
            times.append(dt)
    del x, y
    return 2 * n * 4 / sorted(times)[len(times) // 2]


def prompts_for(n_rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n_rows, length), generator=g).tolist()
