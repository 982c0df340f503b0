"""Where a job server's files are (its folder: sockets, locks, logs) and whether a server can use them: the folder
must be this user's alone, and a socket's path short enough for Linux. Knows nothing of the protocol or the job.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from stagereplay.runtime.server_protocol import PID_MAX

FOLDER_ENV = "STAGEREPLAY_JOB_SERVER_DIR"
SUN_PATH_MAX = 107  # bytes of a socket's path on Linux (sockaddr_un's sun_path: 108 with the closing NUL)
KEY_CHARS = 20  # a server's key (server_key), its socket's name


def folder() -> Path:
    """``$STAGEREPLAY_JOB_SERVER_DIR``, else a per-user folder in the system temp dir."""
    if os.environ.get(FOLDER_ENV):
        return Path(os.environ[FOLDER_ENV])
    return Path(tempfile.gettempdir()) / f"stagereplay-jobs-{os.getuid()}"


def socket_folder(where: Path | None = None) -> Path:
    """Where the sockets of the servers of ``where`` (default :func:`folder`) are: that folder where a socket's
    longest path in it fits Linux's limit (:func:`fits`), else a short folder of this user's in the system temp dir,
    named after it, where that one fits (:func:`socket_problem` says when neither does)."""
    where = Path(where) if where is not None else folder()
    if fits(where):
        return where
    digest = hashlib.sha256(str(where.resolve()).encode()).hexdigest()[:12]
    shorter = Path(tempfile.gettempdir()) / f"stagereplay-jobs-{os.getuid()}-{digest}"
    return shorter if fits(shorter) else where


def fits(where: Path) -> bool:
    """Whether a server's socket in ``where`` can be bound: the longest name it binds (a key's, the longest pid's)
    has at most SUN_PATH_MAX bytes. (Measured on the socket's own path, not on the folder's length alone: a fixed
    cut on the folder turned the server off under a $TMPDIR of 42 to 54 characters whose usual folder fits.)"""
    return len(os.fsencode(bound_path(where / ("k" * KEY_CHARS + ".sock"), PID_MAX))) <= SUN_PATH_MAX


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
            f"to a short folder of your own ({longest_folder()} bytes at most, as /tmp/stagereplay-jobs-{os.getuid()})")


def longest_folder() -> int:
    """The most bytes a server folder's path may have for its sockets to fit in it (:func:`fits`)."""
    return SUN_PATH_MAX - len(os.fsencode(bound_path(Path("/" + "k" * KEY_CHARS + ".sock"), PID_MAX)))


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
