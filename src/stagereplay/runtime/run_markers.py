"""What the jobs of one run tell each other about the job server, through a folder of the run's own (its path in
``$STAGEREPLAY_JOB_SERVER_RUN``, made by the run's start, :func:`start_run`): which reasons for running a job in
its own process the run's console was told already (it is told each once), and which servers did not answer a job
(the run's later jobs run in their own processes at once, instead of each waiting for the server in turn).

A job outside such a run (no variable: a job started by hand, or on a node the variable does not reach) is a run
of its own: it tells its console and waits for itself. Knows nothing of the protocol or of the server.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

RUN_ENV = "STAGEREPLAY_JOB_SERVER_RUN"


def start_run() -> Path | None:
    """Make this run's folder (private, in the system temp dir) and hand it to the run's jobs (their environment is
    this process's); it goes when this process exits. None where it cannot be made: each job is then a run of its
    own."""
    try:
        where = Path(tempfile.mkdtemp(prefix="stagereplay-run-"))
    except OSError:
        os.environ.pop(RUN_ENV, None)
        return None
    os.environ[RUN_ENV] = str(where)
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    return where


def run_folder() -> Path | None:
    """This job's run's folder; None outside a run (or where it is gone)."""
    where = os.environ.get(RUN_ENV)
    return Path(where) if where and os.path.isdir(where) else None


def first_to_say(message: str) -> bool:
    """Whether the run's console is yet to be told ``message``: True once per run (and always outside one); the
    caller then tells it."""
    where = run_folder()
    if where is None:
        return True
    try:
        os.close(os.open(where / f"told-{hashlib.sha256(message.encode()).hexdigest()[:16]}",
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def note_unanswered(key: str, reason: str) -> None:
    """Record for the run's later jobs that the server of ``key`` did not answer (``reason``)."""
    where = run_folder()
    if where is None:
        return
    part = where / f"unanswered-{key}.{os.getpid()}.part"
    try:
        part.write_text(reason)
        os.replace(part, where / f"unanswered-{key}")
    except OSError:
        pass


def unanswered(key: str) -> str | None:
    """Why the server of ``key`` did not answer an earlier job of this run; None where none of them met that."""
    where = run_folder()
    try:
        return (where / f"unanswered-{key}").read_text() if where is not None else None
    except OSError:
        return None
