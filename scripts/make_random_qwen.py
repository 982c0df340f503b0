"""Write a RANDOM-WEIGHT model folder with the shape of a real Qwen2.5 model (no download, no network).

For exercising the pipeline at a real model's size (memory, speed, several GPUs) where the real weights are not
at hand: its outputs mean nothing. The tokenizer is the toy's character vocabulary padded with filler tokens
``~0``, ``~1``, ... to the real vocabulary size, so the random model's greedy ids (almost all fillers) decode to
text and a boundary such as ``{marker: "~", occurrence: 16}`` is reached after 16 generated tokens.

    python scripts/make_random_qwen.py OUT_DIR [--shape qwen2.5-0.5b|qwen2.5-1.5b|qwen2.5-7b|qwen2.5-14b|tiny] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from stagereplay.testing.shapes import SHAPES  # the real Qwen2.5 shapes (untied embeddings)


def build_tokenizer(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from stagereplay.data.toy import CHARS, CHAT_TEMPLATE, SPECIAL_TOKENS

    base = SPECIAL_TOKENS + CHARS
    vocab = {tok: i for i, tok in enumerate(base + [f"~{i}" for i in range(vocab_size - len(base))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<pad>",
                                        eos_token="<eos>", additional_special_tokens=["<think>", "</think>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                        help="where to initialise the weights (a GPU is much faster at 1.5B parameters)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = SHAPES[args.shape]
    tokenizer = build_tokenizer(shape["vocab_size"])
    cfg = Qwen2Config(**shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=None, use_sliding_window=False)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n_params = sum(p.numel() for p in model.parameters())
    (args.out / "RANDOM_WEIGHTS.json").write_text(json.dumps(
        {"note": "random weights with a real model's shape; outputs mean nothing", "shape": args.shape,
         "parameters": n_params, "seed": args.seed, **shape}, indent=2) + "\n")
    print(f"wrote {args.out}: {args.shape}-shaped Qwen2ForCausalLM with RANDOM weights, {n_params / 1e9:.2f}B "
          f"parameters, bf16")


if __name__ == "__main__":
    main()
