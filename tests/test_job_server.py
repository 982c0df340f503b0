"""The job server: a job forked from it is the job (its streams, folder, environment, arguments, exit status and
signals, CPU affinity, niceness, resource limits, temp folder and thread counts), a job whose code or import-time
environment differs never forks from it, a job whose process attributes its child cannot take runs in its own
process, and a server whose imports left it unlike a fresh process refuses to serve. (That a forked model job
computes the bytes of a fresh one is shown by tests/test_cluster_executor.py, whose local run forks its model jobs
and whose submitted jobs are fresh.)"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import threading
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

JOB = """
import importlib, json, logging, os, resource, subprocess, sys, tempfile, time
logging.basicConfig(level=logging.INFO)  # the hand-over's lines: why a job runs in its own process
from stagereplay.runtime.hand_over import hand_over
from stagereplay.runtime.server_protocol import CHILD_ENV
preload = tuple(os.environ.get("JOB_PRELOAD", "json").split(","))
hand_over({"job_server": not os.environ.get("JOB_FRESH"), **json.loads(os.environ.get("JOB_CONFIG", "{}"))}, preload)
for name in filter(None, os.environ.get("JOB_IMPORTS", ",".join(preload)).split(",")):
    importlib.import_module(name)  # by default its preload: a fresh process imports what a forked one finds
seen = {"child": bool(os.environ.get(CHILD_ENV)), "pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
        "argv": sys.argv[1:], "var": os.environ.get("JOB_VAR"), "umask": os.umask(0o22),
        "affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "scheduler": os.sched_getscheduler(0), "tempdir": tempfile.gettempdir(),
        "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource)
                    if name.startswith("RLIMIT_")}}
seen["spawned"] = subprocess.Popen(["sleep", "120"]).pid if os.environ.get("MODE") == "spawn" else None
seen["modules"] = {name: name in sys.modules for name in filter(None, os.environ.get("JOB_ASK", "").split(","))}
if "matplotlib" in sys.modules:
    import matplotlib
    seen["rc"] = {key: repr(value) for key, value in matplotlib.rcParams.items()}
if "torch" in sys.modules:  # every thread count the loaded libraries hold
    import ctypes, pyarrow, torch
    seen["threads"] = {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
                       "pyarrow": pyarrow.cpu_count(), "omp and mkl": [line.strip() for line in
                       torch.__config__.parallel_info().splitlines() if "max_threads" in line]}
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        for name in ("openblas_get_num_threads", "scipy_openblas_get_num_threads", "scipy_openblas_get_num_threads64_"):
            if "openblas" in path and hasattr(ctypes.CDLL(path), name):
                seen["threads"][os.path.basename(path)] = getattr(ctypes.CDLL(path), name)()
print(json.dumps(seen), flush=True)
print("a line to stderr", file=sys.stderr)
if os.environ.get("MODE") in ("sleep", "spawn"):
    time.sleep(120)
if os.environ.get("MODE") == "wait":  # until the test says
    while not os.path.exists(os.environ["WAIT_FOR"]):
        time.sleep(0.05)
if os.environ.get("MODE") == "raise":
    raise RuntimeError("the job's own error")
