"""The fixed-prefix 2x2 with the constructions serving engines use: ``chunked`` and ``prefix_cached`` against
``incremental`` (the live schedule rebuilt) and ``prefill``, over a finished run's reference prefix ids, through the
pipeline's own stage (``generate_fixed_prefix``, two replicas per construction, the run's batch plan).

    PYTHONPATH=src python bench/serving_constructions.py results/default --out /tmp/serving \\
        --pairs incremental,chunked incremental,prefix_cached --precisions bf16 fp32

Prints, per pair and precision, the items whose replica-1 suffixes differ and whether every replica pair is
bit-identical. A user gets the same rows from the workflow with ``--config 'fixed_prefix={constructions: [A, B]}'``
(bench/RESULTS.md, "Serving engines' constructions in the fixed-prefix 2x2").
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml


def one(run: str, out: str, pair: tuple[str, str], precision: str, cfg: dict) -> dict:
    import pandas as pd

    from stagereplay.stages.controls import generate_fixed_prefix
    from stagereplay.stages.settings import ControlSettings

    run_dir = Path(run)
    path = Path(out) / f"fixed_prefix_{'_'.join(pair)}_{precision}.parquet"
    s = ControlSettings(model=str(Path(cfg["model"]).resolve()), revision="primary", device="cpu", threads=1, progress=False,
                        precision=precision, reference_precision=cfg["reference_precision"],
                        boundary=cfg["boundary"], max_stage_tokens=cfg["max_stage_tokens"],
                        max_new_tokens=cfg["max_new_tokens"], fixed_prefix_constructions=pair,
                        prepared_models=None)
    reference = run_dir / "primary" / "parts" / f"prefixes_{cfg['reference_precision']}_0.parquet"
    generate_fixed_prefix(str(run_dir / "selection" / "items.parquet"), str(reference), str(path), s)
    rows = pd.read_parquet(path)
    ok = rows[rows["status"] == "ok"]
    first = ok[ok["replica"] == 1].pivot(index="item_index", columns="construction", values="suffix_fingerprint")
    replicas = ok.groupby(["item_index", "construction"])["suffix_fingerprint"].nunique()
    return {"pair": list(pair), "precision": precision, "items": int(len(first)),
            "suffixes_differ": int((first[pair[0]] != first[pair[1]]).sum()),
            "replicas_bit_identical": bool((replicas == 1).all())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a finished run's results folder (results/<run>)")
    ap.add_argument("--config", default="config.yaml", help="the config that run was made with")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pairs", nargs="+", default=["incremental,chunked", "incremental,prefix_cached"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tasks = [(tuple(p.split(",")), precision) for p in args.pairs for precision in args.precisions]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one, *zip(*[(args.run, args.out, pair, precision, cfg) for pair, precision in tasks])))
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
