"""The workflow through Snakemake's generic cluster executor, with tests/local_sbatch.py standing in for sbatch.

profiles/cluster-generic submits every job with an sbatch command line; here the same line calls the local
stand-in, which runs each job script as a process of its own and records what it was submitted with. The test shows
that every job ran as its own submitted process (its own PID, its own Snakemake, one rule), with the resources its
rule declares, and that the results are byte for byte those of a local run (``--cores 2``) of the same targets.

Provenance embeds the git commit of the code that ran, so both runs must run one tree state: they run a snapshot of
the workflow and the package, committed in a repository of its own, so that an edit or a commit in the checkout
during the test cannot make the two runs differ for a reason other than the executor.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from stagereplay.io.parquet import CONTENT_KEY, read_parquet, read_provenance
from workflow_runner import tiny_config

REPO = Path(__file__).resolve().parents[1]
LOCAL_SBATCH = Path(__file__).resolve().parent / "local_sbatch.py"
SNAPSHOT_PATHS = ("Snakefile", "config.yaml", "workflow", "src", "data", "envs", "profiles")

# Every stage kind but the report: generation, fixed-prefix 2x2, audit, dumps, transplants, and the gathers, in two
# shards (each model rule submits a job per shard).
TARGETS = [f"results/tiny/primary/{name}" for name in
           ("ledger.parquet", "bridge.parquet", "audit_check.json", "transplant.parquet", "caches.parquet")]
TINY = dict(n_items=3, max_new_tokens=8, max_stage_tokens=16, precisions=["bf16"], reference_precision="bf16",
            bridge={"n_rows": 2, "seed": 0}, transplant={"select": "sample:1", "sweeps": ["all"]},
            threads=2, gpus_per_job=1, mem_mb_per_job=1500, runtime_per_job=7, shards=2)


def snapshot(dest: Path) -> str:
    """Copy the workflow and the package as they are now (tracked and new files) into ``dest``, commit them there,
    and return the commit."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                             *SNAPSHOT_PATHS], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for rel in filter(None, listed.split("\0")):
        if (REPO / rel).is_file():  # a tracked file deleted in the checkout is not part of its state
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(git + args, cwd=dest, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=dest, capture_output=True, text=True,
                          check=True).stdout.strip()


def start_workflow(code: Path, workdir: Path, *args, env: dict) -> subprocess.Popen:
    """Snakemake on the snapshot's Snakefile and package, started (its output collected into a file)."""
    command = [sys.executable, "-m", "snakemake", "-s", str(code / "Snakefile"), "--directory", str(workdir),
               "--configfile", str(workdir / "config.yaml"), *args, *TARGETS]
    output = open(workdir / "snakemake.out", "w+")  # a file, not a pipe: two runs at once block neither
    proc = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
    proc.output_file = output
    return proc


def finish_workflow(proc: subprocess.Popen) -> tuple[int, str]:
    """Wait for a run of start_workflow; returns its PID and its output."""
    proc.wait()
    proc.output_file.seek(0)
    output = proc.output_file.read()
    proc.output_file.close()
    assert proc.returncode == 0, f"snakemake failed:\n{output[-8000:]}"
    return proc.pid, output


def executed_jobs(output: str) -> dict[tuple[str, str], list[dict]]:
    """Every job a Snakemake process says it ran itself (``localrule``; a job it submits elsewhere is printed as
    ``rule``), by (rule, wildcards as JSON): the resources and threads it ran with."""
    jobs = collections.defaultdict(list)
    for block in re.split(r"^localrule ", output, flags=re.M)[1:]:
        header, *lines = block.splitlines()
        indented = itertools.takewhile(lambda line: line.startswith("    "), lines)
        info = dict(line.strip().split(": ", 1) for line in indented)
        wildcards = dict(pair.split("=", 1) for pair in info["wildcards"].split(", ")) if "wildcards" in info else {}
        resources = dict(pair.split("=", 1) for pair in info["resources"].split(", "))
        used = {key: int(resources[key]) for key in ("mem_mb", "runtime", "gpu")}
        used["threads"] = int(info.get("threads", 1))  # printed only above 1
        jobs[(header.rstrip(":"), json.dumps(wildcards, sort_keys=True))].append(used)
    return jobs