sys.exit(int(os.environ.get("CODE", "0")))
"""


def make_tree(tmp_path, servers=None):
    """A copy of the package (its files can change under a running server) and the workflow's schema beside it,
    as in a checkout (the stages read their defaults from it), and a job script, with the environment that runs
    them."""
    shutil.copytree(REPO / "src/stagereplay", tmp_path / "src/stagereplay",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "workflow/schemas", tmp_path / "workflow/schemas")
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "work").mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "src"), JOB_VAR="from the job",
               STAGEREPLAY_JOB_SERVER_DIR=str(servers or tmp_path / "servers"))
    env.pop("STAGEREPLAY_JOB_SERVER_CHILD", None)
    return tmp_path, env


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path)


def key_of(env, preload="json") -> str:
    """The key of a server that imports ``preload`` (comma-separated), for a job of ``env``."""
    return subprocess.run([sys.executable, "-c", "from stagereplay.runtime.server_key import server_key; "
                           f"print(server_key(preload=tuple({preload!r}.split(','))))"], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def start_server(env, key, preload="json", idle_s=60, prefix=(), cwd=None) -> subprocess.Popen:
    server = subprocess.Popen([*prefix, sys.executable, "-m", "stagereplay.runtime.job_server", "--key", key,
                               "--idle-s", str(idle_s), "--preload", preload], env=env, stdout=subprocess.PIPE,
                              text=True, cwd=cwd)
    lines = [server.stdout.readline()]
    while lines[-1] and "serving on" not in lines[-1]:  # after what it did not preload
        lines.append(server.stdout.readline())
    assert "serving on" in lines[-1], "".join(lines) + server.stdout.read()
    return server


def refusing_server(tmp, env) -> tuple[str, subprocess.CompletedProcess]:
    """A server whose preloaded module starts a Python thread, run until it refuses to serve: its key and output."""
    (tmp / "src/starts_a_thread.py").write_text("import threading, time\n"
                                                "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    key = key_of(env, "starts_a_thread")
    return key, subprocess.run([sys.executable, "-m", "stagereplay.runtime.job_server", "--key", key, "--preload",
                                "starts_a_thread"], env=env, capture_output=True, text=True, timeout=60)


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


def run_job(tmp, env, *args, prefix=(), timeout=120, **extra):
    """Run the job (under the command ``prefix``, e.g. taskset): its process and what it saw."""
    proc = subprocess.run([*prefix, sys.executable, str(tmp / "job.py"), *args], env=dict(env, **extra),
                          cwd=tmp / "work", capture_output=True, text=True, timeout=timeout)
    return proc, (json.loads(proc.stdout.splitlines()[0]) if proc.stdout.strip() else None)


def forked_and_fresh(tmp, env, prefix=(), **extra):
    """What the job saw forked from the server, and what the same job saw in a fresh process."""
    proc, forked = run_job(tmp, env, prefix=prefix, **extra)
    assert proc.returncode == 0, proc.stderr
    return forked, run_job(tmp, env, prefix=prefix, JOB_FRESH="1", **extra)[1]


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
        for other in (dict(env, TOKENIZERS_PARALLELISM="false"), dict(env, LC_ALL="C")):
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
    key, server = refusing_server(tmp, env)
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
    from stagereplay.runtime.hand_over import stop_servers

    for _ in range(600):  # the server it started imports its preload, then answers: stop it
        if stop_servers(servers):
            break
        time.sleep(0.1)


def owned_by_another_user(where: Path) -> Path:
    """A private folder of another uid's: ``where`` given away (as root), else the root folder (not this user's)."""
    if os.getuid() != 0:
        return Path("/")
    where.mkdir(mode=0o700)
    os.chown(where, 65534, -1)
    return where


@pytest.mark.parametrize("case", ["a link", "another user's"])
def test_a_folder_that_is_a_link_or_another_users_gets_no_server_and_its_real_cause(tree, case):
    """chmod 700 mends neither a link nor a folder of another owner's: the job names what is wrong and what mends it."""
    tmp, env = tree
    real = tmp / "real"
    real.mkdir(mode=0o700)
    servers = Path(env["STAGEREPLAY_JOB_SERVER_DIR"])
    if case == "a link":
        servers.symlink_to(real)
    else:
        servers = owned_by_another_user(servers)
        env = dict(env, STAGEREPLAY_JOB_SERVER_DIR=str(servers))
    proc, seen = run_job(tmp, env)
    assert not seen["child"] and proc.returncode == 0 and "chmod" not in proc.stderr
    assert "this job runs in its own process" in proc.stderr and "set $STAGEREPLAY_JOB_SERVER_DIR" in proc.stderr
    if case == "a link":
        assert f"{servers} is a symbolic link (to {real})" in proc.stderr and "not a link" in proc.stderr
        assert list(real.iterdir()) == []  # no lock, no log, no server started through the link
    else:
        assert (f"{servers} belongs to uid {servers.stat().st_uid}, not to this user (uid {os.getuid()}): this "
                "user cannot use it") in proc.stderr


