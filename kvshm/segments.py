"""Finding and removing shared-memory segments whose server is gone.

The process that created a pool (``Pool.create``; a running server) holds an exclusive
whole life. A segment nobody holds a lock on belongs to a server that died without
cleaning up (SIGKILL, OOM, power cut): :func:`cleanup` unlinks it. The lock is tied to the
open file, not to a pid, so pid reuse and pid namespaces cannot fool it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import stat
import tempfile
import time

__all__ = ["SHM_DIR", "hold", "is_held", "list_segments", "cleanup", "DEFAULT_PREFIX"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: Default name prefix of server segments (``kvshm-<port>-<pid>-<random>``).
DEFAULT_PREFIX = "kvshm-"
_MAGIC = b"KVSHMPL1"
# The shared index and its reads ring (kvshm/_shmindex.pyx) live and die with the pool.
_INDEX_MAGIC = b"KVSHMIX1"
_SEGMENT_MAGICS = (_MAGIC, _INDEX_MAGIC, b"KVSHMRR1")
_INDEX_STATE_OFFSET = 56     # kvshm._shmindex.STATE_OFFSET
_INDEX_CLOSED = 2            # kvshm._shmindex.STATE_CLOSED


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def hold(name: str) -> int:
    """Take the liveness lock of segment ``name``; returns the fd to keep open.

    Raises
    ------
    BlockingIOError
        Another live process holds it.
    """
    fd = os.open(_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def is_held(name: str) -> bool:
    """True when a live server holds segment ``name`` (or it cannot be checked)."""
    try:
        fd = os.open(_path(name), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True   # locked by a live server (or not ours to check: leave it)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _magic(name: str) -> bytes:
    try:
        with open(_path(name), "rb") as f:
            return f.read(8)
    except OSError:
        return b""


def _is_pool(name: str) -> bool:
    return _magic(name) in _SEGMENT_MAGICS


def _mark_index_closed(name: str) -> None:
    # A client may still map a dead server's index: mark it closed so its lock-free
    # reads stop at once (they would otherwise notice only by the missing lock).
    try:
        fd = os.open(_path(name), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.pwrite(fd, _INDEX_CLOSED.to_bytes(8, "little"), _INDEX_STATE_OFFSET)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_segments(prefix: str = DEFAULT_PREFIX) -> list[tuple[str, bool]]:
    """``(name, held)`` for each kvshm pool segment in /dev/shm whose name starts with
    ``prefix``."""
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    return [(n, is_held(n)) for n in names if n.startswith(prefix) and _is_pool(n)]


def _ipc_dir_stale(path: str, grace: float = 60.0) -> bool:
    """True when ``path`` (a server's private ipc directory) has no server behind it: its
    socket refuses connections, or it has none and is older than ``grace`` seconds (a
    server binds it right after making the directory)."""
    sock_path = os.path.join(path, "service.sock")
    if not os.path.exists(sock_path):
        try:
            return time.time() - os.stat(path).st_mtime > grace
        except OSError:
            return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(sock_path)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    finally:
        s.close()
    return False


def cleanup_ipc_dirs(tmpdir: str | None = None, dry_run: bool = False) -> list[str]:
    """Remove the private ipc directories (``$TMPDIR/kvshm-ipc-*``) of servers that are
    gone (a SIGKILLed server cannot remove its own). Returns the paths removed."""
    base = tmpdir or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return []
    uid = os.getuid()
    for n in names:
        path = os.path.join(base, n)
        if not n.startswith("kvshm-ipc-"):
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or not _ipc_dir_stale(path):
            continue
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def cleanup(prefix: str = DEFAULT_PREFIX, dry_run: bool = False) -> list[str]:
    """Unlink every kvshm pool segment (name starting with ``prefix``) that no live server
    holds. Returns the names removed (or that would be, with ``dry_run``)."""
    removed = []
    for name, held in list_segments(prefix):
        if held:
            continue
        # Lock it ourselves while unlinking so a server starting now cannot race us.
        try:
            fd = hold(name)
        except OSError:
            continue
        try:
            if not dry_run:
                if _magic(name) == _INDEX_MAGIC:
                    _mark_index_closed(name)
                os.unlink(_path(name))
                log.info("removed segment %s of a server that is gone", name)
            removed.append(name)
        except OSError as exc:
            log.warning("cannot remove segment %s: %s", name, exc)
        finally:
            os.close(fd)
    return removed
