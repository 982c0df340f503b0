"""The model jobs on N GPUs of one host: their dependencies as the workflow's DAG chains them, and a list scheduler.

For each N the config's ``shards`` set to N (or a shard count given for every N), every model job priced
(:mod:`.pricing`), and the jobs placed on the GPUs by ``list_schedule``: as many at a time as
``--resources gpu=N`` lets jobs of ``gpus_per_job`` GPUs run (each on GPUs of its own, so at the measured speed;
``gpus_per_job: 0`` is refused), in the order of the workflow's DAG (``job_dependencies``: a shard's fixed-prefix
2x2 after the reference precision's generation of that shard, the transplants and the minimal search after the two
ledger rules' jobs at the transplant precision, every other later model job after every job of the two ledger
rules, which ``gather_ledger`` joins), a free GPU taking the ready job with the longest path to the end. The jobs
that load no model take no time in it (a stated constant for them is added to the wall, as on one GPU). On one GPU
the wall is the model jobs' sum. Snakemake does not know the jobs' times, so its order can be worse than this one;
the result gives the bounds, the critical path and the work over the GPUs.
"""

from __future__ import annotations

from stagereplay.projection.jobs import JobWork
from stagereplay.projection.pricing import projected_rules, rates_for
from stagereplay.projection.rates import Overhead
from stagereplay.projection.shape import run_shape


def job_dependencies(jobs: list[JobWork]) -> dict:
    """{job name: the model jobs it waits for}: the DAG's (:mod:`.dag`), through the jobs that load no model (the
    gathers, the selections): the fixed-prefix 2x2 of a shard reads that shard's prefixes of the reference precision;
    the transplants and the minimal search read the ledger's rows at the transplant precision, which
    ``gather_transplant_baseline`` joins from that precision's jobs of the two ledger rules; every other later model
    job reads the ledger or the prefixes that ``gather_ledger`` joins from every job of the two ledger rules. A job
    the projection leaves out (``jobs.NOT_PRICED``) is not waited for."""
    names = {job.key: job.name for job in jobs}
    return {job.name: {names[key] for key in job.after if key in names} for job in jobs}


def list_schedule(seconds: dict, after: dict, slots: int) -> dict:
    """The jobs (``seconds``: {name: duration}, ``after``: {name: names it waits for}) on ``slots`` devices, each
    job on one: whenever a device is free it takes the ready job with the longest path to the end of the DAG (its
    own time and its longest chain of dependents; ties by name), as a list scheduler does. Snakemake does not know
    the jobs' times, so its order can be worse; the makespan is bounded below by the critical path and by the work
    over the devices. Returns {"makespan_s", "critical_path_s", "work_s", "jobs": {name: (start, end, device)}}."""
    if slots < 1:
        raise ValueError(f"{slots} devices: give at least one")
    unknown = {d for deps in after.values() for d in deps} - set(seconds)
    if unknown:
        raise ValueError(f"jobs wait for jobs not in the DAG: {sorted(unknown)}")
    dependents = {name: [] for name in seconds}
    for name, deps in after.items():
        for d in deps:
            dependents[d].append(name)
    rank = {}

    def tail(name, seen=()):
        if name in seen:
            raise ValueError(f"the DAG has a cycle through {name}")
        if name not in rank:
            rank[name] = seconds[name] + max((tail(d, (*seen, name)) for d in dependents[name]), default=0.0)
        return rank[name]

    for name in seconds:
        tail(name)
    waiting = {name: set(after.get(name, ())) for name in seconds}
    free = list(range(slots))
    running, placed, now = [], {}, 0.0  # running: (end, device, name)
    while len(placed) < len(seconds):
        ready = sorted((n for n, deps in waiting.items() if not deps and n not in placed), key=lambda n: (-rank[n], n))
        while free and ready:
            name, device = ready.pop(0), free.pop(0)
            placed[name] = (now, now + seconds[name], device)
            running.append((now + seconds[name], device, name))
        if not running:
            raise ValueError("no job is ready and none is running: the DAG has a cycle")
        running.sort()
        end, device, name = running.pop(0)
        now = end
        free.append(device)
        free.sort()
        for other in dependents[name]:
            waiting[other].discard(name)
    return {"makespan_s": max((end for _, end, _ in placed.values()), default=0.0),
            "critical_path_s": max(rank.values(), default=0.0), "work_s": sum(seconds.values()), "jobs": placed}


def on_gpus(run: dict, measures: list[dict], overhead: Overhead, gpus: list[int], measures_batch1=None,
            shards: int | None = None, non_model_s: float = 0.0) -> list[dict]:
    """The run on each of ``gpus`` GPUs of one host: the config's ``shards`` set to ``shards`` (default: the GPU
    count), every model job priced, and the jobs placed on the GPUs by ``list_schedule`` along
    ``job_dependencies``, as many at a time as ``--resources gpu=N`` lets jobs of ``gpus_per_job`` GPUs run (each
    model job on GPUs of its own, so at its measured speed); the wall adds ``non_model_s`` (the jobs that load no
    model, run one after another as on one GPU)."""
    per_job = int(run["config"].get("gpus_per_job") or 0)
    if per_job < 1:
        raise ValueError(f"gpus_per_job: {per_job}: the model jobs claim no GPU, so --resources gpu=N does not limit "
                         "how many share one; set gpus_per_job: 1 to price N GPUs")
    out = []
    for n in gpus:
        config = {**run["config"], "shards": shards or n}
        shape = run_shape({**run, "config": config})
        _, jobs = projected_rules(shape, rates_for(shape, measures, overhead, measures_batch1))
        slots = n // per_job
        if slots < 1:
            raise ValueError(f"{n} GPUs: fewer than the {per_job} a model job claims (gpus_per_job)")
        placed = list_schedule({j.name: j.seconds for j in jobs}, job_dependencies(jobs), slots)
        out.append({"gpus": n, "shards": config["shards"], "jobs": len(jobs), "jobs_at_once": slots,
                    "model_jobs_s": placed["makespan_s"], "non_model_s": non_model_s,
                    "wall_s": placed["makespan_s"] + non_model_s, "critical_path_s": placed["critical_path_s"],
                    "work_s": placed["work_s"], "busy": placed["work_s"] / (slots * placed["makespan_s"])
                    if placed["makespan_s"] else None,
                    "placed": {name: list(v) for name, v in placed["jobs"].items()}})
    return out