def test_a_temp_folder_too_long_for_a_socket_gets_no_server_and_one_message(tree):
    """Under a long $TMPDIR (as some batch systems set) no server could bind its socket: the job says so (the path,
    its length, the limit, the mend) and starts none, rather than one per job that imports for seconds and dies."""
    tmp, env = tree
    long_tmp = tmp / ("t" * (99 - len(str(tmp)) - 1))
    long_tmp.mkdir()
    env = dict(env, TMPDIR=str(long_tmp))
    del env["STAGEREPLAY_JOB_SERVER_DIR"]  # the default: a folder in the temp folder
    for _ in range(2):
        proc, seen = run_job(tmp, env)
        assert not seen["child"] and proc.returncode == 0 and proc.stderr.count("job server not used") == 1
        assert f"the system temp folder ($TMPDIR, {long_tmp}) is too long" in proc.stderr
        assert "over the 107 bytes a socket's path may have" in proc.stderr and "bytes long" in proc.stderr
        assert "set $STAGEREPLAY_JOB_SERVER_DIR to a short folder" in proc.stderr
        assert not list(long_tmp.glob("stagereplay-jobs-*/*.log"))  # no server started
    short = Path(tempfile.mkdtemp(prefix="sr-", dir="/tmp")) / "jobs"  # the mend: a short folder
    try:
        proc, seen = run_job(tmp, dict(env, STAGEREPLAY_JOB_SERVER_DIR=str(short)))
        assert "job server not used" not in proc.stderr and list(short.glob("*.log"))
        from stagereplay.runtime.hand_over import stop_servers

        for _ in range(600):  # the server it started imports the model stack, then answers: stop it
            if stop_servers(short):
                break
            time.sleep(0.1)
    finally:
        shutil.rmtree(short.parent)


def test_the_socket_path_limit_is_the_kernels():
    """socket_problem's limit is where binding starts to fail: the longest path it passes binds, one byte more fails."""
    from stagereplay.runtime.server_folder import SUN_PATH_MAX, bound_path, socket_problem
    from stagereplay.runtime.server_protocol import PID_MAX

    base = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))
    try:
        suffix = len(bound_path(Path("k.sock"), PID_MAX).name) - len("k")  # ".<pid>.part"
        for size, fits in ((SUN_PATH_MAX, True), (SUN_PATH_MAX + 1, False)):
            path = base / ("k" * (size - len(f"{base}/") - suffix) + ".sock")
            assert (socket_problem(path) is None) == fits
            longest = bound_path(path, PID_MAX)
            assert len(str(longest)) == size
            with socket.socket(socket.AF_UNIX) as sock:
                if fits:
                    sock.bind(str(longest))
                else:
                    with pytest.raises(OSError, match="too long"):
                        sock.bind(str(longest))
    finally:
        shutil.rmtree(base)


QUICK = json.dumps({"job_server_timeout_s": 1})  # the hand-over's timeout in the jobs below


def test_a_stopped_server_holds_a_job_seconds_not_forever(tree):
    """A stopped server (SIGSTOP) still takes connections, in its backlog: the job waits job_server_timeout_s for its
    greeting, then runs in its own process and says why; it never sent its streams, so nothing holds them open. The
    server, woken, forks nothing for the job that left, and serves the next."""
    tmp, env = tree
    server = start_server(env, key_of(env))
    try:
        os.kill(server.pid, signal.SIGSTOP)
        started = time.monotonic()
        proc, seen = run_job(tmp, env, JOB_CONFIG=QUICK, timeout=60)  # it reads the job's streams to their end
        assert not seen["child"] and proc.returncode == 0 and time.monotonic() - started < 30
        assert f"(pid {server.pid}) did not greet the job within 1 s (stopped, or overloaded?)" in proc.stderr
        assert "this job runs in its own process" in proc.stderr
        os.kill(server.pid, signal.SIGCONT)
        proc, seen = run_job(tmp, env, JOB_CONFIG=QUICK)
        assert seen["child"] and seen["ppid"] == server.pid and proc.returncode == 0
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.terminate()
        server.wait(timeout=30)


@contextmanager
def listener(env, greeting: bytes, answer: bytes | None, hang_up=False):
    """Something other than a job server on the socket of ``env``'s key: it sends ``greeting`` and ``answer`` (or
    nothing more, when None) to the job that connects, and reads what the job sends (dropping the streams it passes)
    until the job hangs up (or, with ``hang_up``, hangs up itself once it has the job's request)."""
    from stagereplay.runtime.server_folder import socket_folder

    servers = Path(env["STAGEREPLAY_JOB_SERVER_DIR"])
    sockets = socket_folder(servers)
    for where in (servers, sockets):
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = sockets / f"{key_of(env)}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)

    def answer_one():
        conn, _ = sock.accept()
        with conn:
            conn.sendall(greeting + (answer or b""))
            while conn.recv(1 << 16) and not hang_up:
                pass

    threading.Thread(target=answer_one, daemon=True).start()
    try:
        yield
    finally:
        sock.close()
        path.unlink()


