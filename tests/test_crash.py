"""Crashes and interruptions: a run killed at any point (in a generation rule, in a dump) leaves no half-written
file that a rerun would trust, and `snakemake --rerun-incomplete` recomputes only what was lost."""

import hashlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from stagereplay.io import cache_dumps as cache_io
from stagereplay.io.parquet import atomic_path, hash_record_path, read_hash_record, read_parquet, write_parquet
from workflow_runner import snakemake_command

REPO = Path(__file__).resolve().parents[1]


def test_a_process_killed_while_writing_leaves_the_old_file(tmp_path):
    """SIGKILL in the middle of write_parquet: the target keeps its old bytes, and only a temp file is left."""
    target = tmp_path / "part.parquet"
    write_parquet(pd.DataFrame({"x": [1, 2, 3]}), target, {"stage": "test"})
    before = target.read_bytes()
    script = textwrap.dedent(f"""
        import os, signal
        import pandas as pd
        import pyarrow.parquet as pq
        from stagereplay.io.parquet import write_parquet

        def half_then_die(table, where, **kwargs):
            with open(where, "wb") as f:
                f.write(b"PAR1 half a file")
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        pq.write_table = half_then_die
        write_parquet(pd.DataFrame({{"x": [7, 8]}}), {str(target)!r}, {{"stage": "test"}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert target.read_bytes() == before
    assert read_parquet(target)["x"].tolist() == [1, 2, 3]
    assert read_hash_record(target).sha256 == hashlib.sha256(before).hexdigest()  # the old file's, still right
    leftovers = [p.name for p in tmp_path.iterdir() if p not in (target, hash_record_path(target))]
    assert len(leftovers) == 1 and leftovers[0].startswith(".part.parquet.") and leftovers[0].endswith(".tmp")


def test_a_failing_block_leaves_nothing(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


def crash_config(workdir):
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(run="crash", n_items=12, shards=2, max_new_tokens=16, device="cpu", precisions=["bf16"],
               dataset={"source": "synthetic", "size": 100, "seed": 0}, dump={"items": "all"})
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))


@pytest.mark.slow
def test_killed_in_the_middle_of_generation_then_rerun_incomplete(tmp_path):
    crash_config(tmp_path)
    target = "results/crash/primary/ledger.parquet"
    parts = tmp_path / "results/crash/primary/parts"
    logs = tmp_path / "logs/crash/primary"
    # One core: the shards run one after the other. Kill the whole process group (snakemake and the job's
    # interpreter, as a lost node would) once one shard is done and the other is generating.
    proc = subprocess.Popen(snakemake_command(tmp_path, "--cores", "1", target), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    killed_shard = None
    deadline = time.time() + 600
    try:
        while killed_shard is None and time.time() < deadline and proc.poll() is None:
            for done, running in ((0, 1), (1, 0)):
                log = logs / f"reconstruct_prefixes_bf16_{running}.log"
                generating = log.exists() and f"shard {running}:" in log.read_text()  # its progress bar began
                if (parts / f"prefixes_bf16_{done}.parquet").exists() and generating:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed_shard = running
                    break
            time.sleep(0.05)
    finally:
        if proc.poll() is None and killed_shard is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert killed_shard is not None, "the run ended before the second shard could be caught generating"
    done_shard = 1 - killed_shard
    # Nothing the killed job would have made exists under its own name; the finished shard's files are whole.
    assert not (parts / f"matched_bf16_{killed_shard}.parquet").exists()
    assert not (parts / f"prefixes_bf16_{killed_shard}.parquet").exists()
    kept = {name: (parts / name).stat().st_mtime_ns for name in
            (f"matched_bf16_{done_shard}.parquet", f"prefixes_bf16_{done_shard}.parquet")}
    for name in kept:
        read_parquet(parts / name)
    assert not (tmp_path / "results/crash/primary/ledger.parquet").exists()

    # The lock of the killed run stays behind: --unlock, then --rerun-incomplete.
    subprocess.run(snakemake_command(tmp_path, "--unlock"), check=True, capture_output=True)
    rerun = subprocess.run(snakemake_command(tmp_path, "--cores", "1", "--rerun-incomplete", target),
                           capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert {name: (parts / name).stat().st_mtime_ns for name in kept} == kept  # not recomputed
    jobs = re.findall(r"^(?:local)?rule (\w+):", rerun.stderr, flags=re.M)
    assert jobs.count("reconstruct_prefixes") == 1 and "select_items" not in jobs, jobs
    ran = [line for line in rerun.stderr.splitlines() if "reconstruct_prefixes_bf16_" in line and "log:" in line]
    assert ran and all(f"_bf16_{killed_shard}.log" in line for line in ran)
    ledger = read_parquet(tmp_path / "results/crash/primary/ledger.parquet")
    assert ledger["item_index"].nunique() == 12


@pytest.mark.slow
def test_killed_in_the_middle_of_a_dump_then_rerun_incomplete(tmp_path):
    crash_config(tmp_path)
    ledger = subprocess.run(snakemake_command(tmp_path, "--cores", "2", "results/crash/primary/ledger.parquet"),
                            capture_output=True, text=True)
    assert ledger.returncode == 0, ledger.stderr[-3000:]
    # Kill it in the middle of dump_caches, with some dumps written and others not.
    caches = tmp_path / "results/crash/primary/caches"
    part = tmp_path / "results/crash/primary/parts/caches_0"  # the one shard's dumps, before gather_caches
    manifest = tmp_path / "results/crash/primary/caches.parquet"
    proc = subprocess.Popen(snakemake_command(tmp_path, "--cores", "1", str(manifest.relative_to(tmp_path))),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    killed = False
    deadline = time.time() + 600
    try:
        while not killed and time.time() < deadline and proc.poll() is None:
            if part.is_dir() and any(part.glob("*.safetensors")):
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
            time.sleep(0.005)
    finally:
        if proc.poll() is None and not killed:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert killed, "the dump ended before it could be caught"
    assert not manifest.exists()
    dumped = sorted(part.glob("*.safetensors"))
    assert 0 < len(dumped) < 2 * 12  # caught in the middle
    for path in dumped:  # every dump under its own name is whole: its bytes match the fingerprints inside it
        cache_io.load_cache(path)
    # the other shard's dump ran before the killed one, or never started (one job at a time, in Snakemake's order)
    other_done = (tmp_path / "results/crash/primary/parts/caches_1.parquet").exists()
    subprocess.run(snakemake_command(tmp_path, "--unlock"), check=True, capture_output=True)
    rerun = subprocess.run(snakemake_command(tmp_path, "--cores", "1", "--rerun-incomplete",
                                         str(manifest.relative_to(tmp_path))), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # the killed shard's dump again (--rerun-incomplete), the other shard's unless it had finished, then their gather
    assert sorted(re.findall(r"^(?:local)?rule (\w+):", rerun.stderr, flags=re.M)) == [
        "dump_caches"] * (1 if other_done else 2) + ["gather_caches"], rerun.stderr[-3000:]
    assert "reason: Forced execution" in rerun.stderr.split("output: results/crash/primary/parts/caches_0,")[1][:400]
    assert len(read_parquet(manifest)) == 2 * 12 == len(list(caches.glob("*.safetensors")))
