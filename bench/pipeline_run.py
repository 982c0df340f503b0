"""The whole workflow, measured: build a RANDOM-WEIGHT model of a real Qwen2.5 shape, run every stage with
Snakemake, and print the run's wall time, each rule's wall and CPU time (its benchmark file), how busy the GPU was
and the ledger's mean prompt, stage and suffix lengths (what a projection of the same run needs). The JSON also
carries the config the run ran with, each job's time and the counts of work the run's results record (batches,
bridge batches, the sampled, dumped, transplanted and searched items and the batches holding them, transplant specs
and minimal-search rounds per direction): ``bench/pipeline_projection.py`` projects each rule from them.

    python bench/pipeline_run.py --work /tmp/smoke --shape qwen2.5-0.5b --items 4 --gpu-slots 4
    python bench/pipeline_run.py --work /tmp/scale --shape qwen2.5-1.5b --items 48 --stage 512 --suffix 256 \
        --regime cuda_graph --batch-size 16

The model's outputs mean nothing (random weights; see scripts/make_random_qwen.py): the numbers are speed only.
Random weights emit filler tokens ``~N`` almost only, so the stage boundary is the ``--stage``-th ``~``.
``--gpu-slots K`` lets K model jobs share one GPU (each model job claims one unit of ``gpu``, and Snakemake runs with
``--resources gpu=K``); a small model leaves room for several. (Before 2026-12-01 the config left ``gpus_per_job``
at 0, so no job claimed the GPU and every ready model job ran at once whatever K was.) Writes ``--json`` (default WORK/pipeline_run.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd

# what a run records of the package's greedy loop and schedule now (the projection prices a run by them)
from stagereplay.io.parquet import read_provenance
from stagereplay.projection.shape import GREEDY_LOOP, SCHEDULE

REPO = Path(__file__).resolve().parents[1]


def write_config(work: Path, args) -> Path:
    config = {
        "run": "bench", "n_items": args.items, "seed": 0,
        "dataset": {"source": "synthetic", "size": max(100, 4 * args.items), "seed": 0},
        "model": str(work / "model"), "revisions": ["local"], "precisions": args.precisions,
        "reference_precision": args.precisions[0],
        "bridge": {"n_rows": min(8, args.items), "seed": 0},
        "boundary": {"marker": "~", "occurrence": args.stage},
        "max_stage_tokens": args.stage + args.stage // 4 + 16, "max_new_tokens": args.suffix,
        "shards": args.shards, "threads": 1, "device": "auto" if args.device == "cuda" else args.device,
        "attn_implementation": "sdpa",
        "numerics": args.numerics, "batch_size": args.batch_size, "decode_regime": args.regime,
        "batch_invariance": {"sample": min(8, args.items), "seed": 0},
        "cache_differences": {"n_items": min(8, args.items), "precisions": args.precisions, "prefix_precision": None},
        # every model job claims one unit of the resource gpu, so --gpu-slots K (--resources gpu=K) lets K of them
        # share the GPU; with the schema's default of 0 no job claims it and every ready job starts at once
        "gpus_per_job": 1 if args.device == "cuda" else 0,
    }
    if args.transplant_select or args.minimal_budget or getattr(args, "pack", None):
        config["transplant"] = {"select": args.transplant_select or "divergent"}
        if args.minimal_budget:
            config["transplant"]["minimal"] = {"budget": args.minimal_budget}
        if getattr(args, "pack", None):  # packed transplant decodes: on or off (else the schema's default, on)
            config["transplant"]["pack"] = args.pack == "on"
    path = work / "config.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return path


def add_run_options(ap: argparse.ArgumentParser) -> None:
    """The options of the run this script and bench/turnaround.py time: the model's shape, what
    :func:`write_config` writes, the Snakemake resources, and where the JSON goes."""
    from stagereplay.testing.shapes import SHAPES

    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES),
                    help="a shape of stagereplay/testing/shapes.py (tiny: to try it on a CPU)")
    ap.add_argument("--items", type=int, default=4)
    ap.add_argument("--stage", type=int, default=64, help="stage tokens (the boundary is the N-th filler)")
    ap.add_argument("--suffix", type=int, default=32, help="max_new_tokens after the boundary")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--regime", default="eager", help="decode_regime")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--pack", choices=("on", "off"), default=None, help="transplant.pack (default: the schema's, on)")
    ap.add_argument("--numerics", default="default")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--gpu-slots", type=int, default=1, help="model jobs allowed on the GPU at once")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to try the script")
    ap.add_argument("--transplant-select", default=None, help="transplant.select (default: the schema's, divergent)")
    ap.add_argument("--minimal-budget", type=int, default=None, help="transplant.minimal.budget")
    ap.add_argument("--json", default=None, help="where the JSON goes (default: a file in --work)")


class GpuSampler:
    """``nvidia-smi`` utilization every 200 ms while the run lasts (nothing where there is no nvidia-smi)."""

    def __init__(self):
        self.samples: list[float] = []
        self.memory: list[float] = []
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                          "--format=csv,noheader,nounits", "-lms", "200"],
                                         stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append(float(parts[0]))
                self.memory.append(float(parts[1]))
            except (ValueError, IndexError):
                continue

    def stop(self) -> dict:
        if self.proc is None:
            return {"gpu": "none"}
        self.proc.terminate()
        n = len(self.samples) or 1
        return {"samples": len(self.samples), "busy_share": sum(s > 0 for s in self.samples) / n,
                "mean_utilization_pct": sum(self.samples) / n, "max_memory_mib": max(self.memory, default=0.0)}


def rule_times(work: Path) -> pd.DataFrame:
    """One row per benchmarked job: its rule (the file name without precision and shard), wall and CPU seconds."""
    rows = []
    for path in sorted((work / "benchmarks").rglob("*.tsv")):
        frame = pd.read_csv(path, sep="\t")
        parts = path.stem.split("_")
        rule = "_".join(p for p in parts if p not in ("bf16", "fp32", "fp16") and not p.isdigit())
        rows.append({"job": str(path.relative_to(work / "benchmarks")), "rule": rule, "s": float(frame["s"].iloc[-1]),
                     "cpu_s": float(frame["cpu_time"].iloc[-1])})
    return pd.DataFrame(rows, columns=["job", "rule", "s", "cpu_s"])


def ledger_lengths(work: Path) -> dict:
    paths = list((work / "results").rglob("ledger.parquet"))
    if not paths:
        return {}
    from stagereplay.analysis.tables import pair_table

    ledger = pd.read_parquet(paths[0])
    ok = ledger[(ledger["status"] == "ok") & (ledger["replica"] == 1)]
    live = ok[(ok["experiment"] == "matched") & (ok["construction"] == "live")]
    pairs = pair_table(ledger, "matched", "live", "prefill")  # the report's own pairing of live and prefill
    divergent = {p: float(g["disagree"].mean()) for p, g in pairs.groupby("precision")}
    return {"rows": int(len(ledger)), "mean_prompt": float(live["prompt_ids"].map(len).mean()),
            "mean_stage": float(live["stage_ids"].map(len).mean()),
            "mean_suffix": float(ok["suffix_ids"].map(len).mean()), "divergent_share": divergent,
            **batch_lengths(ledger)}


STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
STARTED = re.compile(r"^(?:local)?rule (\w+):$")
JOB_ID = re.compile(r"^\s+jobid: (\d+)$")
FINISHED = re.compile(r"^Finished job(?:id:)? (\d+)")


def log_job_times(path: Path) -> list[dict]:
    """Every job's start and end, in seconds from the log's first time stamp (Snakemake stamps to the second): the
    jobs without a benchmark file too (gathers, checks, the transplant selection)."""
    stamp = first = None
    started, rule, jobs = {}, None, []
    for line in path.read_text(errors="replace").splitlines():
        if m := STAMP.match(line):
            stamp = datetime.datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y").timestamp()
            first = stamp if first is None else first
        elif m := STARTED.match(line):
            rule = m.group(1)
        elif (m := JOB_ID.match(line)) and rule is not None:
            started[m.group(1)] = (rule, stamp - first)
            rule = None
        elif (m := FINISHED.match(line)) and m.group(1) in started:
            name, start = started.pop(m.group(1))
            jobs.append({"rule": name, "start_s": start, "end_s": stamp - first})
    return jobs


def batch_lengths(ledger: pd.DataFrame) -> dict:
    """What a batch decoded in lockstep runs for: the mean over batches of its longest prompt (its padded width), of
    its longest and its shortest stage (matched live rows, replica 1, at the reference precision: the fixed
    prefixes; a built construction skips the steps before the shortest one's boundary), and the mean over (batch,
    precision, experiment, construction) of its longest suffix. Empty at batch size 1 (no plan)."""
    ok = ledger[(ledger["status"] == "ok") & (ledger["replica"] == 1) & ledger["batch_index"].notna()]
    if ok.empty:
        return {}
    live = ok[(ok["experiment"] == "matched") & (ok["construction"] == "live")]
    live = live[live["precision"] == live["precision"].iloc[0]]
    widths = live.groupby("batch_index")["prompt_ids"].agg(lambda ids: max(map(len, ids)))
    stages = live.groupby("batch_index")["stage_ids"].agg(lambda ids: max(map(len, ids)))
    suffixes = ok.groupby(["batch_index", "precision", "experiment", "construction"])["suffix_ids"].agg(
        lambda ids: max(map(len, ids)))
    shortest = live.groupby("batch_index")["stage_ids"].agg(lambda ids: min(map(len, ids)))
    return {"batch_width": float(widths.mean()), "batch_stage": float(stages.mean()),
            "batch_stage_shortest": float(shortest.mean()), "batch_suffix": float(suffixes.mean())}


def revision_folder(work: Path) -> Path | None:
    """The primary revision's results folder (the one holding the ledger), None before there is one."""
    paths = sorted((work / "results").rglob("ledger.parquet"))
    return paths[0].parent if paths else None


