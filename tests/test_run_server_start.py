"""A run starts its job server before its first job (its onstart), where it has model jobs to run: the server
imports while the run selects its items and prepares the model, and the first model jobs fork from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stagereplay.stages.rule_job import starts_warm
from test_rule_scripts import SCRIPTS, is_warm

REPO = Path(__file__).resolve().parents[1]


def test_the_run_knows_a_warm_script_as_the_scripts_test_does():
    assert [starts_warm(s) for s in SCRIPTS] == [is_warm(s) for s in SCRIPTS]
    assert any(starts_warm(s) for s in SCRIPTS) and not all(starts_warm(s) for s in SCRIPTS)


def run(workdir: Path, until: str, servers: Path) -> str:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config.update(run="early", n_items=2, max_stage_tokens=16, max_new_tokens=4, precisions=["fp32"], reference_precision="fp32", device="cpu",
                  model=str(REPO / "data/toy"), job_server=True, dataset={"source": "synthetic", "size": 20, "seed": 0})
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "STAGEREPLAY_JOB_SERVER_DIR": str(servers)}
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory",
                           str(workdir), "--cores", "2", "--until", until], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_a_run_with_model_jobs_starts_the_server_before_them_and_one_without_starts_none(tmp_path):
    servers = Path("/tmp") / f"sr-early-{os.getpid()}"  # short: a socket's path has at most 107 bytes
    try:
        output = run(tmp_path / "tables", "select_items", servers)
        assert "starting in the background" not in output and not list(servers.glob("*.sock"))
        output = run(tmp_path / "models", "reconstruct_prefixes", servers)
        assert "starting in the background for the model jobs" in output
        assert output.index("starting in the background") < output.index("rule select_items")
        assert len(list(servers.glob("*.sock"))) == 1  # the jobs' key: no second server
    finally:
        from stagereplay.runtime.hand_over import stop_servers

        stop_servers(servers)


@pytest.mark.slow
def test_a_run_whose_server_is_stopped_says_so_once_and_its_model_jobs_do_not_wait_for_it(tmp_path):
    """A stopped (SIGSTOP) server on the run's key: the run's start greets it as a job would, tells the console once,
    and the model jobs run in their own processes at once (their logs say why), none waiting for it."""
    import signal

    from stagereplay.stages.rule_job import PRELOAD
    from test_job_server import key_of, start_server

    servers = Path("/tmp") / f"sr-stopped-{os.getpid()}"
    # The run's key: the workflow goes offline before its start (stagereplay.models.sources), in its jobs' environment.
    env = {**os.environ, "STAGEREPLAY_JOB_SERVER_DIR": str(servers), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    server = start_server(env, key_of(env, ",".join(PRELOAD)))  # light: the run only probes it
    try:
        os.kill(server.pid, signal.SIGSTOP)
        output = run(tmp_path / "stopped", "reconstruct_prefixes", servers)
        assert output.count("job server not used") == 1, output
        assert f"(pid {server.pid}) did not greet within 3 s (stopped, or overloaded?)" in output
        logs = list((tmp_path / "stopped").rglob("reconstruct_prefixes_*.log"))
        assert logs and all("this job did not wait for it" in log.read_text() for log in logs)
        assert all("did not greet the job within" not in log.read_text() for log in logs)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.terminate()
        server.wait(timeout=30)
