"""Finding and removing shared-memory segments whose server is gone.

The process that created a pool (``Pool.create``; a running server) holds an exclusive
whole life. A segment nobody holds a lock on belongs to a server that died without
cleaning up (SIGKILL, OOM, power cut): :func:`cleanup` unlinks it. The lock is tied to the
open file, not to a pid, so pid reuse and pid namespaces cannot fool it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from typing import Any

__all__ = ["SHM_DIR", "hold", "is_held", "list_segments", "cleanup", "DEFAULT_PREFIX",
           "ClientProof", "Liveness", "proof_name", "token_digest"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: Default name prefix of server segments (``kvshm-<port>-<pid>-<random>``).
DEFAULT_PREFIX = "kvshm-"
_MAGIC = b"KVSHMPL1"
# The shared index and its reads ring (kvshm/_shmindex.pyx) live and die with the pool.
_INDEX_MAGIC = b"KVSHMIX1"
# b"KVSHMPL0": a pool segment being made (kvshm._pool._MAKING_MAGIC); its creator
# holds the lock while it makes it, so only a dead creator's is removed
_SEGMENT_MAGICS = (_MAGIC, b"KVSHMPL0", _INDEX_MAGIC, b"KVSHMRR1")
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


# ---------------------------------------------------------------- client liveness
#
# A same-host client proves two things with one small file next to the segment:
# that it attached the pool (the file's name is a keyed hash of its nonce under the
# pool's secret token, which only a process that read the 0600 segment's header knows;
# the server never sends the token), and that it is alive (it holds an flock on the file
# for as long as it lives; the kernel drops the lock when the last process holding the
# open file exits, whatever its pid or UTS namespace). The server tests the lock; it
# never looks at pids or hostnames. The file's owner is the client's uid, as the kernel
# recorded it.

_PROOF_TAG = ".c-"


def token_digest(token: bytes) -> bytes:
    """What the server tells clients about its pool's token: enough to check that the
    segment they attached is the server's, not enough to make a proof."""
    return hashlib.blake2b(token, digest_size=16, person=b"kvshm-pool-id").digest()


def proof_name(pool_name: str, token: bytes, nonce: bytes) -> str:
    """Name of the liveness file of the client with ``nonce`` in /dev/shm."""
    mac = hashlib.blake2b(nonce, key=token, digest_size=16, person=b"kvshm-live").hexdigest()
    return f"{pool_name.lstrip('/')}{_PROOF_TAG}{mac}"


class ClientProof:
    """The client's side: create and lock its liveness file (see above).

    Parameters
    ----------
    pool_name, token
        The attached pool's name and the token read from its header.
    nonce : bytes
        The client's session nonce (sent in HELLO).

    Raises
    ------
    OSError
        /dev/shm not writable, or the name is taken.
    """

    def __init__(self, pool_name: str, token: bytes, nonce: bytes) -> None:
        self.name = proof_name(pool_name, token, nonce)
        self.path = _path(self.name)
        self._pid = os.getpid()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd

    def close(self) -> None:
        """Drop the proof: unlink the file and release the lock. Idempotent; a forked
        child never removes its parent's proof."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        if os.getpid() == self._pid:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()


class Liveness:
    """The server's side: a client's proof, tested by its lock.

    Made by :meth:`verify`, which keeps the verified file open: :meth:`alive` tests the
    lock on that open file (the inode), never on the name, so a live client whose file
    was deleted or replaced under it (``rm /dev/shm/kvshm-*`` while it runs) stays
    alive, and a dead one is dead whatever now lies at its name. :attr:`uid` is the
    file's owner as the kernel recorded it. One open file descriptor per proof,
    closed by :meth:`remove` (its client is dead) or when the last reference goes (a
    session that ended while its process lives keeps being asked: a reservation of
    kvshm.store.reserve outlives its session until the proof goes, so the store must
    not close a proof when a session merely ends).
    """

    #: Proofs open at once at most (set at import: half the soft RLIMIT_NOFILE, at least
    #: 64); beyond, :meth:`verify` says None (the client is served as a remote one)
    #: rather than take the file descriptors the server's sockets and files need.
    MAX_OPEN = 64
    _open = 0

    def __init__(self, path: str, fd: int, st: os.stat_result) -> None:
        self.path = path
        self._fd = fd
        self._id = (st.st_dev, st.st_ino)
        self.uid = st.st_uid
        Liveness._open += 1

    @classmethod
    def verify(cls, pool_name: str, token: bytes, nonce: Any) -> "Liveness | None":
        """The proof of the client with ``nonce``, or None when there is none: no such
        file, not an empty regular file with exactly one name (a hard link to some
        other locked file of another user, the segment itself say, proves nothing), or
        nobody holds its lock."""
        if type(nonce) is not bytes or not 8 <= len(nonce) <= 64:
            return None
        if Liveness._open >= cls.MAX_OPEN:
            log.warning("%d liveness proofs open, the most this server keeps: a client "
                        "is served as a remote one", Liveness._open)
            return None
        path = _path(proof_name(pool_name, token, nonce))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size == 0 \
                    and _held(fd):
                proof, fd = cls(path, fd, st), -1
                return proof
            return None
        finally:
            if fd >= 0:
                os.close(fd)

    def alive(self) -> bool:
        """True while some process holds the lock on the verified file."""
        return self._fd >= 0 and _held(self._fd)

    def remove(self) -> None:
        """Unlink the file of a dead client (when this user may and it still has its
        name), and close it."""
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._id:
                os.unlink(self.path)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        """Close the verified file (idempotent); :meth:`alive` is False after."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            Liveness._open -= 1
            os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()


