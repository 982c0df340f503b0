"""Whether two source trees of the workflow plan the same jobs: per config, every job of a dry run in a fresh folder
with its rule, wildcards, input, output, log, benchmark, params, threads, resources and priority, compared.

The params are compared by their ``repr``, as Snakemake compares them to decide a rerun, so equal plans mean that a
run finished with one tree has nothing to rerun with the other. Each tree's own root path is replaced by ``<tree>``
(a shipped dataset or model resolves under it). The dry runs pass ``--no-hooks``: the example configs name hub
models and files that are not on this machine, which the preflight would refuse (the plan does not depend on it).

    git archive main src workflow envs Snakefile config.yaml config data | tar -x -C /tmp/plan-base
    python bench/plan_parity.py --work /tmp/parity --src base=/tmp/plan-base --src new=.

Configs: the root config.yaml (the toy; its model named by absolute path, the first tree's), each config/*.yaml,
and two variants of the toy's that take the branches those leave untaken.
Prints one line per config and the differing jobs, and exits 1 when any plan differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def dump_plan(snakefile: str, folder: str, out: str) -> None:
    """In this process: a dry run of ``snakefile`` in ``folder``, each job the dry-run executor is given written to
    ``out`` as one JSON object."""
    from snakemake.cli import main
    from snakemake.executors import dryrun

    jobs = []

    def record(self, job):
        jobs.append({
            "rule": job.rule.name,
            "wildcards": dict(job.wildcards),
            "input": sorted(map(str, job.input)),
            "output": sorted(map(str, job.output)),
            "log": sorted(map(str, job.log)),
            "benchmark": str(job.benchmark) if job.benchmark else None,
            "params": {name: repr(value) for name, value in job.params.items()},
            "threads": job.threads,
            "resources": {k: repr(v) for k, v in job.resources.items() if k not in ("tmpdir", "_cores", "_nodes")},
            "priority": job.priority,
        })
        dryrun.Executor.__base_run_job(self, job)

    dryrun.Executor.__base_run_job = dryrun.Executor.run_job
    dryrun.Executor.run_job = record
    try:
        main(["-s", snakefile, "--directory", folder, "--configfile", str(Path(folder) / "config.yaml"),
              "--cores", "2", "--dry-run", "--no-hooks"])
    except SystemExit as exc:
        if exc.code:
            raise
    finally:
        Path(out).write_text(json.dumps(jobs, indent=0, sort_keys=True))


def configs(first_tree: Path) -> dict[str, dict]:
    toy = yaml.safe_load((REPO / "config.yaml").read_text())
    out = {"config.yaml": {**toy, "model": str(first_tree / toy["model"]), "job_server": False}}
    for path in sorted((REPO / "config").glob("*.yaml")):
        out[f"config/{path.name}"] = yaml.safe_load(path.read_text())
    # Branches the configs above leave untaken: chunk_size where a construction is chunked, a transplant-only
    # revision, the stages turned off, a prefix precision of the cache differences.
    out["config.yaml + chunked"] = {**out["config.yaml"], "fixed_prefix": {"constructions": ["incremental", "chunked"]},
                                    "transplant": {"constructions": ["live", "chunked"]},
                                    "fidelity": {"constructions": ["chunked"], "items": 3}, "shards": 2}
    out["config.yaml + later revision, stages off"] = {
        **out["config.yaml"], "precisions": ["fp32", "bf16"], "reference_precision": "fp32",
        "transplant": {"revisions": ["primary", "later"], "precision": "bf16", "minimal": {"budget": 0}},
        "dump": {"items": "none"}, "fidelity": {"constructions": []},
        "cache_differences": {"n_items": 0, "precisions": ["fp32"], "prefix_precision": "bf16"}}
    return out


def plan_of(tree: Path, folder: Path, config: dict, roots: list[Path]) -> list[dict]:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(json.dumps(config, indent=1))  # JSON is YAML
    out = folder.parent / f"{folder.name}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "src"), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, "--dump", str(tree / "Snakefile"), str(folder), str(out)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return [{"failed": (proc.stdout + proc.stderr)[-2000:]}]
    text = out.read_text().replace(str(folder), "<work>")
    for root in roots:  # the toy config names its model in the first tree: the same file to both
        text = text.replace(str(root), "<tree>")
    return sorted(json.loads(text), key=lambda j: (j["rule"], j["output"]))


def differences(a: list[dict], b: list[dict]) -> list[str]:
    by_output = lambda jobs: {tuple(j.get("output", [])) or (j.get("failed", ""),): j for j in jobs}
    a, b = by_output(a), by_output(b)
    lines = [f"only in the first: {k}" for k in a.keys() - b.keys()]
    lines += [f"only in the second: {k}" for k in b.keys() - a.keys()]
    for key in sorted(a.keys() & b.keys()):
        for field in sorted(set(a[key]) | set(b[key])):
            x, y = repr(a[key].get(field)), repr(b[key].get(field))
            if x != y:
                at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                lines.append(f"{a[key].get('rule')} {key[0]}: {field} differs at ...{x[max(0, at - 60):at + 60]}... "
                             f"vs ...{y[max(0, at - 60):at + 60]}...")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, help="a fresh folder")
    ap.add_argument("--src", action="append", default=[], metavar="NAME=TREE", help="two trees, the first the base")
    ap.add_argument("--dump", nargs=3, metavar=("SNAKEFILE", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dump:
        dump_plan(*args.dump)
        return 0
    trees = [(name, Path(path).resolve()) for name, path in (s.split("=", 1) for s in args.src)]
    if len(trees) != 2 or args.work is None:
        ap.error("give --work and two --src")
    work = args.work.resolve()
    if work.exists() and any(work.iterdir()):
        sys.exit(f"--work {work} is not empty: give a fresh folder")
    differing = 0
    for i, (label, config) in enumerate(configs(trees[0][1]).items()):
        plans = [plan_of(tree, work / name / str(i), config, [t for _, t in trees]) for name, tree in trees]
        diff = differences(*plans)
        failed = any("failed" in j for plan in plans for j in plan)
        rules = sorted({j["rule"] for j in plans[0] if "rule" in j})
        print(f"{label}: {len(plans[0])} jobs ({len(rules)} rules) vs {len(plans[1])}: "
              + ("FAILED" if failed else "same" if not diff else f"{len(diff)} differences"))
        for line in diff[:40]:
            print(f"    {line}")
        differing += bool(diff) or failed
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
