"""Jobs that start warm: one server per host and environment imports the model stack once and forks a child for
each job, so that a job pays for its weights, tokenizer and work, not for importing torch and transformers (the
model stages, and the report, figures and item browser, which import the analysis stack and a tokenizer).

A model job's fresh process spends most of its start importing (torch, torch's deterministic switch and the
``torch._dynamo`` chain transformers pulls in, the model's transformers code, the stage modules; bench/RESULTS.md,
"Job start"). With ``job_server: true`` in the config each warm job calls :func:`hand_over` first, naming the
modules its server imports (the caller's preload):

- it connects to the server of its key (the preload, the Python executable, where the packages are found, the
  package's source files as stat records, the environment variables read at import time, its control groups),
  waits for its greeting, sends its script, arguments, working folder, umask, environment, process attributes
  (:mod:`.job_process`) and standard streams (the descriptors themselves), and waits. The server forks; the child
  takes the job's process attributes (or answers why it cannot, and the job runs in its own process), streams,
  folder and environment, sets the preloaded libraries' thread counts and temp folder as the job's fresh process
  would find them (:mod:`.import_state`), and runs the same script from its top (:func:`hand_over` returns at once
  in a child), then reports its exit status; the job exits with it. A signal the job receives (Snakemake
  cancelling it) is passed on to the child; a job killed outright takes the child and its process group with it.
- when no server answers, the job starts one in the background (one per key: a lock) and runs in its own process
  as without the server; the jobs after it fork from the server once it has imported.
- when no server can serve it (a socket folder that is not this user's alone, a socket path too long for Linux) or
  the one that answers does not answer as a server (within ``job_server_timeout_s`` for each step up to its
  child's pid; the job's own run has no limit), the job runs in its own process and says why: on its stderr, which
  Snakemake shows (:func:`hand_over` runs before a rule script sends stderr to its log), and in a model job's log
  (its first line, :func:`process_start`).

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
SUN_PATH_MAX = 107  # bytes of a socket's path on Linux (sockaddr_un's sun_path: 108 with the closing NUL)
PID_MAX = 1 << 22  # the highest pid_max Linux allows
# How long a job waits for each step of its hand-over (the connection, the server's greeting, the pid of its child)
# before it runs in its own process (the config's job_server_timeout_s); the wait for its exit status has no limit.
HAND_OVER_TIMEOUT_S = 10.0
GREETING = b"stagereplay job server\n"  # a server's first line to each connection: the job's streams go to no other
not_served: str | None = None  # why this job, meant for the job server, runs in its own process (for its log)


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
    seconds), for a job's log; the first time, why a job meant for the job server runs in its own process."""
    global not_served
    how = (f"forked from the job server (pid {os.getppid()})" if os.environ.get(CHILD_ENV)
           else "in its own process")
    if not_served and not os.environ.get(CHILD_ENV):
        how, not_served = f"{how} (job server not used: {not_served})", None
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        wall = f"{uptime - ticks / os.sysconf('SC_CLK_TCK'):.1f} s after its start, "
    except (OSError, ValueError, IndexError):
        wall = ""
    return f"{how}, {wall}{time.process_time():.1f} CPU-s"