def batches_holding(items, batch_of: dict | None) -> int:
    """Batches of the recorded plan that hold any of ``items`` (every item its own batch without a plan)."""
    items = {int(i) for i in items}
    return len(items) if batch_of is None else len({batch_of[i] for i in items})


def per_precision(frame: pd.DataFrame, batch_of: dict | None) -> dict:
    """{precision: {items, batches}} of a results table's distinct items."""
    return {p: {"items": int(g["item_index"].nunique()), "batches": batches_holding(g["item_index"].unique(), batch_of)}
            for p, g in frame.groupby("precision")}


def dump_counts(folder: Path, batch_of: dict | None) -> dict:
    """{precision: {items, batches, bytes}} of the cache dumps."""
    manifest = pd.read_parquet(folder / "caches.parquet")
    written = manifest.groupby("precision")["bytes"].sum()
    return {p: {**v, "bytes": int(written[p])} for p, v in per_precision(manifest, batch_of).items()}


def rows_by_construction(path: Path) -> dict:
    """{precision: {construction: rows}} of a results table (the batch-invariance control's items rerun alone)."""
    return {p: {c: int(n) for c, n in g["construction"].value_counts().items()}
            for p, g in pd.read_parquet(path).groupby("precision")}


def transplant_counts(folder: Path, batch_of: dict | None) -> dict:
    """Items transplanted, the batches holding them and the transplant runs (specs) per item and direction."""
    table = pd.read_parquet(folder / "transplant.parquet")
    runs = table.groupby(["item_index", "direction"]).size()
    return {"items": int(table["item_index"].nunique()),
            "batches": batches_holding(table["item_index"].unique(), batch_of),
            "directions": sorted(table["direction"].unique()),
            "specs_per_direction": int(runs.max()) if len(runs) else None,
            # the controls: the placebo beside each transplant, one sham per direction and batch (none before them)
            "arms": 2 if "placebo_outcome" in table.columns else 1,
            "shams": 1 if "sham_cache_fingerprint" in table.columns else 0,
            # packed decodes (transplant.pack), as the table's provenance records them (none before packing)
            "packed": packed_decodes(folder / "transplant.parquet")}


