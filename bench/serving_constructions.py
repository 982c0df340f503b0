"""The fixed-prefix 2x2 with the constructions serving engines use: ``chunked`` and ``prefix_cached`` against
``incremental`` (the live schedule rebuilt) and ``prefill``, over a finished run's reference prefix ids, through the
pipeline's own stage (``generate_fixed_prefix``, two replicas per construction, the run's batch plan).

    PYTHONPATH=src python bench/serving_constructions.py results/default --out /tmp/serving \\
        --pairs incremental,chunked incremental,prefix_cached --precisions bf16 fp32

Prints, per pair and precision, the items whose replica-1 suffixes differ and whether every replica pair is
bit-identical. A user gets the same rows from the workflow with ``--config 'fixed_prefix={constructions: [A, B]}'``
(bench/RESULTS.md, "How strongly the embedded toy shows the effect", on the shipped toy; its first run is in
bench/RESULTS_ARCHIVE.md).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml


def one(run: str, out: str, pair: tuple[str, str], precision: str, cfg: dict) -> dict:
    from stagereplay.models.sources import revision_slug
    from stagereplay.stages.controls import generate_fixed_prefix
    from stagereplay.stages.settings import ControlSettings

    revision = cfg["revisions"][0]
    results = Path(run) / revision_slug(revision)
    path = Path(out) / f"fixed_prefix_{'_'.join(pair)}_{precision}.parquet"
    s = ControlSettings(model=str(Path(cfg["model"]).resolve()), revision=revision, device="cpu", threads=1,
                        progress=False, precision=precision, reference_precision=cfg["reference_precision"],
                        boundary=cfg["boundary"], max_stage_tokens=cfg["max_stage_tokens"],
                        max_new_tokens=cfg["max_new_tokens"], fixed_prefix_constructions=pair)
    reference = results / "parts" / f"prefixes_{cfg['reference_precision']}_0.parquet"
    generate_fixed_prefix(str(Path(run) / "selection" / "items.parquet"), str(reference), str(path), s)
    return {"pair": list(pair), "precision": precision, **summarise(path, pair)}


def summarise(path: Path, pair: tuple[str, str]) -> dict:
    """The report's own pairing and replica check (``analysis.tables``) over one fixed-prefix part."""
    from stagereplay.analysis.tables import pair_table, replica_agreement
    from stagereplay.io.parquet import read_parquet

    rows = read_parquet(path)
    pairs = pair_table(rows, "fixed_prefix", *pair)
    replicas = replica_agreement(rows)
    return {"items": int(len(pairs)), "suffixes_differ": int(pairs["disagree"].sum()),
            "replicas_bit_identical": bool((replicas["identical"] == replicas["n"]).all())}


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
