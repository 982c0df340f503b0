"""The job server is never bypassed silently: a job that runs in its own process says why in its log and, once per
run, on the run's console (the stderr a rule script's job was started with, not its log); the run's start probes
its server as a job would (a stopped server is found before the first job); a stopped server costs a run one wait,
not one per job; a $TMPDIR whose usual folder fits a socket gets the server; a server one of whose imported files
changed forks no more jobs. (How a server is started and a job run: tests/test_job_server.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from test_job_server import key_of, make_tree, refusing_server, start_server

# A job as a rule script starts it (stagereplay.stages.rule_job.start_job): its stderr is its log from its first
# line on, while its descriptor 2 is still the console of the run that started it.
LOGGED_JOB = """
import json, logging, os, sys
sys.stderr = open(os.environ["JOB_LOG"], "a")
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
from stagereplay.runtime.hand_over import hand_over
from stagereplay.runtime.server_protocol import CHILD_ENV
hand_over({"job_server": True, "job_server_timeout_s": 1}, tuple(os.environ.get("JOB_PRELOAD", "json").split(",")))
print(json.dumps({"child": bool(os.environ.get(CHILD_ENV))}), flush=True)
"""
RUN_ENV = "STAGEREPLAY_JOB_SERVER_RUN"


@pytest.fixture
def tree(tmp_path):
    tmp, env = make_tree(tmp_path)
    (tmp / "logged_job.py").write_text(LOGGED_JOB)
    return tmp, env


def run_jobs(tmp, env, count: int, **extra) -> list[tuple[bool, str, str]]:
    """Run ``count`` logged jobs one after the other: for each, whether it forked, its console and its log."""
    done = []
    for n in range(len(list(tmp.glob("job-*.log"))), len(list(tmp.glob("job-*.log"))) + count):
        log = tmp / f"job-{n}.log"
        proc = subprocess.run([sys.executable, str(tmp / "logged_job.py")], env=dict(env, JOB_LOG=str(log), **extra),
                              cwd=tmp / "work", capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr + log.read_text()
        done.append((json.loads(proc.stdout)["child"], proc.stderr, log.read_text()))
    return done


def a_run(tmp, name: str) -> Path:
    where = tmp / name
    where.mkdir(mode=0o700)
    return where


def test_a_stopped_server_costs_a_run_one_wait_and_its_console_one_line(tree):
    """A stopped server (SIGSTOP) takes connections but greets no job: the run's first job waits for it, tells the
    run's console why once, and marks it; the run's later jobs read the mark and run in their own processes at once
    (their logs say so). Another run waits once again (its server may answer by then), and once it answers, jobs
    fork from it."""
    tmp, env = tree
    server = start_server(env, key_of(env))
    said = "did not greet the job within 1 s (stopped, or overloaded?)"
    try:
        os.kill(server.pid, signal.SIGSTOP)
        jobs = run_jobs(tmp, env, 3, **{RUN_ENV: str(a_run(tmp, "run-1"))})
        assert not any(child for child, _, _ in jobs)
        consoles, logs = [console for _, console, _ in jobs], [log for _, _, log in jobs]
        assert said in consoles[0] and f"(pid {server.pid})" in consoles[0] and "stagereplay: job server not used" \
            in consoles[0] and consoles[0].count("\n") == 1
        assert consoles[1:] == ["", ""]  # told once
        assert said in logs[0] and "did not wait" not in logs[0]  # the one wait of the run
        assert all("met by an earlier job of this run: this job did not wait for it" in log for log in logs[1:])
        child, console, _ = run_jobs(tmp, env, 1, **{RUN_ENV: str(a_run(tmp, "run-2"))})[0]
        assert not child and said in console
        os.kill(server.pid, signal.SIGCONT)
        child, console, log = run_jobs(tmp, env, 1, **{RUN_ENV: str(a_run(tmp, "run-3"))})[0]
        assert child and console == "" and "job server not used" not in log
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.terminate()
        server.wait(timeout=30)


START = """
import logging, os, subprocess, sys
from stagereplay.stages.rule_job import start_job_server
level, said = start_job_server({"job_server": True})
print(logging.getLevelName(level), said, flush=True)
for n in range(int(os.environ.get("JOBS", "0"))):  # the run's jobs, in its environment (its folder of marks)
    subprocess.run([sys.executable, "../logged_job.py"], env=dict(os.environ, JOB_LOG=f"../job-{n}.log"), check=True)
