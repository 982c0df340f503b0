"""The job server: a job forked from it is the job (its streams, folder, environment, arguments, exit status and
signals), a job whose code or import-time environment differs never forks from it, and a server whose imports left
it unlike a fresh process refuses to serve. (That a forked model job computes the bytes of a fresh one is shown by
tests/test_cluster_executor.py, whose local run forks its model jobs and whose submitted jobs are fresh.)"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

JOB = """
import json, os, sys, time
from stagereplay.runtime.job_server import CHILD_ENV, hand_over
hand_over({"job_server": True}, tuple(os.environ.get("JOB_PRELOAD", "json").split(",")))
print(json.dumps({"child": bool(os.environ.get(CHILD_ENV)), "pid": os.getpid(), "ppid": os.getppid(),
                  "cwd": os.getcwd(), "argv": sys.argv[1:], "var": os.environ.get("JOB_VAR"),
                  "umask": os.umask(0o22)}), flush=True)
print("a line to stderr", file=sys.stderr)
if os.environ.get("MODE") == "sleep":
    time.sleep(120)
if os.environ.get("MODE") == "raise":
    raise RuntimeError("the job's own error")
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def tree(tmp_path):
    """A copy of the package (its files can change under a running server) and a job script, with the
    environment that runs them."""
    shutil.copytree(REPO / "src/stagereplay", tmp_path / "src/stagereplay",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "work").mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "src"), STAGEREPLAY_JOB_SERVER_DIR=str(tmp_path / "servers"),
               JOB_VAR="from the job")
    env.pop("STAGEREPLAY_JOB_SERVER_CHILD", None)
    return tmp_path, env


def key_of(env, preload="json") -> str:
    """The key of a server that imports ``preload`` (comma-separated), for a job of ``env``."""
    return subprocess.run([sys.executable, "-c", "from stagereplay.runtime.job_server import server_key; "
                           f"print(server_key(preload=tuple({preload!r}.split(','))))"], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def start_server(env, key, preload="json", idle_s=60) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "stagereplay.runtime.job_server", "--key", key, "--idle-s",
                               str(idle_s), "--preload", preload], env=env, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    assert "serving on" in line, line + server.stdout.read()
    return server