def _max_open_proofs() -> int:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(64, soft // 2)


Liveness.MAX_OPEN = _max_open_proofs()


def _held(fd: int) -> bool:
    """Whether another open file holds an exclusive flock on the file open at ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True               # held (exclusively) by the live client
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False                  # nobody holds it: its client is gone


def _locked_stat(path: str) -> os.stat_result | None:
    """stat of ``path`` when it is a regular file whose flock someone holds, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return st if _held(fd) else None
    finally:
        os.close(fd)


def cleanup_proofs(prefix: str = DEFAULT_PREFIX, dry_run: bool = False) -> list[str]:
    """Unlink client liveness files nobody holds whose pool segment is gone (a client
    killed after its server), of pools whose name starts with ``prefix``. Returns the
    names removed (or that would be, with ``dry_run``)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for n in names:
        pool, sep, _ = n.partition(_PROOF_TAG)
        if not sep or not n.startswith(prefix) or os.path.exists(_path(pool)):
            continue
        if _locked_stat(_path(n)) is None and os.path.isfile(_path(n)):
            if not dry_run:
                try:
                    os.unlink(_path(n))
                except OSError:
                    continue
            removed.append(n)
    return removed


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


#: The file of a server's private ipc directory it holds an exclusive flock(2) on for its
#: life, taken before its socket is bound (:func:`hold_ipc_dir`): what tells
#: :func:`cleanup_ipc_dirs` that a server is behind the directory without connecting to
#: its socket (libzmq's ipc listener aborts the server on an accept at EMFILE, so a
#: probe's connect could kill a live server short of descriptors).
IPC_ALIVE = "alive"


def hold_ipc_dir(path: str) -> int:
    """Make ``path``/:data:`IPC_ALIVE` (0600) and hold an exclusive flock on it: the
    server's proof, for its life, that its ipc directory ``path`` is in use (call before
    binding its socket there). Returns the descriptor (close-on-exec); closing it, or
    the process's end, lets the lock go. Raises OSError."""
    fd = os.open(os.path.join(path, IPC_ALIVE),
                 os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)      # (a probe holds LOCK_SH only for a moment)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _ipc_lock_free(path: str) -> bool | None:
    """Whether ``path``/:data:`IPC_ALIVE` is locked by no process (True), held (False),
    or absent (None: a server of an earlier build, which made none)."""
    try:
        fd = os.open(os.path.join(path, IPC_ALIVE),
                     os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return False                # (not ours to judge: kept)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return False
    finally:
        os.close(fd)                # (the shared lock goes with it)
    return True


def _ipc_dir_stale(path: str, grace: float = 60.0) -> bool:
    """True when ``path`` (a server's private ipc directory) has no server behind it: its
    socket is bound but no process holds the lock on its :data:`IPC_ALIVE` file (taken
    before the bind), or, a directory without that file (made by an earlier build), its
    socket refuses connections; or it has no socket and is older than ``grace`` seconds
    (a server binds it right after making the directory). A live server's socket is
    connected to only in that last-but-one case."""
    sock_path = os.path.join(path, "service.sock")
    if not os.path.exists(sock_path):
        try:
            return time.time() - os.stat(path).st_mtime > grace
        except OSError:
            return False
    free = _ipc_lock_free(path)
    if free is not None:
        return free
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