"""


def start_run(tmp, env, jobs=0, **extra) -> subprocess.CompletedProcess:
    """A run's start (its onstart's start_job_server), then ``jobs`` of its jobs of the run's key: what it said on
    stdout, and the jobs' consoles on stderr."""
    from stagereplay.stages.rule_job import PRELOAD

    return subprocess.run([sys.executable, "-c", START], env=dict(env, JOBS=str(jobs), JOB_PRELOAD=",".join(PRELOAD),
                                                                  **extra),
                          cwd=tmp / "work", capture_output=True, text=True, timeout=120)


def test_the_run_s_start_greets_its_server_as_a_job_does_and_its_jobs_do_not_wait_for_a_stopped_one(tree):
    """The start's check is a greeting round trip, not a connection (which a stopped server's backlog takes): it
    says on the run's console that the server does not answer, and no job of the run waits for it or says it
    again on the console. The control: a server that answers is said to."""
    from stagereplay.stages.rule_job import PRELOAD

    tmp, env = tree
    # A light server on the run's key: the start only probes it (it refuses the jobs: its imports are not the key's).
    server = start_server(env, key_of(env, ",".join(PRELOAD)))
    try:
        proc = start_run(tmp, env)
        assert proc.returncode == 0 and proc.stdout.startswith("INFO job server ") and "answers already" in proc.stdout
        os.kill(server.pid, signal.SIGSTOP)
        proc = start_run(tmp, env, jobs=2)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("WARNING job server not used, this run's model jobs run in their own processes")
        assert f"(pid {server.pid}) did not greet within 3 s (stopped, or overloaded?)" in proc.stdout
        assert proc.stderr == ""  # the jobs' consoles: told by the start
        logs = [(tmp / f"job-{n}.log").read_text() for n in range(2)]
        assert all("did not wait for it" in log and "did not greet within 3 s" in log for log in logs)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.terminate()
        server.wait(timeout=30)


def test_a_folder_no_server_may_use_is_told_on_the_console_once_per_run(tree):
    """A symbolic link for the server folder (or any other reason no server can serve): the run's start says it on
    the console, its jobs only in their logs; a job outside a run, whose stderr is its log, tells its console too."""
    tmp, env = tree
    real = a_run(tmp, "real")
    link = Path(env["STAGEREPLAY_JOB_SERVER_DIR"])
    link.symlink_to(real)
    proc = start_run(tmp, env, jobs=2)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("WARNING job server not used") and f"{link} is a symbolic link" in proc.stdout
    assert proc.stderr == "" and all(f"{link} is a symbolic link" in (tmp / f"job-{n}.log").read_text()
                                     for n in range(2))
    jobs = run_jobs(tmp, env, 2, **{RUN_ENV: str(a_run(tmp, "run"))})  # a run whose start said nothing
    assert [console.count(f"{link} is a symbolic link") for _, console, _ in jobs] == [1, 0]
    assert all(f"{link} is a symbolic link" in log for _, _, log in jobs)
    _, console, _ = run_jobs(tmp, env, 1)[0]  # no run: the job is its own
    assert f"{link} is a symbolic link" in console and list(real.iterdir()) == []


def usual_folder_limit() -> int:
    """The longest $TMPDIR whose usual server folder (stagereplay-jobs-<uid>) holds a socket's longest name."""
    from stagereplay.runtime.server_folder import KEY_CHARS, SUN_PATH_MAX, bound_path
    from stagereplay.runtime.server_protocol import PID_MAX

    name = bound_path(Path("k" * KEY_CHARS + ".sock"), PID_MAX).name
    return SUN_PATH_MAX - len(f"/stagereplay-jobs-{os.getuid()}/{name}")


def temp_folder_of(length: int) -> Path:
    base = Path(tempfile.mkdtemp(prefix="sr-", dir="/tmp"))
    long_tmp = base / ("t" * (length - len(str(base)) - 1))
    long_tmp.mkdir()
    assert len(str(long_tmp)) == length
    return long_tmp


