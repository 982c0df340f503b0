"""The library API on a random-weight Qwen2 of a real shape: replay, replicas and transplants, on a GPU or the CPU.

Builds (or reuses) a RANDOM-WEIGHT model folder with scripts/make_random_qwen.py, loads it as a user would
(``AutoModelForCausalLM.from_pretrained``) at each precision asked for, and runs :func:`stagereplay.replay` over
several constructions with two replicas each, then an all-layer transplant both ways between live and prefill,
printing what each returned and how long it took. Its outputs mean nothing as text: the model is random.

    python scripts/library_example_gpu.py [--shape qwen2.5-1.5b|qwen2.5-0.5b|tiny] [--device cuda:0]
        [--precisions bf16 fp32] [--stage-tokens 64] [--new-tokens 64] [--model DIR]
"""

from __future__ import annotations

import os

# before torch starts CUDA: cuBLAS reads it when it makes its workspace (the API sets it too, possibly too late)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
CONSTRUCTIONS = ("live", "prefill", "incremental", "chunked", "prefix_cached")


def model_folder(args) -> Path:
    folder = args.model or Path("/tmp") / f"stagereplay-random-{args.shape}"
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts/make_random_qwen.py"), str(folder), "--shape", args.shape,
                        "--device", args.device], check=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="a shape of scripts/make_random_qwen.py")
    parser.add_argument("--device", default=None, help="default: cuda:0 where CUDA is available, else cpu")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--stage-tokens", type=int, default=64, help="the stage: this many generated tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="suffix budget")
    parser.add_argument("--model", type=Path, default=None, help="an existing model folder (else one is built)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import stagereplay

    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    folder = model_folder(args)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "12+34-5"}], add_generation_prompt=True,
                                           tokenize=False)
    print(f"model {folder} ({args.shape}, random weights) on {args.device}; prompt {prompt!r}")
    for precision in args.precisions:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, DTYPES[precision])).to(args.device)
        start = time.perf_counter()
        # the random model's greedy ids are filler tokens "~N": the stage ends at the stage-tokens-th "~"
        stage = stagereplay.generate_stage(model, tokenizer, prompt, "~", occurrence=args.stage_tokens,
                                           max_stage_tokens=2 * args.stage_tokens)
        found = time.perf_counter()
        result = stagereplay.replay(model, tokenizer, prompt, stage, CONSTRUCTIONS, max_new_tokens=args.new_tokens,
                                    replicas=2)
        replayed = time.perf_counter()
        p = result.provenance
        print(f"\n== {precision}: stage of {len(stage)} ids in {found - start:.1f} s; {len(CONSTRUCTIONS)} "
              f"constructions x 2 replicas in {replayed - found:.1f} s ({p['device']}, torch {p['torch']}, "
              f"transformers {p['transformers']}, attention {p['attn_implementation']}, deterministic "
              f"{p['numerics']['deterministic_algorithms']}, TF32 {p['numerics']['tf32_matmul']})")
        for name, c in result.continuations.items():
            step = result.first_divergence("live", name)
            where = "agrees with live" if step is None else (
                f"leaves live at step {step} (margins {result.continuations['live'].margins[step]:.4f} live, "
                f"{c.margins[step]:.4f} here)")
            print(f"  {name:14} {len(c.suffix_ids):3} ids, stop {c.stop_reason:14} cache {c.cache_fingerprint[:16]} "
                  f"replicas exact {c.replicas_exact}{'' if c.replicas_exact else f' ({c.replica_difference})'}; "
                  f"{where}")
            print(f"  {'':14} suffix {c.suffix_ids[:12]}{' ...' if len(c.suffix_ids) > 12 else ''}")
        for donor, recipient in (("prefill", "live"), ("live", "prefill")):
            start = time.perf_counter()
            t = stagereplay.transplant(model, tokenizer, prompt, stage, donor, recipient,
                                       max_new_tokens=args.new_tokens)
            print(f"  transplant {t.donor}->{t.recipient} (all {len(t.layers)} layers, K and V): follows {t.outcome} "
                  f"(own continuations {'differ' if t.divergent else 'agree'}; live rebuilt byte for byte: "
                  f"{t.live_fingerprint_match}) in {time.perf_counter() - start:.1f} s")
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
