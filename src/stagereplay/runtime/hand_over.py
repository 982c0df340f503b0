"""A job's side of the job server (:mod:`stagereplay.runtime.job_server`): :func:`hand_over` sends the job to the
server of its key and waits for the child forked for it, or starts that server and lets the job run in its own
process, saying why where no server can serve it (in its log, and once per run on the run's console). Also the run
start's probe of its server (:func:`probe`), how a job's process started (:func:`process_start`), for its log, and
stopping the servers of a folder.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from stagereplay.runtime.job_process import job_process
from stagereplay.runtime.run_markers import RUN_ENV, first_to_say, note_unanswered, unanswered
from stagereplay.runtime.server_folder import folder, folder_problem, socket_folder, socket_path, socket_problem
from stagereplay.runtime.server_key import server_key
from stagereplay.runtime.server_protocol import (
    CHILD_ENV,
    DEFAULT_IDLE_S,
    GREETING,
    HAND_OVER_TIMEOUT_S,
    LOCK_FD_ENV,
    PID_MAX,
    framed,
    peer,
)

log = logging.getLogger("stagereplay")

not_served: str | None = None  # why this job, meant for the job server, runs in its own process (for its log)


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


def tell(message: str, level: int = logging.WARNING, console: bool = True) -> None:
    """Say why this job runs in its own process: in its log (a rule script's stderr is its log by now, ``start_job``;
    and in a model job's log's first line, :func:`process_start`) and, for a warning, on the run's console (the
    stderr the job was started with, where Snakemake runs) once per run (:mod:`.run_markers`): ``console=False``
    where whoever found it first told the console."""
    global not_served
    not_served = message
    log.log(level, "job server not used, this job runs in its own process: %s", message)
    if console and level >= logging.WARNING and first_to_say(message) and not console_is_the_log():
        print(f"stagereplay: job server not used, this run's jobs that meet it run in their own processes: {message}",
              file=sys.__stderr__, flush=True)


def console_is_the_log() -> bool:
    """Whether this job's log is the stderr it was started with (no rule script's redirection): the log's line
    reached the console already."""
    try:
        log_file, console = os.fstat(sys.stderr.fileno()), os.fstat(sys.__stderr__.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return (log_file.st_dev, log_file.st_ino) == (console.st_dev, console.st_ino)


def server_place(config: dict | None,
                 preload: tuple[str, ...] = ()) -> tuple[str | None, Path | None, str | None] | None:
    """Where the server of this config's jobs that import ``preload`` is: (key, socket path, None); (None, None, why
    no server can run here) where its folder or socket path cannot serve; None where the config turns the server
    off, or in a child of a server."""
    if os.environ.get(CHILD_ENV) or not (config or {}).get("job_server"):
        return None
    if problem := folder_problem(folder()) or folder_problem(socket_folder()):
        return None, None, problem
    key = server_key(preload=preload)
    path = socket_path(key)
    if problem := socket_problem(path):  # no server could bind it: start none
        return None, None, problem
    return key, path, None


def hand_over(config: dict | None, preload: tuple[str, ...] = ()) -> None:
    """Run this job in the child of a warm server that imported ``preload`` (module names: what the caller's jobs
    import) when the config asks for it and one answers; else return and let the caller run the job in this
    process (starting a server for the jobs after it). In a child: return at once.

    The child runs the file this interpreter was started on (``sys.argv[0]``: for a rule script, the file Snakemake
    wrote with its preamble, not the script's ``__file__``, which the preamble points at the workflow's copy)."""
    place = server_place(config, preload)
    if place is None:
        return
    key, path, problem = place
    if problem:
        tell(problem)
        return
    if earlier := unanswered(key):  # the run's console was told: this job does not wait in turn
        tell(f"{earlier} (met by an earlier job of this run: this job did not wait for it)", console=False)
        return
    timeout_s = float((config or {}).get("job_server_timeout_s", HAND_OVER_TIMEOUT_S))
    try:
        conn = connect(path, timeout_s)
    except (FileNotFoundError, ConnectionRefusedError):  # no server, or a dead one's socket: start one
        if refused := start_server(key, float((config or {}).get("job_server_idle_s", DEFAULT_IDLE_S)), preload):
            tell(refused)
        return
    except TimeoutError:  # its backlog is full: it takes no jobs
        unanswering(path, f"the job server at {path} did not accept the connection within {timeout_s:g} s (stopped, "
                    f"or overloaded?); {what_mends(path)}")
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


def unanswering(path: Path, message: str) -> None:
    """A server (its socket ``path``) kept this job waiting in vain: the run's later jobs do not wait for it."""
    note_unanswered(path.stem, message)
    tell(message)


