"""The SSD tier's files: one directory, locked by one server, holding pre-allocated data
files used in blocks (one :class:`~kvshm.BitmapAllocator` per file).

Layout of ``--ssd-path DIR``::

    DIR/kvshm-ssd.lock        flock'ed while a server uses DIR (one server per directory)
    DIR/kvshm-ssd-<i>.dat     data files, posix_fallocate'd at start-up, used in blocks of
                              the pool's block size (one BitmapAllocator per file)
    DIR/kvshm-ssd.manifest    with ``persist``: key, file, block, size, xxh64 per entry
                              (see :mod:`kvshm.tiers.ssd.manifest`)
    DIR/kvshm-ssd.scratch     without ``persist``: the files are scratch (removed at exit)

Scratch directories are also listed in a private registry of the user,
``$TMPDIR/kvshm-ssd-scratch-<uid>/`` (one small file per directory, holding its path):
a server killed with SIGKILL cannot remove its files, and ``kvshm ctl cleanup``
(:func:`cleanup_scratch`) finds them there and removes those whose lock no server holds.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import stat
import tempfile

from kvshm._bitmap import BitmapAllocator
from kvshm.tiers.ssd.entry import ALIGN, GiB

__all__ = ["SsdFile", "FileSet", "LOCK_NAME", "MANIFEST_NAME", "SCRATCH_NAME", "DATA_FMT",
           "remove_file", "cleanup_scratch", "scratch_registry"]

log = logging.getLogger(__name__)

LOCK_NAME = "kvshm-ssd.lock"
MANIFEST_NAME = "kvshm-ssd.manifest"
SCRATCH_NAME = "kvshm-ssd.scratch"
DATA_FMT = "kvshm-ssd-{}.dat"
_DATA_RE = re.compile(r"^kvshm-ssd-[0-9]+\.dat$")


class SsdFile:
    """One data file: its descriptor, its allocator and the blocks entries hold in it."""

    __slots__ = ("index", "path", "fd", "nblocks", "alloc", "disabled", "entries")

    def __init__(self, index: int, path: str, fd: int, nblocks: int) -> None:
        self.index = index
        self.path = path
        self.fd = fd
        self.nblocks = nblocks
        self.alloc = BitmapAllocator(nblocks)
        self.disabled = False
        self.entries = 0    # blocks of this file held by entries (for the removed-file drop)


def remove_file(path: str) -> None:
    """Unlink ``path``; a missing file is fine, another error is logged."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("SSD tier: cannot remove %s: %s", path, exc)


