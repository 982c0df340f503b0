"""What passes between a job and its job server (:mod:`stagereplay.runtime.job_server`) on the server's socket:
the server's greeting, a request's framing (an 8-byte length, then JSON, with the job's standard streams as
descriptors beside it), the environment variables each side sets for the other, and who is at the other end.
Knows nothing of where the sockets are, of what a server imports, or of the job.
"""

from __future__ import annotations

import array
import json
import socket

CHILD_ENV = "STAGEREPLAY_JOB_SERVER_CHILD"  # set in a forked child: hand_over returns at once
LOCK_FD_ENV = "STAGEREPLAY_JOB_SERVER_LOCK_FD"  # the descriptor of the key's lock, passed to the server it starts
DEFAULT_IDLE_S = 300.0
MAX_HEADER = 4 << 20
PID_MAX = 1 << 22  # the highest pid_max Linux allows
# How long a job waits for each step of its hand-over (the connection, the server's greeting, the pid of its child)
# before it runs in its own process (the config's job_server_timeout_s); the wait for its exit status has no limit.
HAND_OVER_TIMEOUT_S = 10.0
GREETING = b"stagereplay job server\n"  # a server's first line to each connection: the job's streams go to no other


def framed(request: dict) -> bytes:
    """A request as it goes on the wire: its length (8 bytes, big-endian), then its JSON."""
    header = json.dumps(request).encode()
    return len(header).to_bytes(8, "big") + header


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


def peer(conn: socket.socket) -> tuple[int | None, int | None]:
    """The pid and uid of the process at the other end of ``conn`` (Linux: SO_PEERCRED; elsewhere None, None)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None, None
    import struct

    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid
