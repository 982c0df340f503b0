"""Snakemake's planning: the time ``snakemake -n`` takes, and the time from a run's launch to its first job's start,
for two or more source trees of the workflow in the same run (their processes interleaved, medians and ratios).

Before its first job a run imports Snakemake, parses the Snakefile and the rule files (common/config.smk imports the
package, validates the config and fingerprints the model files), builds the DAG (the input functions and params of
every job) and runs its ``onstart`` hook: the check of the results on disk and the preflight of the inputs (the
dataset, the model's config and tokenizer, every prompt). A dry run runs the same checks from an input function.

Cases (``--cases``):

- ``toy``: the default config (config.yaml, the embedded toy), its model named by absolute path so that a tree
  extracted elsewhere finds it;
- ``gguf-cold``: a config like config/gguf-local-file.yaml (``--items`` items, both precisions, the boundary
  ``</think>``) on a RANDOM-WEIGHT GGUF of a real Qwen2.5 shape (bench/turnaround.py's writer; ``--shape``, the
  0.5B by default: vocabulary 151,936, about 670 MB at Q8_0), with an empty model store: the preflight reads the
  GGUF's metadata;
- ``gguf-warm``: the same with a model store that holds the file's snapshots (prepared once per tree, untimed, by
  the workflow's own prepare_model): the preflight reads a snapshot's config and tokenizer instead.

Per case, tree and repeat (the trees' order alternating): ``plan``, ``snakemake -n`` in a fresh folder (the model
file's digest not yet remembered there); ``plan_again``, ``snakemake -n`` once more in the same folder;
``first_job_again``, ``snakemake --cores 2`` there until Snakemake starts its first job (then the run is killed);
``first_job``, the same in a fresh folder. The preflight's own line is kept, to show what it checked through.

    git archive fdfed02 src workflow envs Snakefile | tar -x -C /tmp/plan-base  # the code before, to compare with
    python bench/planning.py --work /tmp/planning --src base=/tmp/plan-base --src new=. --repeats 5

Each tree runs with its own ``src`` first on PYTHONPATH. The configs set ``job_server: false`` (a killed run must
leave no server behind; planning does not depend on it). Prints a table and writes ``--json`` (WORK/planning.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

CASES = ("toy", "gguf-cold", "gguf-warm")
MEASURES = ("plan", "plan_again", "first_job_again", "first_job")
JOB_LINE = re.compile(r"^\s*(?:local)?rule (\w+):")
REVISION = "q8"


def toy_config(run: str) -> dict:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    return {**config, "run": run, "model": str(REPO / config["model"]), "job_server": False}


def gguf_config(run: str, gguf: Path, store: Path, args) -> dict:
    """config/gguf-local-file.yaml with the random GGUF as its model, ``store`` as its model store, synthetic items
    (the random file's vocabulary holds the toy's characters only) and the schema's prompt and answer format."""
    config = yaml.safe_load((REPO / "config/gguf-local-file.yaml").read_text())
    config.pop("prompt", None)
    config.update(run=run, n_items=args.items, dataset={"source": "synthetic", "size": 100, "seed": 0},
                  model=str(gguf), revisions=[REVISION], precisions=args.precisions, answer_format="last_number",
                  max_stage_tokens=64, max_new_tokens=32, threads=1, device=args.device, decode_regime=args.regime,
                  gpus_per_job=1 if args.device.startswith("cuda") else 0, model_store=str(store), job_server=False)
    return config


def snakemake_command(tree: Path, folder: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(tree / "Snakefile"), "--directory", str(folder),
            "--configfile", str(folder / "config.yaml"), "--cores", "2", *args]


def tree_env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "src"), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1"}


def checked_line(text: str) -> str | None:
    return next((line.split("Inputs checked", 1)[1].strip(" :") for line in text.splitlines()
                 if "Inputs checked" in line), None)