class FileSet:
    """The directory ``path`` of an SSD tier: its lock and its data files.

    :meth:`open` takes the directory's lock and opens (creating and ``posix_fallocate``-ing)
    ``nfiles`` files of ``per_file`` blocks of ``block_size`` bytes; ``direct`` says
    whether they were opened with O_DIRECT (asked for with ``want_direct``, dropped where
    the filesystem refuses it). :meth:`close` closes them and, with ``remove``, removes
    what this server created (never another server's files: only while it held the lock).
    """

    def __init__(self, path: str, block_size: int, want_direct: bool | None,
                 scratch: bool = False) -> None:
        self.path = path
        self.bs = block_size
        self.want_direct = want_direct
        self.scratch = scratch
        self.files: list[SsdFile] = []
        self.direct = False
        self.lock_fd = -1
        self.locked = False
        self.created_dir = False

    def open(self, nfiles: int, per_file: int) -> None:
        """Raises OSError (naming the directory or the file) when the directory cannot be
        used; files opened so far stay in :attr:`files` for :meth:`close`."""
        path = self.path
        try:
            if not os.path.isdir(path):
                if os.path.exists(path):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory")
                os.makedirs(path, mode=0o700)
                self.created_dir = True
            self.lock_fd = os.open(os.path.join(path, LOCK_NAME),
                                   os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot use SSD directory {path}: "
                                       f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock_fd)
            self.lock_fd = -1
            raise BlockingIOError(errno.EWOULDBLOCK, f"SSD directory {path} is in use by "
                                                     "another kvshm server") from None
        self.locked = True
        if self.scratch:
            _mark_scratch(path)
        else:                   # a persistent tier now: never cleaned up as scratch
            remove_file(os.path.join(path, SCRATCH_NAME))
            _unregister(path)
        want_direct = self.want_direct is not False and hasattr(os, "O_DIRECT")
        self.direct = want_direct
        nbytes = per_file * self.bs
        for i in range(nfiles):
            fpath = os.path.join(path, DATA_FMT.format(i))
            fd = self._open_one(fpath)
            f = SsdFile(i, fpath, fd, per_file)
            self.files.append(f)     # closed by close() on a failure below
            try:
                if os.fstat(fd).st_size > nbytes:
                    os.ftruncate(fd, nbytes)
                os.posix_fallocate(fd, 0, nbytes)   # keeps what is there; a no-op if done
            except OSError as exc:
                why = ("not enough free space" if exc.errno == errno.ENOSPC
                       else exc.strerror or str(exc))
                raise OSError(exc.errno, f"cannot allocate {nbytes / GiB:.3g} GiB for SSD "
                                         f"file {fpath}: {why}") from None
        if self.direct:
            log.info("SSD tier: %d file(s) of %.3g GiB in %s, O_DIRECT", nfiles,
                     nbytes / GiB, path)

    def _open_one(self, fpath: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        if self.direct:
            try:
                fd = os.open(fpath, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise OSError(exc.errno, f"cannot open SSD file {fpath}: "
                                             f"{exc.strerror}") from None
                self._no_direct(fpath, exc)
            else:
                if self._probe_direct(fd):
                    return fd
                os.close(fd)
                self._no_direct(fpath, None)
        try:
            return os.open(fpath, flags, 0o600)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open SSD file {fpath}: {exc.strerror}") from None

    @staticmethod
    def _probe_direct(fd: int) -> bool:
        """Some filesystems accept O_DIRECT at open and refuse the I/O."""
        buf = mmap.mmap(-1, ALIGN)
        try:
            with memoryview(buf) as v:
                if os.fstat(fd).st_size < ALIGN:
                    os.posix_fallocate(fd, 0, ALIGN)
                os.preadv(fd, [v], 0)
            return True
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        finally:
            buf.close()

    def _no_direct(self, fpath: str, exc: OSError | None) -> None:
        if self.direct:
            log.warning("SSD tier: the filesystem of %s does not allow O_DIRECT%s; using "
                        "buffered I/O (the page cache holds copies of spilled entries)",
                        os.path.dirname(fpath), f" ({exc.strerror})" if exc else "")
        self.direct = False

    def removed(self) -> list[SsdFile]:
        """Files in use that were removed under the server (their link count is 0)."""
        out = []
        for f in self.files:
            if f.disabled:
                continue
            try:
                gone = os.fstat(f.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                out.append(f)
        return out

    def close_fds(self) -> None:
        """Close the descriptors only (a forked child's copies)."""
        for f in self.files:
            try:
                os.close(f.fd)
            except OSError:
                pass
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1

    def close(self, remove: bool) -> None:
        """Close every file; with ``remove`` (and the lock held) remove the data files,
        the manifest, the lock file and the directory if this server created it."""
        remove = remove and self.locked     # never another server's files
        for f in self.files:
            try:
                os.close(f.fd)
            except OSError:
                pass
            if remove:
                remove_file(f.path)
        if remove:
            remove_file(os.path.join(self.path, MANIFEST_NAME))
            remove_file(os.path.join(self.path, SCRATCH_NAME))
            remove_file(os.path.join(self.path, LOCK_NAME))
            _unregister(self.path)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        if remove and self.created_dir:
            try:
                os.rmdir(self.path)
            except OSError:
                pass


# ---------------------------------------------------------------------- scratch registry

def scratch_registry(create: bool = False) -> str | None:
    """This user's registry of scratch SSD directories, or None when it is missing or not
    safely ours (not a real directory, not owned by us, open to others)."""
    path = os.path.join(tempfile.gettempdir(), f"kvshm-ssd-scratch-{os.geteuid()}")
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            log.warning("SSD tier: cannot make the scratch registry %s: %s", path, exc)
            return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or st.st_mode & 0o077):
        if create:
            log.warning("SSD tier: %s is not a private directory of this user; scratch "
                        "files left by a killed server will not be found by `kvshm ctl "
                        "cleanup`", path)
        return None
    return path


def _entry_name(path: str) -> str:
    return hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:24]


def _mark_scratch(path: str) -> None:
    """Mark ``path`` scratch (a marker in it, an entry in the registry); best effort."""
    try:
        with open(os.path.join(path, SCRATCH_NAME), "w") as f:
            f.write("the kvshm-ssd-*.dat files here are scratch: a server without "
                    "--ssd-persist removes them at exit, `kvshm ctl cleanup` after a crash\n")
    except OSError as exc:
        log.warning("SSD tier: cannot mark %s as scratch: %s", path, exc)
        return
    reg = scratch_registry(create=True)
    if reg is None:
        return
    entry = os.path.join(reg, _entry_name(path))
    try:
        fd = os.open(entry + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, os.fsencode(os.path.abspath(path)))
        finally:
            os.close(fd)
        os.replace(entry + ".new", entry)
    except OSError as exc:
        log.warning("SSD tier: cannot register %s in %s: %s", path, reg, exc)


def _unregister(path: str) -> None:
    reg = scratch_registry()
    if reg is not None:
        remove_file(os.path.join(reg, _entry_name(path)))


def _remove_scratch_dir(path: str, dry_run: bool) -> list[str] | None:
    """Remove the scratch files of ``path`` if no server holds its lock. Returns what was
    (or would be) removed; None when it is in use or not a scratch directory."""
    if not os.path.exists(os.path.join(path, SCRATCH_NAME)):
        return None
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1                 # killed before it made its lock: nothing holds it
    except OSError:
        return None
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return None     # a live server uses it
        try:
            names = os.listdir(path)
        except OSError:
            return None
        out = []
        for n in sorted(names):
            if _DATA_RE.match(n) or n in (MANIFEST_NAME, MANIFEST_NAME + ".tmp",
                                          SCRATCH_NAME, LOCK_NAME):
                p = os.path.join(path, n)
                if not dry_run:
                    remove_file(p)
                out.append(p)
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def cleanup_scratch(paths: list[str] | None = None, dry_run: bool = False) -> list[str]:
    """Remove the scratch files (``kvshm-ssd-*.dat``, lock, marker) that servers killed
    without a chance to clean up left in their SSD directories: the registered ones and
    ``paths``, each only when no live server holds its lock and it is marked scratch
    (a ``--ssd-persist`` directory never is). An emptied directory is removed too.
    Returns the paths removed (or that would be, with ``dry_run``)."""
    reg = scratch_registry()
    todo: list[tuple[str, str | None]] = [(os.path.abspath(p), None) for p in paths or ()]
    if reg is not None:
        try:
            names = sorted(os.listdir(reg))
        except OSError:
            names = []
        for n in names:
            entry = os.path.join(reg, n)
            try:
                with open(entry, "rb") as f:
                    todo.append((os.fsdecode(f.read()), entry))
            except OSError:
                continue
    removed: list[str] = []
    seen: set[str] = set()
    for path, reg_entry in todo:
        if path in seen:
            continue
        seen.add(path)
        if not os.path.isdir(path):
            if reg_entry is not None and not dry_run:
                remove_file(reg_entry)      # the directory is gone: forget it
            continue
        got = _remove_scratch_dir(path, dry_run)
        if got is None:
            continue
        removed += got
        if not dry_run:
            if reg_entry is not None:
                remove_file(reg_entry)
            try:
                os.rmdir(path)
                removed.append(path)
            except OSError:
                pass                        # other files of the user's stay
    return removed