def hold_lock(env, key):
    """Hold a key's lock as a starting server would: a job that misses the server then starts none."""
    folder = Path(env["STAGEREPLAY_JOB_SERVER_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / f"{key}.lock", "a+")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return handle


def gone(pid: int) -> bool:
    """The process has ended (a zombie has: only its parent's reaping is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def run_job(tmp, env, *args, **extra):
    proc = subprocess.run([sys.executable, str(tmp / "job.py"), *args], env=dict(env, **extra), cwd=tmp / "work",
                          capture_output=True, text=True, timeout=120)
    return proc, (json.loads(proc.stdout.splitlines()[0]) if proc.stdout.strip() else None)


def test_a_forked_job_is_the_job(tree):
    tmp, env = tree
    key = key_of(env)
    server = start_server(env, key)
    try:
        proc, seen = run_job(tmp, env, "an", "argument", CODE="5", JOB_VAR="this job's")
        assert seen["child"] and seen["ppid"] == server.pid and seen["pid"] not in (server.pid,)
        assert (seen["cwd"], seen["argv"], seen["var"]) == (str(tmp / "work"), ["an", "argument"], "this job's")
        assert seen["umask"] == (lambda m: (os.umask(m), m)[1])(os.umask(0o22))  # the job's umask
        assert "a line to stderr" in proc.stderr and proc.returncode == 5
        proc, seen = run_job(tmp, env, MODE="raise")  # an uncaught error: its traceback on the job's stderr
        assert seen["child"] and proc.returncode == 1 and "RuntimeError: the job's own error" in proc.stderr

        # A signal to the job (Snakemake cancelling it) reaches the forked child, which dies of it; a job killed
        # outright (SIGKILL, nothing to pass on) takes its child with it all the same.
        for signum in (signal.SIGTERM, signal.SIGKILL):
            job = subprocess.Popen([sys.executable, str(tmp / "job.py")], env=dict(env, MODE="sleep"),
                                   cwd=tmp / "work", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            seen = json.loads(job.stdout.readline())
            assert seen["child"]
            job.send_signal(signum)
            assert job.wait(timeout=30) == (1 if signum == signal.SIGTERM else -signal.SIGKILL)
            if signum == signal.SIGTERM:
                assert "ended without an exit status" in job.stderr.read()
            for _ in range(50):
                if not gone(seen["pid"]):
                    time.sleep(0.1)
            assert gone(seen["pid"]), f"the forked child outlived its job killed by {signal.Signals(signum).name}"

        # The control: a job whose package files changed, whose import-time environment differs, or that asks for
        # a server importing other modules, is another key: it runs in its own process and never forks from this
        # server.
        other = dict(env, TOKENIZERS_PARALLELISM="false")
        with hold_lock(other, key_of(other)):
            proc, seen = run_job(tmp, other)
        assert not seen["child"] and seen["ppid"] != server.pid and proc.returncode == 0
        with hold_lock(env, key_of(env, "json,csv")):
            proc, seen = run_job(tmp, env, JOB_PRELOAD="json,csv")
        assert not seen["child"] and seen["ppid"] != server.pid and proc.returncode == 0
        (tmp / "src/stagereplay/io/ids.py").write_text((tmp / "src/stagereplay/io/ids.py").read_text() + "\n")
        with hold_lock(env, key_of(env)):
            proc, seen = run_job(tmp, env)
        assert not seen["child"] and proc.returncode == 0
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_server_whose_imports_start_a_thread_refuses_and_jobs_run_in_their_own_processes(tree):
    tmp, env = tree
    (tmp / "src/starts_a_thread.py").write_text("import threading, time\n"
                                                "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    key = key_of(env, "starts_a_thread")
    server = subprocess.run([sys.executable, "-m", "stagereplay.runtime.job_server", "--key", key, "--preload",
                             "starts_a_thread"], env=env, capture_output=True, text=True, timeout=60)
    assert server.returncode == 1 and "refusing to serve" in server.stdout and "2 Python threads" in server.stdout
    assert (Path(env["STAGEREPLAY_JOB_SERVER_DIR"]) / f"{key}.refused").exists()
    proc, seen = run_job(tmp, env, JOB_PRELOAD="starts_a_thread")  # no server answers, none is started again
    assert not seen["child"] and proc.returncode == 0
    assert not (Path(env["STAGEREPLAY_JOB_SERVER_DIR"]) / f"{key}.log").exists()


def test_a_folder_others_can_enter_gets_no_server(tree):
    """A job's request carries its environment and its streams: the server folder must be this user's alone. One
    that others may enter (made before by someone else, or opened up) is used for nothing, and the job says so."""
    tmp, env = tree
    servers = Path(env["STAGEREPLAY_JOB_SERVER_DIR"])
    servers.mkdir()
    servers.chmod(0o777)
    proc, seen = run_job(tmp, env)
    assert not seen["child"] and proc.returncode == 0
    assert "is not this user's alone" in proc.stderr and "chmod 700" in proc.stderr
    assert list(servers.iterdir()) == []  # no lock, no log, no server started
    servers.chmod(0o700)  # the control: in a private folder the job starts a server (its lock and log appear)
    key = key_of(env)
    proc, seen = run_job(tmp, env)
    assert not seen["child"] and "is not this user's alone" not in proc.stderr
    assert (servers / f"{key}.lock").exists() and (servers / f"{key}.log").exists()
    from stagereplay.runtime.job_server import stop_servers

    for _ in range(600):  # the server it started imports its preload, then answers: stop it
        if stop_servers(servers):
            break
        time.sleep(0.1)