def socket_folder(where: Path | None = None) -> Path:
    """Where the sockets of the servers of ``where`` (default :func:`folder`) are: that folder, or where its path is
    too long for a socket's name (SUN_PATH_MAX bytes on Linux) a short folder of this user's in the system temp dir,
    named after it (:func:`socket_problem` says when the temp dir is too long too)."""
    where = Path(where) if where is not None else folder()
    if len(str(where)) <= 60:
        return where
    digest = hashlib.sha256(str(where.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"stagereplay-jobs-{os.getuid()}-{digest}"


def socket_path(key: str) -> Path:
    return socket_folder() / f"{key}.sock"


def bound_path(path: Path, pid: int) -> Path:
    """The name a server binds its socket ``path`` under before it answers (then renames it to ``path``)."""
    return path.with_suffix(f".{pid}.part")


def socket_problem(path: Path) -> str | None:
    """None when a server can bind its socket ``path`` (with the name it binds first, the longest pid's), else why
    not and what to do: a socket's path has at most SUN_PATH_MAX bytes."""
    longest = len(os.fsencode(bound_path(path, PID_MAX)))
    if longest <= SUN_PATH_MAX:
        return None
    return (f"the job server's socket {path} would be {len(os.fsencode(path))} bytes long ({longest} under the name "
            f"the server binds first, <key>.<pid>.part), over the {SUN_PATH_MAX} bytes a socket's path may have on "
            f"Linux: the system temp folder ($TMPDIR, {tempfile.gettempdir()}) is too long for it; set ${FOLDER_ENV} "
            f"to a short folder of your own (60 characters at most, as /tmp/stagereplay-jobs-{os.getuid()})")


def folder_problem(where: Path) -> str | None:
    """Make ``where`` if need be; None when it is this user's alone (a folder, not a link, owned by this user, no
    access for group or others), else what is wrong with it and what to do: a server's socket and a job's request
    (its environment) go nowhere else."""
    import stat

    elsewhere = f"set ${FOLDER_ENV} to a folder of your own"
    try:
        if not os.path.lexists(where):
            where.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(where)
    except OSError as exc:
        return f"the job server folder {where} cannot be made ({exc.strerror}); {elsewhere}"
    if stat.S_ISLNK(st.st_mode):  # whoever may change the link could send the jobs' requests elsewhere
        return (f"the job server folder {where} is a symbolic link (to {os.readlink(where)}), not a folder; set "
                f"${FOLDER_ENV} to a real folder of your own, not a link")
    if not stat.S_ISDIR(st.st_mode):
        return f"the job server folder {where} is not a folder; {elsewhere}"
    if st.st_uid != os.getuid():
        return (f"the job server folder {where} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): "
                f"this user cannot use it; {elsewhere}")
    if st.st_mode & 0o077:
        return (f"the job server folder {where} is not this user's alone (mode {stat.S_IMODE(st.st_mode):o}): make "
                f"it private (chmod 700 {where}) or {elsewhere}")
    return None


def tell(message: str, level: int = logging.WARNING) -> None:
    """Say why this job runs in its own process: now on its stderr (:func:`hand_over` runs before a rule script sends
    its stderr to the job's log: Snakemake shows it with the job), and later in a model job's log
    (:func:`process_start`)."""
    global not_served
    not_served = message
    log.log(level, "job server not used, this job runs in its own process: %s", message)


# --- the job's side ---------------------------------------------------------------------------------------------


def hand_over(config: dict | None, preload: tuple[str, ...] = ()) -> None:
    """Run this job in the child of a warm server that imported ``preload`` (module names: what the caller's jobs
    import) when the config asks for it and one answers; else return and let the caller run the job in this
    process (starting a server for the jobs after it). In a child: return at once.

    The child runs the file this interpreter was started on (``sys.argv[0]``: for a rule script, the file Snakemake
    wrote with its preamble, not the script's ``__file__``, which the preamble points at the workflow's copy)."""
    if os.environ.get(CHILD_ENV) or not (config or {}).get("job_server"):
        return
    if problem := folder_problem(folder()) or folder_problem(socket_folder()):
        tell(problem)
        return
    key = server_key(preload=preload)
    path = socket_path(key)
    if problem := socket_problem(path):  # no server could bind it: start none
        tell(problem)
        return
    timeout_s = float((config or {}).get("job_server_timeout_s", HAND_OVER_TIMEOUT_S))
    try:
        conn = connect(path, timeout_s)
    except (FileNotFoundError, ConnectionRefusedError):  # no server, or a dead one's socket: start one
        start_server(key, float((config or {}).get("job_server_idle_s", DEFAULT_IDLE_S)), preload)
        return
    except TimeoutError:  # its backlog is full: it takes no jobs
        tell(f"the job server at {path} did not accept the connection within {timeout_s:g} s (stopped, or "
             f"overloaded?); {what_mends(path)}")
        return
    except OSError as exc:
        tell(f"the job server at {path} could not be reached ({exc}); {what_mends(path)}")
        return
    code = run_in_child(conn, os.path.abspath(sys.argv[0]), path, timeout_s)
    if code is None:  # refused (stale, or idling out as this job came): run here
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the child ran the job: nothing is left for this process to do


def connect(path: Path, timeout_s: float) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout_s)
    try:
        conn.connect(str(path))
    except BaseException:
        conn.close()
        raise
    return conn


def what_mends(path: Path) -> str:
    """What to do about a server that does not answer as it should on ``path``."""
    return (f"if it stays so, end it (its pid is in its log, {folder() / (path.stem + '.log')}) or remove {path}: the "
            "next job starts another")


def run_in_child(conn: socket.socket, script: str, path: Path, timeout_s: float = HAND_OVER_TIMEOUT_S) -> int | None:
    """Send the job to the server connected on ``conn`` (at ``path``), pass signals on to its child, return its exit
    status; None when the server forked no child (the job then runs in its own process)."""
    header = json.dumps({"script": script, "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
                         "umask": current_umask(), "process": job_process(), "sent": time.time()}).encode()
    with conn:
        reader = conn.makefile("rb")
        pid = send_job(conn, reader, header, path, timeout_s)
        if pid is None:  # refused, or no answer in time (said why): run here
            return None
        conn.settimeout(None)  # the job itself may run for hours

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
    if not status.strip().lstrip(b"-").isdigit():
        print(f"stagereplay: the job's process (pid {pid}, forked by the job server) reported {status[:80]!r}, not an "
              "exit status; see the job's log", file=sys.stderr)
        return 1
    return int(status)


def send_job(conn: socket.socket, reader, header: bytes, path: Path, timeout_s: float) -> int | None:
    """Send the job's request and its standard streams to the server on ``conn`` and return the pid of the child it
    forked for the job; None (said why) when it forked none. The streams go only to a server that greets the job (a
    stopped server's backlog still takes connections: it would hold them, and whoever reads them would wait on), and
    no step waits more than ``timeout_s``."""
    server = f"the job server at {path} (pid {peer(conn)[0]})"
    step = "greet the job"
    try:
        greeting = reader.readline(len(GREETING))
        if not greeting:  # it was exiting as the job came
            tell(f"{server} closed the connection (it was exiting)", logging.INFO)
            return None
        if greeting != GREETING:
            tell(f"{server} answered {greeting!r}, not a job server's greeting: whatever listens there is no job "
                 f"server of this package; {what_mends(path)}")
            return None
        step = "take the job's request"
        socket.send_fds(conn, [len(header).to_bytes(8, "big") + header], [0, 1, 2])
        step = "fork the job's child"
        line = reader.readline(32)
        if line == b"0\n":
            reason = reader.read(4096).decode(errors="replace").strip() or "it was exiting"
            tell(f"{server} did not take this job ({reason})", logging.INFO)
            return None
    except TimeoutError:
        tell(f"{server} did not {step} within {timeout_s:g} s (stopped, or overloaded?); {what_mends(path)}")
        return None
    except OSError as exc:
        tell(f"{server} hung up before it could {step} ({exc}); {what_mends(path)}")
        return None
    return child_pid(line, server, path)


def child_pid(line: bytes, server: str, path: Path) -> int | None:
    """The pid in the server's answer ``line``; None (said why) when it is none: a job passes its signals on to
    that pid, and 0 or a negative one would send them to whole process groups."""
    if not line:
        tell(f"{server} hung up before it forked the job's child (did it end?); {what_mends(path)}")
        return None
    text = line.rstrip(b"\n")
    if line.endswith(b"\n") and text.isdigit() and 0 < int(text) < PID_MAX:
        return int(text)
    tell(f"{server} answered {line!r} where the pid of the job's child belongs: whatever listens there is no job "
         f"server of this package; {what_mends(path)}")
    return None


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
                reader = conn.makefile("rb")
                stopped += reader.readline() == GREETING and reader.readline().strip() == b"0"
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
    if problem := folder_problem(folder()) or folder_problem(socket_folder()):
        print(f"refusing to serve: {problem}", flush=True)
        return 1
    if problem := socket_problem(socket_path(key)):  # before the imports, not after them
        print(f"refusing to serve: {problem}", flush=True)
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
    partial = bound_path(path, os.getpid())
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
                conn.sendall(GREETING)
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
            if not job_waits(conn):  # it gave up waiting (job_server_timeout_s): its own process runs it
                print("a job gave up waiting before its child was forked: forked none for it", flush=True)
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
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


def peer(conn: socket.socket) -> tuple[int | None, int | None]:
    """The pid and uid of the process at the other end of ``conn`` (Linux: SO_PEERCRED; elsewhere None, None)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None, None
    import struct

    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of ``conn`` runs as this user."""
    uid = peer(conn)[1]
    return uid is None or uid == os.getuid()


def job_waits(conn: socket.socket) -> bool:
    """Whether the job on ``conn`` still waits for its child: it sends nothing after its request, so anything to
    read is its hanging up."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


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
    """Kill this process, and the process group it leads (what the job's script started), when the job at the other
    end of ``conn`` is gone (it sends nothing after its request)."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    if os.getpgid(0) == os.getpid():  # run_child made the child a group of its own
        os.killpg(0, signal.SIGKILL)
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
