"""The real Qwen2.5 shapes (and a tiny one for a CPU), as ``Qwen2Config`` keyword arguments: one table for the
random-weight models of scripts/make_random_qwen.py, the GGUF files of :mod:`stagereplay.testing.gguf` and the bench
scripts that write them. Imports nothing."""

from __future__ import annotations

# The shape of Qwen2.5-1.5B as DeepSeek-R1-Distill-Qwen-1.5B has it (its config.json: untied embeddings). Untied
# matters here: a random model with tied embeddings echoes its last input token forever. A writer that wants the
# real model's tying (Qwen2.5-0.5B ties its embeddings) asks for it.
SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
                        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=False),
}