def packed_decodes(path: Path) -> bool:
    """Whether a transplant table's decodes were packed: asked for and refused for no batch size."""
    packing = read_provenance(path).get("packing") or {}
    return bool(packing.get("asked")) and not packing.get("refused")


def minimal_counts(folder: Path, batch_of: dict | None) -> dict:
    """The minimal searches: the batches holding searched items and, per direction, the rounds the lockstep search
    ran (per batch the most runs any of its rows used, summed over batches)."""
    table = pd.read_parquet(folder / "minimal_transplant.parquet")
    table["batch"] = [i if batch_of is None else batch_of[int(i)] for i in table["item_index"]]
    rounds = table.groupby(["direction", "batch"])["runs"].max().groupby("direction").sum()
    return {"items": int(table["item_index"].nunique()), "batches": int(table["batch"].nunique()),
            "rounds_per_direction": {d: int(r) for d, r in rounds.items()},
            "arms": 2 if "trial_placebo_outcomes" in table.columns else 1,
            "shams": 1 if "sham_cache_fingerprint" in table.columns else 0}


def recorded_counts(work: Path) -> dict:
    """The counts of work the run's results record, each read from its table (left out where the table is missing,
    e.g. in a stopped run; its error is listed): the decode regime and buffer, the batches, and per stage the items
    and the batches holding them."""
    from stagereplay.io.provenance import recorded_regime

    folder = revision_folder(work)
    if folder is None:
        return {}
    ledger = pd.read_parquet(folder / "ledger.parquet")
    planned = ledger["batch_index"].notna().all()
    batch_of = ({int(i): int(b) for i, b in zip(ledger["item_index"], ledger["batch_index"])} if planned else None)
    counts, errors = {"batches": batches_holding(ledger["item_index"].unique(), batch_of)}, []
    readers = {
        "decode": lambda: recorded_regime(folder / "ledger.parquet"),
        "num_layers": lambda: json.loads((work / "model" / "config.json").read_text())["num_hidden_layers"],
        "bridge": lambda: per_precision(pd.read_parquet(folder / "bridge.parquet"), batch_of),
        "batch_invariance": lambda: rows_by_construction(folder / "batch_invariance.parquet"),
        "cache_differences": lambda: per_precision(pd.read_parquet(folder / "cache_differences.parquet"), batch_of),
        "dump": lambda: dump_counts(folder, batch_of),
        "transplant": lambda: transplant_counts(folder, batch_of),
        "minimal": lambda: minimal_counts(folder, batch_of),
        "onset": lambda: per_precision(pd.read_parquet(folder / "divergence_onset.parquet"), batch_of),
    }
    for name, read in readers.items():
        try:
            counts[name] = read()
        except Exception as exc:  # noqa: BLE001 - a table a stopped run did not write: the projection derives it
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    if errors:
        counts["errors"] = errors
    return counts


