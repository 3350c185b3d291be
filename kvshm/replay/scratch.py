"""Private temporary directories of a replay (``$TMPDIR/kvshm-replay-<kind>-*``: the
hand-off of ``--clients K``, redis's working directory, an SSD tier's files), and the
removal of those a killed replay left behind.

A replay holds an exclusive ``flock`` on ``DIR/.lock`` for as long as it uses ``DIR``;
the kernel drops it when the process ends, however it ends. A directory is stale only
when that lock can be taken: no pid is believed (pids are reused, and a name in the
shared /tmp is chosen by whoever made it). Only directories of this user are looked
at (``lstat``: a real directory, not a symlink, owned by the effective uid), so a
replay run as root never touches another user's, and a strange name can never make it
fail.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import tempfile

__all__ = ["ScratchDir", "remove_stale", "PREFIX"]

log = logging.getLogger(__name__)

PREFIX = "kvshm-replay-"
LOCK = ".lock"


class ScratchDir:
    """A new private directory (mode 0700) ``$TMPDIR/kvshm-replay-<kind>-XXXX``, locked
    while open; :meth:`close` removes it. A context manager."""

    def __init__(self, kind: str, base: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-", dir=base)
        self._fd = -1
        try:
            # Locked before it has its name: a sweeper never sees it unlocked.
            tmp = os.path.join(self.path, LOCK + ".new")
            self._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, os.path.join(self.path, LOCK))
        except BaseException:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def close(self) -> None:
        """Remove the directory (idempotent)."""
        if self._fd < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> "ScratchDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stale(base: str, name: str) -> bool:
    """True when ``base/name`` is this user's replay directory and no process holds it."""
    path = os.path.join(base, name)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        # No lock file: a directory being made right now (mkdtemp, then the lock), or
        # not a replay's. Leave it.
        if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.EACCES, errno.ENOTDIR):
            log.debug("cannot check %s: %s", path, exc)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False            # a live replay holds it
    finally:
        os.close(fd)            # closing drops the lock we may have taken
    return True


def remove_stale(base: str | None = None) -> list[str]:
    """Remove this user's replay directories that no live replay holds (a SIGKILLed
    replay cannot remove its own). Returns the paths removed; never raises for what it
    finds in ``base`` (default: the temporary directory)."""
    base = base or tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for n in names:
        if n.startswith(PREFIX) and _stale(base, n):
            shutil.rmtree(os.path.join(base, n), ignore_errors=True)
            removed.append(os.path.join(base, n))
    return removed
