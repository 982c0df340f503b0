"""The fidelity stage's work beside its decode steps, timed on the device: per row and suffix step, the observed
logits kept (``measure_fidelity``'s copy of each row's fp32 logits, (vocab,)), and per compared row and step, the
comparison (``stagereplay.experiments.fidelity.step_measures`` on the stacked (steps, vocab) logits, and the table
row built for the step, as the stage builds it). Rates for ``bench/pipeline_projection.py --fidelity-host-json``.

    python bench/fidelity_host.py --vocab 151936 --rows 16 --steps 64 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    import torch

    from stagereplay.experiments.fidelity import step_measures

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, nargs="+", default=[64])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {"vocab": args.vocab, "rows": args.rows, "device": torch.cuda.get_device_name() if dev.type == "cuda"
           else "cpu", "torch": torch.__version__, "by_steps": {}}
    logits = torch.randn(args.rows, args.vocab, device=dev, dtype=torch.float32)
    for steps in args.steps:
        kept = {r: [] for r in range(args.rows)}
        sync()
        t = time.perf_counter()
        for _ in range(steps):  # the observe of every row at every step (the stage's _Logits)
            for r in range(args.rows):
                kept[r].append(logits[r].detach().clone())
        sync()
        observe = (time.perf_counter() - t) / (steps * args.rows)
        a = torch.stack(kept[0])
        b = a + 1e-3 * torch.randn_like(a)
        step_measures(a, b)  # warm
        sync()
        t = time.perf_counter()
        reps = 3
        for _ in range(reps):
            a, b = torch.stack(kept[0]), torch.stack(kept[1])
            m = step_measures(a, b)
            rows = [{"step": j, "token_id": int(m["argmax_reference"][j]), "kl_forward": float(m["kl_forward"][j]),
                     "kl_reverse": float(m["kl_reverse"][j]), "kl_sym": float(m["kl_sym"][j]),
                     "max_abs_logit_diff": float(m["max_abs_logit_diff"][j]),
                     "margin_reference": float(m["margin_reference"][j]),
                     "margin_construction": float(m["margin_construction"][j]),
                     "argmax_differs": bool(m["argmax_construction"][j] != m["argmax_reference"][j]),
                     "logits_equal": bool(m["logits_equal"][j])} for j in range(steps)]
        sync()
        compare = (time.perf_counter() - t) / (reps * steps)
        out["by_steps"][str(steps)] = {"observe_s_per_row_step": observe, "compare_s_per_row_step": compare,
                                       "rows_built": len(rows)}
        del kept, a, b
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out["logits_GB_per_row_step"] = args.vocab * 4 / 1e9
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