def plan(tree: Path, folder: Path) -> dict:
    """``snakemake -n``: its wall time and the preflight's line."""
    t0 = time.perf_counter()
    proc = subprocess.run(snakemake_command(tree, folder, "-n"), env=tree_env(tree), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"snakemake -n failed in {folder}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {"s": wall, "checked": checked_line(proc.stdout + proc.stderr)}


def first_job(tree: Path, folder: Path) -> dict:
    """A run from its launch until Snakemake prints its first job (its rule's name), then killed with its jobs."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(snakemake_command(tree, folder), env=tree_env(tree), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, rule, wall = [], None, None
    for line in proc.stdout:
        lines.append(line)
        if m := JOB_LINE.match(line):
            wall, rule = time.perf_counter() - t0, m.group(1)
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    if rule is None:
        raise SystemExit(f"no job started in {folder}:\n{''.join(lines)[-4000:]}")
    return {"s": wall, "rule": rule, "checked": checked_line("".join(lines))}


def fresh(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(json.dumps(config, indent=1))  # JSON is YAML
    return folder


def case_config(case: str, folder: Path, gguf: Path | None, work: Path, args) -> dict:
    if case == "toy":
        return toy_config("planning")
    store = folder / "store" if case == "gguf-cold" else work / "store"
    return gguf_config("planning", gguf, store, args)


def measure(case: str, tree: Path, where: Path, gguf: Path | None, work: Path, args) -> dict:
    """The four measures of one case on one tree, each folder fresh where the measure says so."""
    folder = where / "a"
    fresh(folder, case_config(case, folder, gguf, work, args))
    out = {"plan": plan(tree, folder)}
    out["plan_again"] = plan(tree, folder)
    out["first_job_again"] = first_job(tree, folder)
    other = where / "b"
    out["first_job"] = first_job(tree, fresh(other, case_config(case, other, gguf, work, args)))
    return out


def prime_store(tree: Path, work: Path, gguf: Path, args, name: str) -> float:
    """The workflow's own prepare_model into WORK/store (untimed in the table: the warm case's store)."""
    folder = fresh(work / f"prime-{name}", gguf_config("prime", gguf, work / "store", args))
    t0 = time.perf_counter()
    proc = subprocess.run(snakemake_command(tree, folder, f"results/prime/models/{REVISION}.json"),
                          env=tree_env(tree), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"prepare_model failed for {tree}:\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("snakemake", "torch", "transformers", "tokenizers", "gguf"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def table(results: dict, trees: list[str]) -> list[str]:
    """Markdown rows: each case and measure, the median seconds per tree and each tree's ratio to the first."""
    base = trees[0]
    head = ["case", "measure", *[f"{t} s" for t in trees], *[f"{t} / {base}" for t in trees[1:]]]
    rows = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |"]
    for case, by_tree in results.items():
        for m in MEASURES:
            medians = {t: by_tree[t]["median"][m] for t in trees}
            ratios = [f"{medians[t] / medians[base]:.2f}" for t in trees[1:]]
            rows.append("| " + " | ".join([case, m, *[f"{medians[t]:.2f}" for t in trees], *ratios]) + " |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, type=Path, help="a fresh folder")
    ap.add_argument("--src", action="append", default=[], metavar="NAME=TREE",
                    help="a tree holding Snakefile, workflow/ and src/ (repeat; the first is the baseline)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gguf", type=Path, help="a GGUF file to use instead of writing a random one")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="bench/turnaround.py's shape of the random GGUF")
    ap.add_argument("--items", type=int, default=4)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--device", default="auto", help="the GGUF configs' device (cuda on a GPU host)")
    ap.add_argument("--regime", default="static", help="the GGUF configs' decode_regime (cuda_graph on a GPU host)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    work = args.work.resolve()
    if work.exists() and any(work.iterdir()):
        sys.exit(f"--work {work} is not empty: give a fresh folder")
    work.mkdir(parents=True, exist_ok=True)
    trees = {name: Path(path).resolve() for name, path in (s.split("=", 1) for s in args.src)} or {"current": REPO}
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
              "cpus": os.cpu_count(), "versions": versions(), "argv": sys.argv[1:], "trees": {k: str(v) for k, v in
                                                                                             trees.items()},
              "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    gguf = None
    if any(c.startswith("gguf") for c in args.cases):
        gguf = args.gguf.resolve() if args.gguf else work / "model" / f"random-{args.shape}-q8_0.gguf"
        if not args.gguf:
            from turnaround import write_random_gguf

            gguf.parent.mkdir()
            report["gguf"] = write_random_gguf(gguf, args.shape)
        report["gguf_file"] = {"path": str(gguf), "bytes": gguf.stat().st_size}
    if "gguf-warm" in args.cases:
        report["prime_s"] = {name: round(prime_store(tree, work, gguf, args, name), 1) for name, tree in trees.items()}
    runs = {case: {name: [] for name in trees} for case in args.cases}
    for i in range(args.repeats):
        order = list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]
        for case in args.cases:
            for name, tree in order:
                got = measure(case, tree, work / case / name / str(i), gguf, work, args)
                runs[case][name].append(got)
                print(json.dumps({"case": case, "tree": name, "repeat": i,
                                  **{m: round(v["s"], 2) for m, v in got.items()}}), flush=True)
    results = {}
    for case, by_tree in runs.items():
        results[case] = {}
        for name, got in by_tree.items():
            results[case][name] = {
                "median": {m: statistics.median(g[m]["s"] for g in got) for m in MEASURES},
                "runs": [{m: round(g[m]["s"], 3) for m in MEASURES} for g in got],
                "first_rule": sorted({g[m]["rule"] for g in got for m in ("first_job", "first_job_again")}),
                "checked": sorted({str(g[m]["checked"]) for g in got for m in MEASURES}),
            }
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report["results"] = results
    report["table"] = table(results, list(trees))
    print("\n".join(report["table"]))
    out = args.json or work / "planning.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