def probe(path: Path, timeout_s: float) -> str | None:
    """Whether the server on ``path`` answers as a job finds it: None where it greets and answers a probe within
    ``timeout_s`` each; else why not ("absent" where no server listens there). A stopped server's backlog still
    takes the connection: only its greeting tells it is alive."""
    try:
        conn = connect(path, timeout_s)
    except (FileNotFoundError, ConnectionRefusedError):
        return "absent"
    except TimeoutError:
        return (f"the job server at {path} did not accept a connection within {timeout_s:g} s (stopped, or "
                f"overloaded?); {what_mends(path)}")
    except OSError as exc:
        return f"the job server at {path} could not be reached ({exc}); {what_mends(path)}"
    server, step = f"the job server at {path} (pid {peer(conn)[0]})", "greet"
    with conn:
        try:
            reader = conn.makefile("rb")
            greeting = reader.readline(len(GREETING))
            if not greeting:  # it was exiting (idle): the next job starts another
                return "absent"
            if greeting != GREETING:
                return f"{server} did not greet as a job server of this package; {what_mends(path)}"
            step = "answer"
            conn.sendall(framed({"probe": True}))
            answer = reader.readline(32)
        except TimeoutError:
            return f"{server} did not {step} within {timeout_s:g} s (stopped, or overloaded?); {what_mends(path)}"
        except OSError as exc:
            return f"{server} hung up before it could {step} ({exc}); {what_mends(path)}"
    return None if answer == b"0\n" else f"{server} answered {answer!r} to a probe; {what_mends(path)}"


def what_mends(path: Path) -> str:
    """What to do about a server that does not answer as it should on ``path``."""
    return (f"if it stays so, end it (its pid is in its log, {folder() / (path.stem + '.log')}) or remove {path}: the "
            "next job starts another")


def run_in_child(conn: socket.socket, script: str, path: Path, timeout_s: float = HAND_OVER_TIMEOUT_S) -> int | None:
    """Send the job to the server connected on ``conn`` (at ``path``), pass signals on to its child, return its exit
    status; None when the server forked no child (the job then runs in its own process)."""
    request = framed({"script": script, "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
                      "umask": current_umask(), "process": job_process(), "sent": time.time()})
    with conn:
        reader = conn.makefile("rb")
        pid = send_job(conn, reader, request, path, timeout_s)
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


def send_job(conn: socket.socket, reader, request: bytes, path: Path, timeout_s: float) -> int | None:
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
        socket.send_fds(conn, [request], [0, 1, 2])
        step = "fork the job's child"
        line = reader.readline(32)
        if line == b"0\n":
            reason = reader.read(4096).decode(errors="replace").strip() or "it was exiting"
            tell(f"{server} did not take this job ({reason})", logging.INFO)
            return None
    except TimeoutError:
        unanswering(path, f"{server} did not {step} within {timeout_s:g} s (stopped, or overloaded?); "
                    f"{what_mends(path)}")
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
                conn.sendall(framed({"stop": True}))
                reader = conn.makefile("rb")
                stopped += reader.readline() == GREETING and reader.readline().strip() == b"0"
        except OSError:
            pass
    return stopped


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def start_server(key: str, idle_s: float, preload: tuple[str, ...] = ()) -> str | None:
    """Start this key's server (importing ``preload``) in the background unless another job is starting it; where
    this key's server refused to serve, start none and return why (the caller says it)."""
    where = folder()
    try:
        lock = open(where / f"{key}.lock", "a+")  # noqa: SIM115 (held until the job ends; the server inherits it)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another job holds the lock: it is starting (or runs) the server
    refused = where / f"{key}.refused"
    if refused.exists():  # its jobs run in their own processes
        why = refused.read_text(errors="replace").strip() or "see its log"
        return (f"the job server of key {key} refused to serve: {why}; its log is {where / (key + '.log')}, and once "
                f"that is mended, remove {refused}: the next job starts another")
    logfile = open(where / f"{key}.log", "a")  # noqa: SIM115 (the server writes it)
    subprocess.Popen([sys.executable, "-m", "stagereplay.runtime.job_server", "--key", key, "--idle-s", str(idle_s),
                      "--preload", ",".join(preload)],
                     stdin=subprocess.DEVNULL, stdout=logfile, stderr=logfile, start_new_session=True,
                     pass_fds=(lock.fileno(),),
                     env={**{k: v for k, v in os.environ.items() if k != RUN_ENV}, LOCK_FD_ENV: str(lock.fileno())})
    log.info("job server %s starting in the background (log %s); this job runs in its own process", key,
             where / f"{key}.log")
    return None