def summary_or_error(summary, work: Path) -> dict:
    """``summary(work)``, or the error it raised: a stopped run's ledger may be missing, and the measured times
    must still be written."""
    try:
        return summary(work)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, not hidden
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="a fresh folder for the model, config and run")
    add_run_options(ap)
    ap.add_argument("--limit-s", type=float, default=None,
                    help="stop Snakemake after this many seconds and report the jobs finished by then")
    args = ap.parse_args()

    work = Path(args.work).resolve()
    if work.exists() and any(work.iterdir()):
        sys.exit(f"--work {work} is not empty: give a fresh folder")
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "scripts/make_random_qwen.py"), str(work / "model"), "--shape",
                    args.shape] + (["--device", "cuda:0"] if args.device == "cuda" else []), check=True, env=env)
    built_s = time.perf_counter() - t0
    config = write_config(work, args)
    command = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(work),
               "--configfile", str(config), "--cores", str(args.cores), "--resources", f"gpu={args.gpu_slots}"]
    sampler = GpuSampler()
    t0 = time.perf_counter()
    status = "complete"
    with open(work / "snakemake.log", "w") as log:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=args.limit_s)
        except subprocess.TimeoutExpired:  # Snakemake and its running jobs, at once: what finished stays
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
            status = f"stopped after --limit-s {args.limit_s:g} s (the jobs running then were killed)"
    wall = time.perf_counter() - t0
    gpu = sampler.stop()
    if returncode != 0 and status == "complete":
        print((work / "snakemake.log").read_text()[-4000:], file=sys.stderr)
        status = f"failed (Snakemake exit {returncode})"
    jobs = rule_times(work)
    by_rule = jobs.groupby("rule").agg(jobs=("s", "size"), s=("s", "sum"), cpu_s=("cpu_s", "sum")).sort_values(
        "s", ascending=False)
    import torch
    import transformers

    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu:{platform.machine()}",
        "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "weights": f"random, {args.shape} shape", "argv": sys.argv[1:],
        "status": status, "model_built_s": round(built_s, 1), "wall_s": round(wall, 1), "jobs": int(len(jobs)),
        "job_seconds": round(float(jobs["s"].sum()), 1), "gpu": gpu, "ledger": summary_or_error(ledger_lengths, work),
        "rules": {rule: {k: (round(float(v), 1) if k != "jobs" else int(v)) for k, v in row.items()}
                  for rule, row in by_rule.iterrows()},
        "job_times": [{"job": r.job, "rule": r.rule, "s": round(r.s, 1)} for r in jobs.itertuples()],
        "log_jobs": log_job_times(work / "snakemake.log"),
        "config": json.loads(config.read_text()), "gpu_slots": args.gpu_slots, "cores": args.cores,
        "counts": summary_or_error(recorded_counts, work),
        # what the package's greedy loop does, which bench/pipeline_projection.py prices (runs made before these
        # lack the key): the lookahead in the cuda_graph regime, built constructions' skip before the first boundary
        "greedy_loop": GREEDY_LOOP,
        "schedule": SCHEDULE,
    }
    text = json.dumps(report, indent=1)
    print(text)
    out = Path(args.json or work / "pipeline_run.json")
    out.write_text(text + "\n")
    shutil.copyfile(work / "snakemake.log", out.with_suffix(".snakemake.log"))
    return 0 if status == "complete" else 1


if __name__ == "__main__":
    sys.exit(main())
