"""Jobs that start warm: one server per host and environment imports the model stack once and forks a child for
each job, so that a job pays for its weights, tokenizer and work, not for importing torch and transformers (the
model stages, and the report, figures and item browser, which import the analysis stack and a tokenizer).

A model job's fresh process spends most of its start importing (torch, torch's deterministic switch and the
``torch._dynamo`` chain transformers pulls in, the model's transformers code, the stage modules; bench/RESULTS.md,
"Job start"). With ``job_server: true`` in the config each warm job calls :func:`.hand_over.hand_over` first, naming
the modules its server imports (the caller's preload):

- it connects to the server of its key (the preload, the Python executable, where the packages are found, the
  package's source files as stat records, the environment variables read at import time, its control groups), waits
  for its greeting, sends its script, arguments, working folder, umask, environment, process attributes
  (:mod:`.job_process`) and standard streams (the descriptors themselves), and waits. The server forks; the child
  takes the job's process attributes (or answers why it cannot, and the job runs in its own process), streams,
  folder and environment, sets the preloaded libraries' thread counts and temp folder as the job's fresh process
  would find them (:mod:`.import_state`), and runs the same script from its top (:func:`~.hand_over.hand_over`
  returns at once in a child), then reports its exit status; the job exits with it. A signal the job receives
  (Snakemake cancelling it) is passed on to the child; a job killed outright takes the child and its process group
  with it.
- when no server answers, the job starts one in the background (one per key: a lock) and runs in its own process as
  without the server; the jobs after it fork from the server once it has imported.
- when no server can serve it (a socket folder that is not this user's alone, a socket path too long for Linux) or
  the one that answers does not answer as a server (within ``job_server_timeout_s`` for each step up to its child's
  pid; the job's own run has no limit), the job runs in its own process and says why: in its log (and a model
  job's log's first line, :func:`.hand_over.process_start`), and on the run's console once per run (the run's start
  probes the server as a job would and says it there; a server that kept a job waiting in vain is not waited for by
  the run's later jobs: :mod:`.run_markers`).

The child computes exactly what a fresh process computes: the server only imports, in a folder of its own (it
never runs a torch operation, initialises CUDA or starts a thread, and imports no module that reads its working
folder as it loads; it refuses to serve when an import did), the child takes the job's process and environment
before anything of the job reads them, and each job is still its own process, sharing nothing with the others
(the audit still recomputes from the saved ledger alone). tests/test_cluster_executor.py compares a workflow run
with and without the server byte for byte. The server exits after ``idle_s`` seconds without a job, and when its
source files or a file it imported change (it forks no more jobs and exits; the next job starts a new server).

Snakemake's benchmark files time the waiting job, so with the server their wall seconds are right but their CPU
and memory columns miss the child's. Knows nothing of models: what to import comes from the caller.

This module is the server's side: its loop and the child it forks for each job (``python -m
stagereplay.runtime.job_server`` runs it). The job's side is :mod:`.hand_over`; what passes between them is
:mod:`.server_protocol`, where the server's files are :mod:`.server_folder`, and which server a job may fork from
:mod:`.server_key`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

from stagereplay.runtime.import_state import FOLDER_AT_IMPORT, take_job_state
from stagereplay.runtime.job_process import take_job_process
from stagereplay.runtime.server_folder import (
    bound_path,
    folder,
    folder_problem,
    socket_folder,
    socket_path,
    socket_problem,
)
from stagereplay.runtime.server_key import changed_file, loaded_files, server_key
from stagereplay.runtime.server_protocol import CHILD_ENV, DEFAULT_IDLE_S, GREETING, LOCK_FD_ENV, peer, receive

log = logging.getLogger("stagereplay")


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
    import_preload(preload)
    if unlike := unlike_a_fresh_process():
        why = f"{', '.join(unlike)} after the imports (a fork would not be a fresh process)"
        print(f"refusing to serve: {why}", flush=True)
        (folder() / f"{key}.refused").write_text(why)  # the jobs of this key say it (hand_over.start_server)
        return 1
    imported = loaded_files()  # checked before each job: the key holds only what a job knows before it imports
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
            if (taken := take_request(conn)) is None:
                continue
            request, fds = taken
            stale = "asked to stop" if request.get("stop") else staleness(key, environment, preload, imported)
            if stale:
                conn.sendall(f"0\n{stale}\n".encode())
                conn.close()
                for fd in fds:
                    os.close(fd)
                why = stale
                break
            if not job_waits(conn):  # it gave up waiting (job_server_timeout_s): its own process runs it
                print("a job gave up waiting before its child was forked: forked none for it", flush=True)
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            served += 1
            fork_job(conn, request, fds, listener, lock_fd)
    finally:
        path.unlink(missing_ok=True)  # the key's lock is this process's: no other server of it made this file
    print(f"{why} after {served} jobs: exiting", flush=True)
    return 0


def import_preload(preload: tuple[str, ...]) -> None:
    """Import ``preload`` in the server's own folder (an optional model type's code that fails to import is left to
    its jobs)."""
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


def unlike_a_fresh_process() -> list[str]:
    """What, after the imports, would leave a forked child unlike a fresh process ([]: nothing)."""
    # Native threads that the libraries start at import (torch's, pyarrow's jemalloc) are theirs to mend in a fork
    # (their fork handlers); a Python thread, an initialised CUDA or a module that read its folder as it was
    # imported would leave the child unlike a fresh process.
    torch = sys.modules.get("torch")
    unlike = [f"{threading.active_count()} Python threads"] if threading.active_count() > 1 else []
    if torch is not None and torch.cuda.is_initialized():
        unlike.append("CUDA initialised")
    unlike += [f"{name} imported ({why})" for name, why in FOLDER_AT_IMPORT.items() if name in sys.modules]
    return unlike


def take_request(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """A job's request and descriptors, after the server's greeting; None where there is no job to serve on
    ``conn`` (another user's process, a request that failed, a run's probe answered), which is then closed."""
    if not same_user(conn):  # the folder's mode keeps others out; this is the second lock
        conn.close()
        return None
    try:
        conn.sendall(GREETING)
        conn.settimeout(30)
        request, fds = receive(conn)
        conn.settimeout(None)
    except (OSError, ValueError) as exc:
        print(f"a job's request failed: {exc}", flush=True)
        conn.close()
        return None
    if request.get("probe"):  # a run's start asking whether it answers (hand_over.probe)
        conn.sendall(b"0\nanswering\n")
        conn.close()
        return None
    return request, fds


def fork_job(conn: socket.socket, request: dict, fds: list[int], listener: socket.socket,
             lock_fd: int | None) -> None:
    """Fork the job's child (:func:`run_child`); the server keeps neither the job's connection nor its streams."""
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


def staleness(key: str, environment: dict, preload: tuple[str, ...], imported: list) -> str | None:
    """Why this server may fork no more jobs: one of this package's source files changed since its imports (its
    key is another now), or one of the files it imported (``imported``, :func:`.server_key.loaded_files`:
    transformers' modeling files, torch, pandas...); None while neither did."""
    if server_key(environment, preload) != key:
        return "its source files changed since it started"
    if moved := changed_file(imported):
        return f"{moved}, which it imported, changed since it started"
    return None


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
