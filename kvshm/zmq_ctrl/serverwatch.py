"""What the kernel proves about a same-host server: gone, or replaced by another.

A client on the server's ``ipc://`` endpoint would otherwise wait its whole timeout on a
server that is not there any more: ZeroMQ reconnects to an ipc path for ever, a restarted
server binds a new private directory, and a SIGKILLed one leaves its socket file and pool
segment behind. Three facts need no reply from the server:

- the ipc socket file is gone, or is another inode than the one the client connected to
  (the server stopped, or another bound the path);
- the pool segment's ``flock`` (taken by the server for its whole life,
  :func:`kvshm.segments.hold`) is no longer held: the server process is gone, however it
  ended (tested on the segment the client attached, through a descriptor kept open, so a
  new server's segment of the same name cannot answer for it);
- nothing listens at the server's address on this host (the kernel refuses the connect).

:class:`ServerWatch` checks the first two (a ``flock`` and a ``stat``: two system calls,
15-30 us measured in a loaded sandbox where one costs ~10 us); the channels call it
before a send after an idle spell (:data:`IDLE_S`) and every :data:`POLL_S` while waiting
for a reply. :func:`listening` checks the third, once, after a server was found gone.
The kept descriptor holds a removed segment's memory as the client's mapping of it does,
until the next HELLO replaces the watch or the client closes.
"""

from __future__ import annotations

import fcntl
import os
import socket

from kvshm import segments
from kvshm.errors import ServerUnavailable

__all__ = ["ServerWatch", "ServerGone", "listening", "IDLE_S", "POLL_S"]

#: Seconds a connection may stay idle before the next send checks the server first (a
#: busy client pays nothing; chosen far above one round trip, far below a restart).
IDLE_S = 0.1
#: Seconds between checks while a reply is awaited (how late a death is noticed).
POLL_S = 0.2


class ServerGone(ServerUnavailable):
    """The kernel proves the server is gone or replaced. ``sent``: the request may have
    reached the old server (False: it was not sent at all; nothing was done)."""

    def __init__(self, message: str, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


def _inode(path: str) -> tuple[int, int, int] | None:
    """The identity of the file at ``path``: device, inode and change time (a file made
    after another was removed may get its inode number again; not its ctime)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


class ServerWatch:
    """The liveness facts of one same-host server, taken when the client connected.

    Parameters
    ----------
    pool_name : str
        The server's pool segment (HELLO's ``pool.name``), whose flock it holds.
    endpoint : str
        The endpoint the client is on; for ``ipc://PATH`` the socket file's inode is
        recorded now and compared at each check.
    """

    __slots__ = ("pool_name", "ipc_path", "ipc_id", "_fd")

    def __init__(self, pool_name: str, endpoint: str) -> None:
        self.pool_name = pool_name
        self.ipc_path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
        self.ipc_id = _inode(self.ipc_path) if self.ipc_path else None
        try:
            self._fd = os.open(segments.SHM_DIR + "/" + pool_name.lstrip("/"),
                               os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1          # not ours to open: the ipc socket alone tells

    def gone(self) -> str | None:
        """Why the server is proven gone, or None (alive, or it cannot be told)."""
        fd = self._fd
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass               # the server's exclusive lock: alive
            except OSError:
                pass               # cannot be told
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
                return (f"its pool segment {self.pool_name} is no longer locked (the "
                        "server exited)")
        if self.ipc_path is not None and self.ipc_id is not None:
            now = _inode(self.ipc_path)
            if now is None:
                return f"its ipc socket {self.ipc_path} is gone"
            if now != self.ipc_id:
                return f"its ipc socket {self.ipc_path} is another server's now"
        return None

    def close(self) -> None:
        """Close the descriptor on the segment (it keeps a removed segment's memory)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


def listening(endpoint: str, timeout: float = 0.5) -> bool:
    """False when the kernel refuses a connection to ``endpoint`` (tcp or ipc): no server
    listens there. True when one accepts, or it cannot be told (no reply in ``timeout``
    seconds, another error)."""
    try:
        if endpoint.startswith("ipc://"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(endpoint[len("ipc://"):])
            return True
        if endpoint.startswith("tcp://"):
            host, _, port = endpoint[len("tcp://"):].rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except (OSError, ValueError):
        return True
    return True