def test_a_server_that_greets_but_forks_no_child_holds_a_job_seconds_not_forever(tree):
    """A server that takes the job's request and then answers nothing: the job waits job_server_timeout_s for its
    child's pid (not for ever), then runs in its own process and says why."""
    from stagereplay.runtime.server_protocol import GREETING

    tmp, env = tree
    with listener(env, GREETING, None):
        proc, seen = run_job(tmp, env, JOB_CONFIG=QUICK, timeout=60)
    assert not seen["child"] and proc.returncode == 0
    assert "did not fork the job's child within 1 s" in proc.stderr


def test_a_forked_job_runs_as_long_as_it_runs(tree):
    """The hand-over's timeout ends with the child's pid: the wait for its exit status has none."""
    tmp, env = tree
    server = start_server(env, key_of(env))
    try:
        job = subprocess.Popen([sys.executable, str(tmp / "job.py")], cwd=tmp / "work", stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env=dict(env, JOB_CONFIG=QUICK, MODE="wait", WAIT_FOR=str(tmp / "go"), CODE="3"))
        assert json.loads(job.stdout.readline())["child"]
        time.sleep(3)  # three times the timeout
        (tmp / "go").touch()
        assert job.wait(timeout=30) == 3 and "job server not used" not in job.stderr.read()
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("greeting, answer, said", [
    (b"HTTP/1.0 400 Bad Request\r\n", None, "not a job server's greeting: whatever listens there is no job server"),
    (None, b"hello\n", "answered b'hello\\n' where the pid of the job's child belongs: whatever listens there"),
    # (a job passing its signals on to pid -1 would signal every process it may)
    (None, b"-1\n", "answered b'-1\\n' where the pid of the job's child belongs"),
    (None, b"", "hung up before it"),  # (before it forked the job's child, or took all of its request)
], ids=["another greeting", "no pid", "a negative pid", "nothing"])
def test_a_listener_that_answers_no_pid_gets_no_job(tree, greeting, answer, said):
    """Whatever answers on a server's socket without a pid: the job runs in its own process and says what it got."""
    from stagereplay.runtime.server_protocol import GREETING

    tmp, env = tree
    with listener(env, greeting or GREETING, answer, hang_up=answer == b""):
        proc, seen = run_job(tmp, env, JOB_CONFIG=QUICK, timeout=60)
    assert not seen["child"] and proc.returncode == 0 and "Traceback" not in proc.stderr
    assert said in proc.stderr and "this job runs in its own process" in proc.stderr


