"""What one Snakemake run of the workflow left in its working directory, for a benchmark's report: its rules' wall
and CPU seconds (their benchmark files), its jobs' start and end (its Snakemake log), its wall before the first job
and after the last, its prepare_model job, its ledger and the model store's entries; two runs' times set against
each other; the host's versions and device. ``bench/turnaround.py`` reports them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

from pipeline_run import STAMP, log_job_times, rule_times


def phases(log_path: Path, started: float, wall_s: float, jobs: list[dict]) -> dict:
    """The run's wall split at its first job's start and its last job's end (Snakemake's time stamps, to the second):
    before the first job Snakemake plans and the workflow's preflight checks the inputs (a GGUF source's metadata,
    or its prepared snapshot in the store where there is one); the preflight's own line says which."""
    first = None
    lines = log_path.read_text(errors="replace").splitlines()
    for line in lines:
        if m := STAMP.match(line):
            first = datetime.datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y").timestamp()
            break
    checked = next((line.strip() for line in lines if "Inputs checked" in line), None)
    if first is None:
        return {"preflight": checked}
    before = max(0.0, first - started)
    span = max((j["end_s"] for j in jobs), default=0.0)
    return {"before_first_job_s": round(before, 1), "jobs_span_s": round(span, 1),
            "after_last_job_s": round(max(0.0, wall_s - before - span), 1), "preflight": checked}


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def run_summary(work: Path, run: str, measured: dict, revision: str) -> dict:
    """A run's rules (benchmarks/<run>/), its jobs' start and end (its Snakemake log) and its prepare_model job
    (of ``revision``, the config's one revision)."""
    started = measured["started"]
    jobs = rule_times(work)
    jobs = jobs[jobs["job"].str.startswith(f"{run}/")]
    by_rule = jobs.groupby("rule").agg(jobs=("s", "size"), s=("s", "sum"), cpu_s=("cpu_s", "sum")).sort_values(
        "s", ascending=False)
    rules = {rule: {"jobs": int(row["jobs"]), "s": round(float(row["s"]), 2), "cpu_s": round(float(row["cpu_s"]), 2)}
             for rule, row in by_rule.iterrows()}
    log = read_text(work / "logs" / run / revision / "prepare_model.log")
    record = read_text(work / "results" / run / "models" / f"{revision}.json")
    prepare = {
        **rules.get("prepare_model", {}),
        "already_in_store": log is not None and "already in the store" in log,
        "prepared_now": log is not None and "prepared now" in log,
        "log": [line for line in (log or "").splitlines() if "store" in line],
        "record": json.loads(record) if record else None,
    }
    log_jobs = log_job_times(work / measured["log"])
    measured = {k: v for k, v in measured.items() if k != "started"}
    return {**measured, **phases(work / measured["log"], started, measured["wall_s"], log_jobs),
            "jobs": int(len(jobs)), "job_seconds": round(float(jobs["s"].sum()), 1),
            "job_cpu_seconds": round(float(jobs["cpu_s"].sum()), 1), "rules": rules,
            "slowest_rules": list(rules)[:5], "prepare_model": prepare, "ledger": ledger_summary(work, run, revision),
            "job_times": [{"job": r.job, "rule": r.rule, "s": round(r.s, 2), "cpu_s": round(r.cpu_s, 2)}
                          for r in jobs.itertuples()],
            "log_jobs": log_jobs, "job_starts": job_starts(work, run)}


def job_starts(work: Path, run: str) -> dict:
    """Each model job's start as its log says it ("job started ...", "model and decoder ready: ...")."""
    out = {}
    for path in sorted((work / "logs" / run).rglob("*.log")):
        lines = [line.split("stagereplay:", 1)[-1] for line in read_text(path).splitlines()
                 if "job started" in line or "model and decoder ready" in line]
        if lines:
            out[str(path.relative_to(work / "logs" / run))] = lines
    return out


def ledger_summary(work: Path, run: str, revision: str) -> dict:
    """The run's ledger: rows by status and the items whose live generation reached the boundary (a random model
    may end an item early with its end-of-text token), with the mean stage length of those."""
    import pandas as pd

    path = work / "results" / run / revision / "ledger.parquet"
    if not path.is_file():
        return {}
    ledger = pd.read_parquet(path)
    live = ledger[(ledger["experiment"] == "matched") & (ledger["construction"] == "live")]
    reached = live[live["status"] == "ok"]
    return {"rows": int(len(ledger)), "status": {k: int(v) for k, v in ledger["status"].value_counts().items()},
            "items": int(live["item_index"].nunique()), "items_at_boundary": int(reached["item_index"].nunique()),
            "mean_stage": round(float(reached["stage_ids"].map(len).mean()), 1) if len(reached) else None}


def ratio(warm, cold):
    return round(warm / cold, 4) if warm is not None and cold else None


def compare(cold: dict, warm: dict) -> dict:
    """Warm over cold: the wall, the summed job seconds and each rule's seconds and CPU seconds."""
    rules = {}
    for rule in dict.fromkeys(list(cold["rules"]) + list(warm["rules"])):
        c, w = cold["rules"].get(rule, {}), warm["rules"].get(rule, {})
        rules[rule] = {"cold_s": c.get("s"), "warm_s": w.get("s"), "ratio_s": ratio(w.get("s"), c.get("s")),
                       "cold_cpu_s": c.get("cpu_s"), "warm_cpu_s": w.get("cpu_s"),
                       "ratio_cpu_s": ratio(w.get("cpu_s"), c.get("cpu_s"))}
    whole = cold["status"] == warm["status"] == "complete"  # a stopped run's wall is its limit, not a turnaround
    return {"wall": ratio(warm["wall_s"], cold["wall_s"]) if whole else None,
            "job_seconds": ratio(warm["job_seconds"], cold["job_seconds"]) if whole else None,
            "saved_wall_s": round(cold["wall_s"] - warm["wall_s"], 1) if whole else None,
            "before_first_job": ratio(warm.get("before_first_job_s"), cold.get("before_first_job_s")),
            "prepare_model": rules.get("prepare_model"),
            "note": None if whole else "a run was stopped (--limit-s): no wall ratio; the rules' are of the jobs "
                                       "each run finished",
            "rules": rules}


def store_entries(work: Path) -> list[dict]:
    from stagereplay.models.store import ModelStore

    return [{k: e[k] for k in ("key", "precision", "mode", "bytes")} for e in ModelStore(work / "store").entries()]


def versions() -> dict:
    from stagereplay.models.store import installed_versions

    return {"python": platform.python_version(), **installed_versions(
        ("torch", "transformers", "tokenizers", "safetensors", "gguf", "numpy", "snakemake", "stagereplay"))}


def device_name(requested: str) -> str:
    import torch

    if requested == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu:{platform.machine()} ({os.cpu_count()} cores)"