def stop_leftover_jobs(record: Path, workdir: Path) -> None:
    """End the submitted jobs still running (a failed or interrupted run leaves them behind), each checked first to
    be running this test's job script, since PIDs are reused."""
    if not record.exists():
        return
    for line in record.read_text().splitlines():
        pid = json.loads(line)["pid"]
        try:
            if str(workdir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.killpg(pid, signal.SIGTERM)
        except (OSError, ProcessLookupError):
            pass  # already ended


def result_files(workdir: Path) -> dict[str, bytes]:
    """Every file under results/ but Snakemake's own directory markers, by relative path."""
    return {str(p.relative_to(workdir)): p.read_bytes() for p in sorted((workdir / "results").rglob("*"))
            if p.is_file() and p.name != ".snakemake_timestamp"}


def is_hash_record(rel: str) -> bool:
    return Path(rel).name.startswith(".") and rel.endswith(".sha256")


def comparable(rel: str, data: bytes):
    """What of a results file must be the same in any two runs of one tree state, whatever the executor: all its
    bytes, but for hash records, which are no results: a hash record (``.<name>.sha256``) holds the digest of its
    file, compared with the file itself, and the size and inode it was written with (where it lies on this disk, a
    cache key). The two runs share one model store: their records of it (models/<revision>.json) must be equal."""
    if is_hash_record(rel):
        return None
    return data


@pytest.mark.slow
def test_every_job_is_its_own_submitted_process_and_results_equal_a_local_run(tmp_path):
    code = tmp_path / "code"
    commit = snapshot(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code / "src"), os.environ.get("PYTHONPATH", "")]))
    profile = code / "profiles/cluster-generic"
    settings = yaml.safe_load((profile / "config.yaml").read_text())
    # The local run's model jobs fork from the job server (but the first, which starts it), the submitted ones are
    # fresh processes (the profile turns the server off): the byte comparison below also shows that a forked job
    # computes what a fresh one does.
    cfg = tiny_config(tmp_path / "local", **TINY, job_server=True, job_server_idle_s=120)
    tiny_config(tmp_path / "cluster", **TINY, job_server=True)

    submit = settings["cluster-generic-submit-cmd"]
    assert submit.startswith("sbatch ")
    record = tmp_path / "submissions.jsonl"
    (tmp_path / "cluster/logs/cluster").mkdir(parents=True)  # the profile's --output folder, made as it says
    # The two runs at once (the cluster run mostly waits on its submissions). The local run resolves every job's
    # resources as the profile would (its default-resources for the rules that declare none) and prints them: what
    # each submission must carry. The cluster run checks its jobs' status every second (the default, every 10 s,
    # only waits longer).
    local = start_workflow(code, tmp_path / "local", "--default-resources", *settings["default-resources"],
                           "--cores", "2", env=env)
    try:
        cluster = start_workflow(
            code, tmp_path / "cluster", "--profile", str(profile), "--jobs", "2", "--latency-wait", "5",
            "--seconds-between-status-checks", "1",
            "--cluster-generic-submit-cmd", f"{sys.executable} {LOCAL_SBATCH} " + submit.removeprefix("sbatch "),
            env=dict(env, LOCAL_SBATCH_RECORD=str(record)))
        try:
            main_pid, cluster_output = finish_workflow(cluster)
        finally:
            if cluster.poll() is None:
                cluster.kill()
                cluster.wait()
            stop_leftover_jobs(record, tmp_path / "cluster")
    finally:
        local.wait()
    _, local_output = finish_workflow(local)
    local_jobs = executed_jobs(local_output)
    generation = local_jobs[("reconstruct_prefixes", json.dumps(dict(precision="bf16", revision="primary",
                                                                      shard="0"), sort_keys=True))]
    assert generation == [dict(mem_mb=cfg["mem_mb_per_job"], runtime=cfg["runtime_per_job"],
                               gpu=cfg["gpus_per_job"], threads=cfg["threads"])]  # the rule's, from the config
    defaults = {key: int(value) for key, value in (item.split("=") for item in settings["default-resources"])}
    assert local_jobs[("select_items", "{}")] == [dict(defaults, threads=1)]  # declares none: the profile's

    # Every job of the local run was submitted once, with the resources it ran with locally, and none ran in the
    # main Snakemake process.
    submissions = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(submissions) == sum(map(len, local_jobs.values())) >= 10
    assert not executed_jobs(cluster_output), "a job ran in the main Snakemake process"
    for s in submissions:
        job = (s["rule"], json.dumps(s["wildcards"], sort_keys=True))
        assert [{key: s[key] for key in ("mem_mb", "runtime", "gpu", "threads")}] == local_jobs[job], s
    # ... each as a process of its own: the PID is the job id Snakemake was given, and the job's own Snakemake,
    # writing to the file named after that PID, ran exactly that one job, with those resources.
    pids = [s["pid"] for s in submissions]
    assert len(set(pids)) == len(pids) and main_pid not in pids
    assert sorted(map(int, re.findall(r"with external jobid '(\d+)'", cluster_output))) == sorted(pids)
    for s in submissions:
        job = (s["rule"], json.dumps(s["wildcards"], sort_keys=True))
        assert Path(s["output"]).name == f"smk.{s['rule']}-{s['pid']}.out"
        job_output = Path(s["output"]).read_text()
        assert dict(executed_jobs(job_output)) == {job: local_jobs[job]}, job_output
        assert "1 of 1 steps (100%) done" in job_output
    # With shards: 2 every model rule among the targets' jobs runs as one submitted job per shard.
    shards = collections.defaultdict(set)
    for s in submissions:
        if "shard" in s["wildcards"]:
            shards[s["rule"]].add(s["wildcards"]["shard"])
    for rule in ("reconstruct_prefixes", "generate_fixed_prefix", "audit_ledger", "transplant_caches", "dump_caches"):
        assert shards[rule] == {"0", "1"}, (rule, dict(shards))

    def job_starts(run):
        return [line for log in sorted((tmp_path / run / "logs").rglob("*.log")) for line in log.read_text().splitlines()
                if "job started" in line]

    forked = [line for line in job_starts("local") if "forked from the job server" in line]
    assert len(forked) >= 3, job_starts("local")
    assert job_starts("cluster") and not any("forked" in line for line in job_starts("cluster"))

    # The results: the same files with the same bytes, and the content fingerprints recorded in them read back.
    local, cluster = result_files(tmp_path / "local"), result_files(tmp_path / "cluster")
    assert sorted(local) == sorted(cluster)
    differing = [rel for rel in local if comparable(rel, local[rel]) != comparable(rel, cluster[rel])]
    assert not differing, f"differ between the local and the cluster run: {differing}"
    for files in (local, cluster):  # every hash record holds the digest of its file's bytes in that run
        for rel in filter(is_hash_record, files):
            recorded = files[rel].split(b"  ", 1)[0].decode()
            recorded_file = str(Path(rel).with_name(Path(rel).name[1:].removesuffix(".sha256")))
            assert recorded == hashlib.sha256(files[recorded_file]).hexdigest(), rel
    whole = [rel for rel in local if comparable(rel, local[rel]) is local[rel]]
    assert {Path(rel).suffix for rel in whole} >= {".parquet", ".json"}  # compared byte for byte
    assert "results/tiny/models/primary.json" in whole
    parquets = [rel for rel in local if rel.endswith(".parquet")]
    assert len(parquets) >= 10
    for rel in parquets:
        fingerprints = [pq.read_schema(tmp_path / run / rel).metadata[CONTENT_KEY] for run in ("local", "cluster")]
        assert fingerprints[0] == fingerprints[1] and len(fingerprints[0]) == 64, rel
        read_parquet(tmp_path / "cluster" / rel)  # refuses a file whose content does not match its fingerprint
        prov = read_provenance(tmp_path / "cluster" / rel)  # a gathered file: its parts' records
        assert {r["git_commit"] for r in [prov, *prov.get("parts", [])] if "git_commit" in r} == {commit}, rel
    assert len(read_parquet(tmp_path / "cluster/results/tiny/primary/ledger.parquet")) > 0
