"""Jobs that start warm: one server per host and environment imports the model stack once and forks a child for
each job, so that a job pays for its weights, tokenizer and work, not for importing torch and transformers (the
model stages, and the report, figures and item browser, which import the analysis stack and a tokenizer).

A model job's fresh process spends most of its start importing (torch, torch's deterministic switch and the
``torch._dynamo`` chain transformers pulls in, the model's transformers code, the stage modules; bench/RESULTS.md,
"Job start"). With ``job_server: true`` in the config each warm job calls :func:`hand_over` first, naming the
modules its server imports (the caller's preload):

- it connects to the server of its key (the preload, the Python executable, where the packages are found, the
  package's source files as stat records, the environment variables read at import time, its control groups),
  sends its script, arguments, working folder, umask, environment, process attributes (:mod:`.job_process`) and
  standard streams (the descriptors themselves), and waits. The server forks; the child takes the job's process
  attributes (or answers why it cannot, and the job runs in its own process), streams, folder and environment,
  sets the preloaded libraries' thread counts and temp folder as the job's fresh process would find them
  (:mod:`.import_state`), and runs the same script from its top (:func:`hand_over` returns at once in a child),
  then reports its exit status; the job exits with it. A signal the job receives (Snakemake cancelling it) is
  passed on to the child.
- when no server answers, the job starts one in the background (one per key: a lock) and runs in its own process
  as without the server; the jobs after it fork from the server once it has imported.

The child computes exactly what a fresh process computes: the server only imports, in a folder of its own (it
never runs a torch operation, initialises CUDA or starts a thread, and imports no module that reads its working
folder as it loads; it refuses to serve when an import did), the child takes the job's process and environment
before anything of the job reads them, and each job is still its own process, sharing nothing with the others
(the audit still recomputes from the saved ledger alone). tests/test_cluster_executor.py compares a workflow run
with and without the server byte for byte. The server exits after ``idle_s`` seconds without a job, and when its
source files change (the next job's key differs and starts a new server; the old one idles out).

Snakemake's benchmark files time the waiting job, so with the server their wall seconds are right but their CPU
and memory columns miss the child's. Knows nothing of models: what to import comes from the caller.
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from stagereplay.runtime.import_state import FOLDER_AT_IMPORT, THREAD_COUNTS, keyed, take_job_state
from stagereplay.runtime.job_process import job_process, take_job_process

log = logging.getLogger("stagereplay")

CHILD_ENV = "STAGEREPLAY_JOB_SERVER_CHILD"  # set in a forked child: hand_over returns at once
FOLDER_ENV = "STAGEREPLAY_JOB_SERVER_DIR"
# Environment variables that packages read while they are imported (a server imported under other values would
# not be what a fresh process of this job imports): a job whose values differ gets a server of its own. Not the
# thread counts (import_state.THREAD_COUNTS): a child sets its libraries' counts from its job's (one server serves
# jobs of any thread count). The locale's too: Python takes its character encoding from them as it starts.
IMPORT_TIME_ENV = ("PYTHON", "HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA_", "CUBLAS_", "NVIDIA_", "OMP_",
                   "MKL_", "OPENBLAS_", "TOKENIZERS_", "TRITON_", "LD_", "KMP_", "SAFETENSORS_", "STAGEREPLAY_",
                   "LANG", "LC_")
# The packages whose code the server imports: a job that would find another copy gets a server of its own.
FOUND = ("stagereplay", "torch", "transformers", "tokenizers", "safetensors", "numpy", "snakemake",
         "huggingface_hub", "scipy")
LOCK_FD_ENV = "STAGEREPLAY_JOB_SERVER_LOCK_FD"
OWN_ENV = (CHILD_ENV, LOCK_FD_ENV)
DEFAULT_IDLE_S = 300.0
MAX_HEADER = 4 << 20


def folder() -> Path:
    """``$STAGEREPLAY_JOB_SERVER_DIR``, else a per-user folder in the system temp dir."""
    if os.environ.get(FOLDER_ENV):
        return Path(os.environ[FOLDER_ENV])
    return Path(tempfile.gettempdir()) / f"stagereplay-jobs-{os.getuid()}"


def server_key(env: dict | None = None, preload: tuple[str, ...] = ()) -> str:
    """What a server's imports depend on, as a short digest: the modules it imports (``preload``), the
    interpreter, where the packages it imports are found (and the stat record of each one's entry file), the stat
    records of this package's source files, and the import-time environment. (Not ``sys.path`` itself: its first
    entry is the script's folder, another for the server than for a job.) And the job's control groups: a child
    stays in its server's (their memory and CPU limits), which it may not leave for its job's."""
    import importlib.util

    env = os.environ if env is None else env
    package = Path(__file__).resolve().parents[1]
    files = sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in package.rglob("*.py"))
    found = []
    for name in FOUND:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None and spec.origin else None
        found.append((name, origin, os.stat(origin).st_mtime_ns if origin and os.path.exists(origin) else None))
    imported_with = sorted((k, v) for k, v in env.items()
                           if k.startswith(IMPORT_TIME_ENV) and k not in OWN_ENV and k not in THREAD_COUNTS)
    parts = {"preload": list(preload), "python": sys.executable, "version": sys.version, "found": found,
             "files": files, "env": imported_with, "thread_env": keyed(env), "cgroups": control_groups()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def control_groups() -> str:
    """This process's control groups (Linux's /proc/self/cgroup; empty where there is none)."""
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return ""


def process_start() -> str:
    """How this process started and what it has spent since (wall seconds from its start, or its fork, and CPU
    seconds), for a job's log."""
    how = (f"forked from the job server (pid {os.getppid()})" if os.environ.get(CHILD_ENV)
           else "in its own process")
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        wall = f"{uptime - ticks / os.sysconf('SC_CLK_TCK'):.1f} s after its start, "
    except (OSError, ValueError, IndexError):
        wall = ""
    return f"{how}, {wall}{time.process_time():.1f} CPU-s"


