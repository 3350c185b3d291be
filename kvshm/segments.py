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

__all__ = ["SHM_DIR", "hold", "is_held", "list_segments", "cleanup", "DEFAULT_PREFIX"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: Default name prefix of server segments (``kvshm-<port>-<pid>-<random>``).
DEFAULT_PREFIX = "kvshm-"
_MAGIC = b"KVSHMPL1"


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


def _is_pool(name: str) -> bool:
    try:
        with open(_path(name), "rb") as f:
            return f.read(8) == _MAGIC
    except OSError:
        return False


def list_segments(prefix: str = DEFAULT_PREFIX) -> list[tuple[str, bool]]:
    """``(name, held)`` for each kvshm pool segment in /dev/shm whose name starts with
    ``prefix``."""
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    return [(n, is_held(n)) for n in names if n.startswith(prefix) and _is_pool(n)]


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
                os.unlink(_path(name))
                log.info("removed segment %s of a server that is gone", name)
            removed.append(name)
        except OSError as exc:
            log.warning("cannot remove segment %s: %s", name, exc)
        finally:
            os.close(fd)
    return removed