def wait_gone(*pids, seconds=5.0) -> bool:
    for _ in range(int(seconds * 10)):
        if all(gone(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return all(gone(pid) for pid in pids)


def test_a_job_killed_outright_takes_its_child_and_the_childs_subprocesses_with_it(tree):
    """SIGKILL leaves the waiting job nothing to pass on: its forked child sees the job's end of the connection close
    and kills its process group, so neither it nor what its script started (a decoder's worker, say) holds the GPU or
    writes on into outputs that a rerun writes too."""
    tmp, env = tree
    server = start_server(env, key_of(env))
    seen = None
    try:
        job = subprocess.Popen([sys.executable, str(tmp / "job.py")], env=dict(env, MODE="spawn"), cwd=tmp / "work",
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = json.loads(job.stdout.readline())
        assert seen["child"] and not gone(seen["spawned"])
        job.kill()
        assert job.wait(timeout=30) == -signal.SIGKILL
        assert wait_gone(seen["pid"], seen["spawned"]), "the child or its subprocess outlived the job"
    finally:
        if seen and not gone(seen["spawned"]):
            os.kill(seen["spawned"], signal.SIGKILL)
        server.terminate()
        server.wait(timeout=30)


def test_a_server_killed_outright_leaves_its_jobs_to_finish_and_the_next_job_starts_another(tree):
    """kill -9 of the server: the child it forked is the job's and reports to it, so the job ends as it would have;
    the dead server's socket, left behind, answers nobody, and the next job starts a server rather than wait."""
    from stagereplay.runtime.hand_over import stop_servers
    from stagereplay.runtime.server_folder import socket_folder

    tmp, env = tree
    key = key_of(env)
    server = start_server(env, key)
    job = subprocess.Popen([sys.executable, str(tmp / "job.py")], cwd=tmp / "work", stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           env=dict(env, JOB_CONFIG=QUICK, MODE="wait", WAIT_FOR=str(tmp / "go"), CODE="4"))
    seen = json.loads(job.stdout.readline())
    assert seen["child"] and seen["ppid"] == server.pid
    server.kill()
    server.wait(timeout=30)
    (tmp / "go").touch()
    _out, err = job.communicate(timeout=30)
    assert job.returncode == 4 and "a line to stderr" in err and "job server" not in err
    servers = Path(env["STAGEREPLAY_JOB_SERVER_DIR"])
    assert (socket_folder(servers) / f"{key}.sock").exists()  # the dead server's
    proc, seen = run_job(tmp, env, JOB_CONFIG=QUICK, timeout=60)
    assert not seen["child"] and proc.returncode == 0 and "job server not used" not in proc.stderr
    assert (servers / f"{key}.log").exists()  # the server it started
    for _ in range(600):  # which imports the model stack, then answers: stop it
        if stop_servers(servers):
            break
        time.sleep(0.1)


MARKED_JOB = """
import json, os
from stagereplay.runtime import hand_over
from stagereplay.runtime.server_protocol import CHILD_ENV
if os.environ.get("FORCE_KEY"):  # a job that computed its key before the edit
    hand_over.server_key = lambda env=None, preload=(): os.environ["FORCE_KEY"]
hand_over.hand_over({"job_server": True}, ("stagereplay.marker",))
from stagereplay import marker
print(json.dumps({"child": bool(os.environ.get(CHILD_ENV)), "ppid": os.getppid(), "mark": marker.MARK}))
"""


def test_no_job_forks_from_a_server_whose_source_files_changed(tree):
    """A source file edited (or only touched) under a live server: the next job computes another key and never
    reaches the old server, and one that reaches it all the same (its key computed before the edit) is refused by
    the server, which checks its key again and exits. Either way the job runs the new code in its own process."""
    tmp, env = tree
    marker = tmp / "src/stagereplay/marker.py"
    marker.write_text('MARK = "old"\n')
    (tmp / "marked_job.py").write_text(MARKED_JOB)

    def run(**extra):
        proc = subprocess.run([sys.executable, str(tmp / "marked_job.py")], env=dict(env, **extra), cwd=tmp / "work",
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def later(path: Path):  # a new stat record however coarse the file system's clock
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 2_000_000_000))

    old_key = key_of(env, preload="stagereplay.marker")
    server = start_server(env, old_key, preload="stagereplay.marker")
    try:
        assert run() == {"child": True, "ppid": server.pid, "mark": "old"}
        marker.write_text('MARK = "new"\n')  # the same size
        later(marker)
        here = {"child": False, "ppid": os.getpid(), "mark": "new"}  # in its own process, with the new code
        with hold_lock(env, key_of(env, preload="stagereplay.marker")):  # (a job that misses a server starts none)
            assert run() == here
            assert run(FORCE_KEY=old_key) == here
        assert server.wait(timeout=30) == 0 and "its source files changed" in server.stdout.read()
    finally:
        server.kill()
        server.wait(timeout=30)
    touched = tmp / "src/stagereplay/io/ids.py"  # a file only touched, no job reads a changed byte of it
    server = start_server(env, key_of(env, preload="stagereplay.marker"), preload="stagereplay.marker")
    try:
        assert run()["child"]
        later(touched)
        with hold_lock(env, key_of(env, preload="stagereplay.marker")):
            assert run() == here
    finally:
        server.kill()
        server.wait(timeout=30)


# What Snakemake sets to a job's `threads` (its shell and script jobs): the thread counts of the job.
SNAKEMAKE_THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                         "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
# A server that loaded the libraries with thread pools: torch's OpenMP and MKL, numpy's and scipy's OpenBLAS,
# pyarrow's CPU pool (torch's import also caches the temp folder).
STACK = "torch,numpy,scipy.linalg,pyarrow"


@pytest.fixture(scope="module")
def stack_server(tmp_path_factory):
    """One server of STACK, started by a two-thread job, for the tests of what its children take from their jobs.
    Its folder is short (under the system temp folder), so that a job of another $TMPDIR finds its socket there."""
    import tempfile

    servers = Path(tempfile.mkdtemp(prefix="sr-jobs-"))
    tmp, env = make_tree(tmp_path_factory.mktemp("stack"), servers)
    env = dict(env, JOB_PRELOAD=STACK, **{name: "2" for name in SNAKEMAKE_THREAD_VARS})
    server = start_server(env, key_of(env, STACK), STACK)
    yield tmp, env, server
    server.terminate()
    server.wait(timeout=30)
    shutil.rmtree(servers, ignore_errors=True)


@pytest.mark.parametrize("threads", [{name: "1" for name in SNAKEMAKE_THREAD_VARS},
                                     {name: "2" for name in SNAKEMAKE_THREAD_VARS}, {"OMP_NUM_THREADS": "1"}],
                         ids=["one-thread job", "two-thread job", "OMP_NUM_THREADS=1 alone"])
def test_jobs_of_any_thread_count_fork_from_one_server_with_a_fresh_process_s_counts(stack_server, threads):
    """The thread counts are no part of the server's key: the one-thread jobs (browser, figures, report) fork from
    the server the model jobs started. Each child's libraries hold the counts a fresh process of its environment
    takes as they load."""
    tmp, env, server = stack_server
    job = {key: value for key, value in env.items() if key not in SNAKEMAKE_THREAD_VARS} | threads
    forked, fresh = forked_and_fresh(tmp, job)
    assert forked["child"] and forked["ppid"] == server.pid
    assert forked["threads"] == fresh["threads"] and fresh["threads"]["torch"] == int(threads["OMP_NUM_THREADS"])


def test_a_forked_job_runs_on_its_job_s_cpus(stack_server):
    """``taskset -c N`` holds for a forked job, and so do the thread counts that follow from it (OpenBLAS takes at
    most one thread per CPU the process may run on)."""
    tmp, env, server = stack_server
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, "needs two CPUs: the job's one and another"
    forked, fresh = forked_and_fresh(tmp, env, prefix=["taskset", "-c", str(cpus[-1])])
    assert forked["child"] and forked["affinity"] == fresh["affinity"] == cpus[-1:]
    assert forked["threads"] == fresh["threads"]


def test_a_forked_job_s_temp_folder_is_its_job_s(stack_server):
    """The server's imports cached its temp folder (tempfile.tempdir): a job of another $TMPDIR finds its own."""
    tmp, env, server = stack_server
    (tmp / "job-tmp").mkdir()
    forked, fresh = forked_and_fresh(tmp, env, TMPDIR=str(tmp / "job-tmp"))
    assert forked["child"] and forked["tempdir"] == fresh["tempdir"] == str(tmp / "job-tmp")


def test_a_forked_job_keeps_its_job_s_niceness_and_scheduling_policy(tree):
    tmp, env = tree
    server = start_server(env, key_of(env))
    try:
        forked, fresh = forked_and_fresh(tmp, env, prefix=["nice", "-n", "5", "chrt", "--batch", "0"])
        assert forked["child"] and forked["ppid"] == server.pid
        assert (forked["nice"], forked["scheduler"]) == (fresh["nice"], fresh["scheduler"]) == (5, os.SCHED_BATCH)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_forked_job_keeps_its_job_s_resource_limits(tree):
    tmp, env = tree
    import resource

    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 512  # the server's, which the job's is below
    server = start_server(env, key_of(env))
    try:
        forked, fresh = forked_and_fresh(tmp, env, prefix=["prlimit", "--nofile=512:512", "--core=0:0"])
        assert forked["child"] and forked["rlimits"] == fresh["rlimits"]
        assert forked["rlimits"]["RLIMIT_NOFILE"] == [512, 512] and forked["rlimits"]["RLIMIT_CORE"] == [0, 0]
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_job_whose_process_its_child_cannot_take_runs_in_its_own_process(tree):
    """A server that may not lower its niceness or raise a hard limit (an unprivileged one; as root, one without
    CAP_SYS_NICE and CAP_SYS_RESOURCE) at nice 5 with 256 open files: a job at nice 0, or with more files, or
    with another stack limit (which the C library read at the server's start) is not forked; it runs in its own
    process and its log says why. The control: a job of the server's attributes forks."""
    tmp, env = tree
    unprivileged = ["setpriv", "--bounding-set", "-sys_nice,-sys_resource"] if os.geteuid() == 0 else []
    server = start_server(env, key_of(env), prefix=["nice", "-n", "5", "prlimit", "--nofile=256:256", *unprivileged])
    like_the_server = ["nice", "-n", "5", "prlimit", "--nofile=256:256"]
    try:
        proc, seen = run_job(tmp, env, prefix=like_the_server)
        assert seen["child"] and seen["ppid"] == server.pid
        for prefix, why in ((["prlimit", "--nofile=256:256"], "niceness 0"),
                            (["nice", "-n", "5"], "RLIMIT_NOFILE"),
                            ([*like_the_server, "--stack=1048576:1048576"], "RLIMIT_STACK")):
            proc, seen = run_job(tmp, env, prefix=prefix)
            assert not seen["child"] and proc.returncode == 0, (prefix, seen)
            assert "did not take this job" in proc.stderr and why in proc.stderr, proc.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_server_imports_nothing_of_the_folder_it_was_started_in(tree):
    """``python -m`` puts the folder a process starts in first on sys.path: a module beside the job that started
    the server is not imported by it (a job's own process does not see it either)."""
    tmp, env = tree
    (tmp / "started_in").mkdir()
    (tmp / "started_in/beside_the_job.py").write_text("")
    preload = "json,beside_the_job"
    server = start_server(env, key_of(env, preload), preload, cwd=tmp / "started_in")
    try:
        proc, seen = run_job(tmp, env, JOB_PRELOAD=preload, JOB_IMPORTS="json", JOB_ASK="beside_the_job")
        assert seen["child"] and seen["ppid"] == server.pid and seen["modules"] == {"beside_the_job": False}
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("job_rc", [None, "figure.dpi: 33\n"], ids=["no matplotlibrc", "a matplotlibrc"])
def test_a_figures_job_reads_matplotlib_s_rc_file_in_its_own_folder(tree, job_rc):
    """matplotlib reads ./matplotlibrc as it is imported: the server of the rule scripts' preload, started in a
    folder whose matplotlibrc sets figure.dpi 17, leaves matplotlib to its jobs, so a figures job forked from it
    has the rcParams of a fresh process in its own folder, with or without a matplotlibrc there."""
    from stagereplay.stages.rule_job import PRELOAD

    tmp, env = tree
    (tmp / "started_in").mkdir()
    (tmp / "started_in/matplotlibrc").write_text("figure.dpi: 17\n")
    if job_rc:
        (tmp / "work/matplotlibrc").write_text(job_rc)
    preload = ",".join(PRELOAD)
    server = start_server(env, key_of(env, preload), preload, cwd=tmp / "started_in")
    try:
        figures = dict(JOB_PRELOAD=preload, JOB_IMPORTS="stagereplay.analysis.figures")
        forked, fresh = forked_and_fresh(tmp, env, **figures)
        assert forked["child"] and forked["ppid"] == server.pid
        assert forked["rc"] == fresh["rc"] and fresh["rc"]["figure.dpi"] == ("33.0" if job_rc else "100.0")
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_server_whose_preload_imports_matplotlib_refuses_to_serve(tree):
    """Its rcParams would be those of the server's folder: the server refuses, its jobs run in their own
    processes."""
    tmp, env = tree
    key = key_of(env, "matplotlib")
    server = subprocess.run([sys.executable, "-m", "stagereplay.runtime.job_server", "--key", key, "--preload",
                             "matplotlib"], env=env, capture_output=True, text=True, timeout=120)
    assert server.returncode == 1 and "refusing to serve: matplotlib imported" in server.stdout, server.stdout
    assert (Path(env["STAGEREPLAY_JOB_SERVER_DIR"]) / f"{key}.refused").exists()


def test_a_job_in_other_control_groups_has_a_server_of_its_own(monkeypatch):
    """A forked child stays in its server's control groups (their memory and CPU limits): they are part of the key,
    so that a job in others (another terminal's systemd scope, a batch system's step) never forks from it."""
    from stagereplay.runtime import server_key

    key = server_key.server_key()
    monkeypatch.setattr(server_key, "control_groups", lambda: "0::/another.scope\n")
    assert server_key.server_key() != key
