"""Search over toy training specs for one that shows the effect: train each candidate, then count its divergent items.

    PYTHONPATH=src python bench/toy_search.py CANDIDATES.json --out DIR [--device cuda] [--configs config.yaml ...]

CANDIDATES.json maps a name to ``ToyTrainingSpec`` fields (the shipped ``primary`` spec where a field is left out).
Each candidate is trained into ``DIR/NAME`` (on ``--device``: cuda trains in seconds but is not the shipped toy's
bit-reproducible CPU training, so a chosen spec is trained again on the CPU before it ships) and measured with
``bench/toy_effect.py`` (bf16, the eager regime, one thread) under every config given; candidates run in parallel
worker processes. Prints one JSON line per candidate and config, and writes them all to ``DIR/search.json``.
The divergent count depends on the CPU that measures it (bench/RESULTS.md), so compare candidates on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path


def _one(name: str, fields: dict, out: str, device: str, configs: list[str]) -> list[dict]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, as train_toy asks
    import torch

    from stagereplay.data.toy import TOY_REVISIONS, train_toy
    import toy_effect

    torch.set_num_threads(1)
    spec = replace(TOY_REVISIONS["primary"][1], threads=1, **fields)
    t0 = time.time()
    record = train_toy(Path(out) / name, spec, progress=False, device=device)
    trained = time.time() - t0
    rows = []
    for config in configs:
        summary = toy_effect.measure(str(Path(out) / name), config, precisions=["bf16"])["bf16"]["summary"]
        rows.append({"name": name, "config": config, **fields, "final_loss": round(record["final_loss"], 4),
                     "train_s": round(trained, 1), **summary})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("candidates", help="JSON: {name: {ToyTrainingSpec fields}}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", help="where candidates train (measuring is always on the CPU)")
    ap.add_argument("--configs", nargs="+", default=["config.yaml"])
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    args = ap.parse_args()
    candidates = json.loads(Path(args.candidates).read_text())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(_one, name, fields, args.out, args.device, args.configs)
                   for name, fields in candidates.items()]
        for future in as_completed(futures):
            for row in future.result():
                print(json.dumps(row), flush=True)
                results.append(row)
            Path(args.out, "search.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