@pytest.mark.parametrize("length", [42, usual_folder_limit()], ids=["42 characters", "the longest that fits"])
def test_a_temp_folder_whose_usual_server_folder_fits_gets_the_server(tree, length):
    """$TMPDIR of 42 to 54 characters (uid 0) turned the server off: a cut at 60 characters of the folder sent the
    sockets to a hashed folder in the same $TMPDIR, longer still. The socket's own longest path decides now."""
    import shutil

    from stagereplay.runtime.hand_over import stop_servers

    tmp, env = tree
    long_tmp = temp_folder_of(length)
    env = dict(env, TMPDIR=str(long_tmp))
    del env["STAGEREPLAY_JOB_SERVER_DIR"]  # the usual folder, in the temp folder
    usual = long_tmp / f"stagereplay-jobs-{os.getuid()}"
    try:
        child, console, log = run_jobs(tmp, env, 1)[0]
        assert not child and "job server not used" not in console + log
        assert (usual / f"{key_of(env)}.lock").exists() and (usual / f"{key_of(env)}.log").exists()
        for _ in range(600):  # the server it started imports json, then answers on its socket there: stop it
            if stop_servers(usual):
                break
            time.sleep(0.1)
        assert "serving on " + str(usual / key_of(env)) in (usual / f"{key_of(env)}.log").read_text()
    finally:
        stop_servers(usual)
        shutil.rmtree(long_tmp.parent)


def test_one_character_more_than_fits_is_told_not_rerouted_into_the_same_folder(monkeypatch):
    """Past the limit no folder in $TMPDIR fits: the job says why (socket_problem) rather than trying a longer one."""
    from stagereplay.runtime import server_folder

    long_tmp = temp_folder_of(usual_folder_limit() + 1)
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
        monkeypatch.delenv(server_folder.FOLDER_ENV, raising=False)
        usual = server_folder.folder()
        assert server_folder.socket_folder() == usual
        assert "is too long for it" in server_folder.socket_problem(server_folder.socket_path("k" * 20))
        monkeypatch.setattr(tempfile, "tempdir", str(long_tmp)[:-1])
        assert server_folder.socket_problem(server_folder.socket_path("k" * 20)) is None
    finally:
        long_tmp.rmdir()
        long_tmp.parent.rmdir()


def test_a_server_one_of_whose_imported_files_changed_forks_no_more_jobs(tree):
    """The key holds what a job knows before it imports; the server checks the files it imported (here a module
    its preload imports in turn, outside this package, as transformers' modeling files or pandas are) before each
    job: changed, it forks none and exits, and the next job starts a server that imports the new file."""
    tmp, env = tree
    (tmp / "src/dependency.py").write_text("VALUE = 1\n")
    (tmp / "src/preloaded.py").write_text("import dependency\n")
    key = key_of(env, "json,preloaded")
    server = start_server(env, key, preload="json,preloaded")
    try:
        assert run_jobs(tmp, env, 1, JOB_PRELOAD="json,preloaded")[0][0]  # the control: it forks
        (tmp / "src/dependency.py").write_text("VALUE = 22\n")
        assert key_of(env, "json,preloaded") == key
        child, console, log = run_jobs(tmp, env, 1, JOB_PRELOAD="json,preloaded")[0]
        assert not child and console == "" and "dependency.py, which it imported, changed since it started" in log
        assert server.wait(timeout=30) == 0 and "dependency.py, which it imported, changed" in server.stdout.read()
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)



def test_a_server_that_refused_to_serve_is_told_on_the_console_with_its_reason(tree):
    """A server whose imports left it unlike a fresh process refuses to serve, once: the jobs of its key then run in
    their own processes, and the run's console is told why (the server's own words), once."""
    tmp, env = tree
    key, server = refusing_server(tmp, env)
    assert server.returncode == 1 and "refusing to serve" in server.stdout
    jobs = run_jobs(tmp, env, 2, JOB_PRELOAD="starts_a_thread", **{RUN_ENV: str(a_run(tmp, "run"))})
    said = f"the job server of key {key} refused to serve: 2 Python threads after the imports"
    assert [console.count(said) for _, console, _ in jobs] == [1, 0] and all(said in log for _, _, log in jobs)
