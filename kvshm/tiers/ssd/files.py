"""The SSD tier's files: one directory, locked by one server, holding pre-allocated data
files used in blocks (one :class:`~kvshm.BitmapAllocator` per file).

Layout of ``--ssd-path DIR``::

    DIR/kvshm-ssd.lock        flock'ed while a server uses DIR (one server per directory)
    DIR/kvshm-ssd-<i>.dat     data files, posix_fallocate'd at start-up, used in blocks of
                              the pool's block size (one BitmapAllocator per file)
    DIR/kvshm-ssd.manifest    with ``persist``: key, file, block, size, xxh64 per entry
                              (see :mod:`kvshm.tiers.ssd.manifest`)
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os

from kvshm._bitmap import BitmapAllocator
from kvshm.tiers.ssd.entry import ALIGN, GiB

__all__ = ["SsdFile", "FileSet", "LOCK_NAME", "MANIFEST_NAME", "DATA_FMT", "remove_file"]

log = logging.getLogger(__name__)

LOCK_NAME = "kvshm-ssd.lock"
MANIFEST_NAME = "kvshm-ssd.manifest"
DATA_FMT = "kvshm-ssd-{}.dat"


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

    def __init__(self, path: str, block_size: int, want_direct: bool | None) -> None:
        self.path = path
        self.bs = block_size
        self.want_direct = want_direct
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
            remove_file(os.path.join(self.path, LOCK_NAME))
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        if remove and self.created_dir:
            try:
                os.rmdir(self.path)
            except OSError:
                pass