def socket_folder(where: Path | None = None) -> Path:
    """Where the sockets of the servers of ``where`` (default :func:`folder`) are: that folder, or where its path is
    too long for a socket's name (about 100 bytes on Linux) a short folder of this user's in the system temp dir,
    named after it."""
    where = Path(where) if where is not None else folder()
    if len(str(where)) <= 60:
        return where
    digest = hashlib.sha256(str(where.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"stagereplay-jobs-{os.getuid()}-{digest}"


def socket_path(key: str) -> Path:
    return socket_folder() / f"{key}.sock"


def private_folder(where: Path) -> bool:
    """Make ``where`` if need be and say whether it is this user's alone (a folder, not a link, owned by this user,
    no access for group or others): a server's socket and a job's request (its environment) go nowhere else."""
    try:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(where)
    except OSError:
        return False
    import stat

    ok = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
    if not ok:
        log.warning("job server folder %s is not this user's alone (owner uid %d, mode %o): no job server; make it "
                    "private (chmod 700) or set $%s to a folder of your own", where, st.st_uid,
                    stat.S_IMODE(st.st_mode), FOLDER_ENV)
    return ok


# --- the job's side ---------------------------------------------------------------------------------------------


def hand_over(config: dict | None, preload: tuple[str, ...] = ()) -> None:
    """Run this job in the child of a warm server that imported ``preload`` (module names: what the caller's jobs
    import) when the config asks for it and one answers; else return and let the caller run the job in this
    process (starting a server for the jobs after it). In a child: return at once.

    The child runs the file this interpreter was started on (``sys.argv[0]``: for a rule script, the file Snakemake
    wrote with its preamble, not the script's ``__file__``, which the preamble points at the workflow's copy)."""
    if os.environ.get(CHILD_ENV) or not (config or {}).get("job_server"):
        return
    if not (private_folder(folder()) and private_folder(socket_folder())):
        return
    key = server_key(preload=preload)
    path = socket_path(key)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(path))
    except OSError:
        start_server(key, float((config or {}).get("job_server_idle_s", DEFAULT_IDLE_S)), preload)
        return
    code = run_in_child(conn, os.path.abspath(sys.argv[0]))
    if code is None:  # refused (stale, or idling out as this job came): run here
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the child ran the job: nothing is left for this process to do


def run_in_child(conn: socket.socket, script: str) -> int | None:
    """Send the job to the server connected on ``conn``, pass signals on to its child, return its exit status;
    None when the server forked no child (the job then runs in its own process)."""
    header = json.dumps({"script": script, "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
                         "umask": current_umask(), "process": job_process(), "sent": time.time()}).encode()
    with conn:
        socket.send_fds(conn, [len(header).to_bytes(8, "big") + header], [0, 1, 2])
        reader = conn.makefile("rb")
        pid = int(reader.readline() or b"0")
        if not pid:
            reason = reader.read().decode(errors="replace").strip() or "it was exiting"
            log.info("the job server did not take this job (%s): it runs in its own process", reason)
            return None

        def forward(signum, _frame):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(signum, forward)
        status = reader.readline()
    if not status:
        print(f"stagereplay: the job's process (pid {pid}, forked by the job server) ended without an exit status "
              "(killed?); see the job's log", file=sys.stderr)
        return 1
    return int(status)


def stop_servers(where: str | Path | None = None) -> int:
    """Ask every server with a socket in ``where`` (default: :func:`folder`) to exit; returns how many answered.
    Jobs they forked run on to their end."""
    stopped = 0
    for path in sorted(socket_folder(where).glob("*.sock")):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(10)
                conn.connect(str(path))
                header = json.dumps({"stop": True}).encode()
                conn.sendall(len(header).to_bytes(8, "big") + header)
                stopped += conn.makefile("rb").readline().strip() == b"0"
        except OSError:
            pass
    return stopped


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def start_server(key: str, idle_s: float, preload: tuple[str, ...] = ()) -> None:
    """Start this key's server (importing ``preload``) in the background unless another job is starting it."""
    where = folder()
    try:
        lock = open(where / f"{key}.lock", "a+")  # noqa: SIM115 (held until the job ends; the server inherits it)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another job holds the lock: it is starting (or runs) the server
    if (where / f"{key}.refused").exists():
        return  # this key's server refused to serve (its log says why): jobs run in their own processes
    logfile = open(where / f"{key}.log", "a")  # noqa: SIM115 (the server writes it)
    subprocess.Popen([sys.executable, "-m", "stagereplay.runtime.job_server", "--key", key, "--idle-s", str(idle_s),
                      "--preload", ",".join(preload)],
                     stdin=subprocess.DEVNULL, stdout=logfile, stderr=logfile, start_new_session=True,
                     pass_fds=(lock.fileno(),), env={**os.environ, LOCK_FD_ENV: str(lock.fileno())})
    log.info("job server %s starting in the background (log %s); this job runs in its own process", key,
             where / f"{key}.log")


# --- the server's side ------------------------------------------------------------------------------------------


def serve(key: str, idle_s: float, preload: tuple[str, ...] = (), lock_fd: int | None = None) -> int:
    """Import ``preload``, then fork a child for every job that connects, until ``idle_s`` pass without one."""
    started = time.monotonic()
    if not all(private_folder(where) for where in (folder(), socket_folder())):
        print("refusing to serve: the job server folder is not this user's alone", flush=True)
        return 1
    environment = dict(os.environ)  # the key's, before the imports (torch's inductor sets a variable of its own)
    # The imports read nothing of the folder of the job that started the server: neither its modules (``python -m``
    # put it first on sys.path) nor its files (FOLDER_AT_IMPORT). A child takes its own job's folder.
    started_in = os.getcwd()
    os.chdir(folder())
    if sys.path and sys.path[0] == started_in:
        sys.path[0] = os.getcwd()
    for name in preload:
        try:
            __import__(name)
        except ImportError as exc:  # an optional model type's code: its jobs import it themselves
            print(f"not preloaded: {name} ({exc})", flush=True)
    # Native threads that the libraries start at import (torch's, pyarrow's jemalloc) are theirs to mend in a fork
    # (their fork handlers); a Python thread, an initialised CUDA or a module that read its folder as it was
    # imported would leave the child unlike a fresh process.
    torch = sys.modules.get("torch")
    unlike = [f"{threading.active_count()} Python threads"] if threading.active_count() > 1 else []
    if torch is not None and torch.cuda.is_initialized():
        unlike.append("CUDA initialised")
    unlike += [f"{name} imported ({why})" for name, why in FOLDER_AT_IMPORT.items() if name in sys.modules]
    if unlike:
        print(f"refusing to serve: {', '.join(unlike)} after the imports (a fork would not be a fresh process)",
              flush=True)
        (folder() / f"{key}.refused").touch()
        return 1
    path = socket_path(key)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = path.with_suffix(f".{os.getpid()}.part")
    listener.bind(str(partial))
    listener.listen(64)
    os.replace(partial, path)  # answers from now on
    print(f"serving on {path} after {time.monotonic() - started:.1f} s of imports (pid {os.getpid()})", flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel; each reports to its job
    listener.settimeout(idle_s)
    served, why = 0, f"idle for {idle_s:.0f} s"
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                break
            if not same_user(conn):  # the folder's mode keeps others out; this is the second lock
                conn.close()
                continue
            try:
                conn.settimeout(30)
                request, fds = receive(conn)
                conn.settimeout(None)
            except (OSError, ValueError) as exc:
                print(f"a job's request failed: {exc}", flush=True)
                conn.close()
                continue
            if request.get("stop"):
                conn.sendall(b"0\nstopping\n")
                conn.close()
                why = "asked to stop"
                break
            if server_key(environment, preload) != key:  # a source file changed since the imports: it is stale
                conn.sendall(b"0\nits source files changed since it started\n")
                conn.close()
                for fd in fds:
                    os.close(fd)
                why = "its source files changed"
                break
            served += 1
            if os.fork() == 0:
                code = 1
                try:
                    listener.close()
                    if lock_fd is not None:
                        os.close(lock_fd)  # the key's lock is the server's, not its jobs'
                    code = run_child(conn, request, fds)
                except BaseException:  # before the job's script ran: into the server's log
                    traceback.print_exc()
                finally:
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            conn.close()
    finally:
        path.unlink(missing_ok=True)  # the key's lock is this process's: no other server of it made this file
    print(f"{why} after {served} jobs: exiting", flush=True)
    return 0


def same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of ``conn`` runs as this user (Linux: SO_PEERCRED)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    import struct

    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid == os.getuid()


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    size, data = None, b""
    while size is None or len(data) < 8 + size:
        chunk, ancillary, _flags, _addr = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
        if not chunk:
            raise ConnectionError("the job hung up before sending its request")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        data += chunk
        if size is None and len(data) >= 8:
            size = int.from_bytes(data[:8], "big")
            if size > MAX_HEADER:
                raise ValueError(f"request of {size} bytes")
    return json.loads(data[8:8 + size]), list(fds)


def run_child(conn: socket.socket, request: dict, fds: list[int]) -> int:
    """In the forked child: become the job (its process attributes, streams, folder, environment, arguments) and
    run its script; where it cannot take the job's process attributes, answer why and leave the job to itself."""
    import runpy

    refused = take_job_process(request.get("process"), request["env"])
    if refused:
        print(f"did not fork a job: {refused}", flush=True)  # into the server's log, before the job's streams
        conn.sendall(f"0\n{refused}\n".encode())
        return 0
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[CHILD_ENV] = "1"
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))  # as for ``python script``
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False, buffering=1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    take_job_state()  # what the preloaded libraries read as they loaded: thread counts, the temp folder
    conn.sendall(f"{os.getpid()}\n".encode())
    # The job dies with its process: a job killed outright (SIGKILL: no signal to pass on) closes its end of the
    # connection, and this child must not write on into outputs that a rerun writes too.
    threading.Thread(target=die_with_the_job, args=(conn,), daemon=True).start()
    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()  # to the job's stderr, or its log where the script redirected it, as a fresh process
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    try:
        conn.sendall(f"{code}\n".encode())
    except OSError:
        pass
    return code


def die_with_the_job(conn: socket.socket) -> None:
    """Kill this process when the job at the other end of ``conn`` is gone (it sends nothing after its request)."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key", required=True)
    parser.add_argument("--idle-s", type=float, default=DEFAULT_IDLE_S)
    parser.add_argument("--preload", default="", help="modules to import, comma-separated (part of the key)")
    args = parser.parse_args(argv)
    lock_fd = os.environ.pop(LOCK_FD_ENV, None)  # the key's lock, held by this descriptor while the server lives
    preload = tuple(filter(None, args.preload.split(",")))
    return serve(args.key, args.idle_s, preload, lock_fd=int(lock_fd) if lock_fd else None)


if __name__ == "__main__":
    sys.exit(main())
