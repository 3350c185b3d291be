# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The shared-memory pool: one POSIX shm segment, mapped, with bounds-checked copies.

Segment layout::

    [ header: 4096 bytes | data: size bytes ]

The header holds a magic, the layout version, the data size, the block size, the pid of
the creating process and a 16-byte token, so that ``Pool.attach(name)`` learns the block
size and a client can check that it attached the segment its server announced. Every
offset in this API is relative to the start of the data area, which is page aligned.

Copies take any buffer-protocol object (bytes, bytearray, memoryview, numpy arrays) and
torch CPU tensors (through ``data_ptr()``), and run with the GIL released.
"""

cimport cython
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.long cimport PyLong_AsLongLongAndOverflow

import fcntl
import os
import struct
import warnings

import posix_ipc

#: PackedValues.of takes its sizes copy off the collector's lists unless
#: ``KVSHM_UNTRACK=0`` (read at import; kvshm._gcutil's off switch, for A/B figures).
cdef bint _UNTRACK = os.environ.get("KVSHM_UNTRACK", "1") != "0"

from libc.stdint cimport int64_t, uint8_t, uintptr_t
from libc.string cimport memcpy
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED
from posix.unistd cimport getpid, close as c_close
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBuffer_FillInfo,
                             PyBUF_ANY_CONTIGUOUS, PyBUF_WRITABLE)
from libc.stdlib cimport malloc, free as c_free
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from libc.errno cimport errno

cdef extern from "<sys/mman.h>" nogil:
    int MAP_POPULATE
    void* MAP_FAILED
    int madvise(void* addr, size_t length, int advice)
    int MADV_HUGEPAGE

cdef extern from *:
    """
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23
    #endif
    """
    int MADV_POPULATE_WRITE

cdef extern from "<fcntl.h>" nogil:
    int posix_fallocate(int fd, long offset, long length)

cdef extern from *:
    """
    /* kv_stream_copy: memcpy with non-temporal stores, for a write into the pool that
       another process reads later (a write-behind put): the destination lines are not
       read for ownership nor kept in this CPU's caches, ~1.2-1.5x a memcpy of a value
       larger than the caches on x86-64. The stores are fenced (sfence) before it
       returns, so a message sent after it is ordered after the bytes. Elsewhere (or
       below KV_STREAM_MIN bytes) it is memcpy. */
    #include <string.h>
    #include <stdint.h>
    #define KV_STREAM_MIN 4096
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <emmintrin.h>
    #include <immintrin.h>
    static void kv_stream_sse2(char *d, const char *s, size_t n) {
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        memcpy(d + i, s + i, n - i);
    }
    __attribute__((target("avx2")))
    static void kv_stream_avx2(char *d, const char *s, size_t n) {
        size_t i = 0;
        for (; i + 128 <= n; i += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
            __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
            _mm256_stream_si256((__m256i *)(d + i), a);
            _mm256_stream_si256((__m256i *)(d + i + 32), b);
            _mm256_stream_si256((__m256i *)(d + i + 64), c);
            _mm256_stream_si256((__m256i *)(d + i + 96), e);
        }
        memcpy(d + i, s + i, n - i);
    }
    static int kv_have_avx2 = -1;
    static void kv_stream_copy(char *d, const char *s, size_t n) {
        if (n < KV_STREAM_MIN) { memcpy(d, s, n); return; }
        size_t head = (size_t)(-(uintptr_t)d & 63);   /* to a cache line of d */
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        if (kv_have_avx2 < 0) {
            __builtin_cpu_init();
            kv_have_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
        }
        if (kv_have_avx2) kv_stream_avx2(d, s, n); else kv_stream_sse2(d, s, n);
        _mm_sfence();
    }
    #else
    static void kv_stream_copy(char *d, const char *s, size_t n) { memcpy(d, s, n); }
    #endif
    """
    void kv_stream_copy(char* d, const char* s, size_t n) nogil

HEADER_SIZE = 4096
cdef Py_ssize_t _HEADER = 4096
#: Bytes reserved (fallocate) and pre-faulted per step of :meth:`Pool.create`, with the
#: GIL released; a stop request is looked at between steps. 128 MiB: a fraction of a
#: second per step on a loaded box, and the inode lock that an unlink of the segment
#: waits for is held for one step only.
CREATE_STEP = 128 << 20


class CreateStopped(Exception):
    """:meth:`Pool.create` gave up because its ``stop()`` said so (nothing is left)."""
_MAGIC = b"KVSHMPL1"
#: The first bytes of a segment while :meth:`Pool.create` makes it (kvshm.segments).
_MAKING_MAGIC = b"KVSHMPL0"
_LAYOUT_VERSION = 1
# magic, version, flags, data size, block size, creator pid, created (ns), token
_HEADER_FMT = struct.Struct("<8sIIQQQQ16s")


def _normalize_name(name):
    if not isinstance(name, str):
        raise TypeError(f"pool name must be str, got {type(name).__name__}")
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or len(bare) > 250 or "\0" in bare:
        raise ValueError(f"invalid shared-memory name {name!r}: 1-250 characters, no '/'")
    return "/" + bare


cdef struct Span:
    char* ptr
    Py_ssize_t size


cdef class _Holder:
    """Keeps the source of a Span alive and releases its buffer."""
    cdef Py_buffer buf
    cdef bint has_buf
    cdef object keep

    def __dealloc__(self):
        if self.has_buf:
            PyBuffer_Release(&self.buf)


cdef _Holder _span_of(object obj, bint writable, Span* out, str what):
    """Fill ``out`` with the raw bytes of ``obj``; returns an object owning them."""
    cdef _Holder h = _Holder.__new__(_Holder)
    cdef int flags = PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
    try:
        PyObject_GetBuffer(obj, &h.buf, flags)
    except (BufferError, ValueError) as exc:
        if hasattr(obj, "data_ptr"):
            return _tensor_span(obj, writable, out, what)
        if writable and _is_readonly(obj):
            raise TypeError(f"{what} must be a writable buffer, got a read-only "
                            f"{type(obj).__name__}") from None
        raise ValueError(f"{what} must be a contiguous buffer ({exc})") from None
    except TypeError:
        if hasattr(obj, "data_ptr"):
            return _tensor_span(obj, writable, out, what)
        raise TypeError(
            f"{what} must support the buffer protocol or be a torch CPU tensor, "
            f"got {type(obj).__name__}") from None
    h.has_buf = True
    out.ptr = <char*>h.buf.buf
    out.size = h.buf.len
    return h


cdef bint _is_readonly(object obj):
    try:
        return memoryview(obj).readonly
    except (TypeError, ValueError, BufferError):
        return False


cdef _Holder _tensor_span(object t, bint writable, Span* out, str what):
    # torch tensors do not export the buffer protocol; take their storage pointer.
    dev = getattr(t, "device", None)
    if dev is not None and getattr(dev, "type", "cpu") != "cpu":
        raise ValueError(f"{what} is on {dev}; Pool copies take CPU memory "
                         "(use kvshm.cuda for device tensors)")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous tensor")
    cdef _Holder h = _Holder.__new__(_Holder)
    h.keep = t
    out.ptr = <char*><uintptr_t>t.data_ptr()
    out.size = t.numel() * t.element_size()
    return h


cdef class _ViewExport:
    """One exported window of a Pool; counted while a buffer of it is alive."""
    cdef Pool pool
    cdef Py_ssize_t offset
    cdef Py_ssize_t size
    cdef bint readonly

    def __getbuffer__(self, Py_buffer* buf, int flags):
        if self.pool._base == NULL:
            raise BufferError("pool is closed")
        if (flags & PyBUF_WRITABLE) and self.readonly:
            raise BufferError("view is read-only")
        PyBuffer_FillInfo(buf, self, self.pool._base + self.offset, self.size,
                          self.readonly, flags)
        self.pool._exports += 1

    def __releasebuffer__(self, Py_buffer* buf):
        self.pool._exports -= 1


cdef class Pool:
    """A POSIX shared-memory segment holding the store's blocks.

    Create with :meth:`Pool.create` (the server) or :meth:`Pool.attach` (clients); do not
    call the constructor.

    Attributes
    ----------
    name : str
        POSIX shm name, with a leading ``/`` (the file is ``/dev/shm/<name without />``).
    size : int
        Bytes of the data area (``num_blocks * block_size``).
    block_size : int
        Bytes per block.
    num_blocks : int
        ``size // block_size``.
    address : int
        Virtual address of the data area in this process (for ibv_reg_mr, cudaHostRegister).
    token : bytes
        16 bytes chosen by the creator, to check an attach found the right segment.
    creator_pid : int
        Pid of the process that created the segment.
    owner : bool
        True in the creating process (and not in a forked child): only it may unlink.
    """

    cdef char* _map        # start of the mapping (header)
    cdef char* _base       # start of the data area
    cdef Py_ssize_t _map_size
    cdef Py_ssize_t _size
    cdef Py_ssize_t _block_size
    cdef int _exports
    cdef int _busy         # copies in flight (their GIL is released): close() must wait
    cdef bint _unlinked
    cdef readonly str name
    cdef readonly bytes token
    cdef readonly long creator_pid
    cdef long _opener_pid
    cdef bint _created
    cdef int _lock_fd      # creator: flock'ed fd of the segment, held until unlink

    def __cinit__(self):
        self._lock_fd = -1
        self._map = NULL
        self._base = NULL
        self._exports = 0
        self._busy = 0

    def __init__(self):
        raise TypeError("use Pool.create(...) or Pool.attach(...)")

    def __dealloc__(self):
        if self._lock_fd >= 0:
            c_close(self._lock_fd)

    # ------------------------------------------------------------ construction

    @staticmethod
    def create(name, Py_ssize_t size, Py_ssize_t block_size=65536, *, token=None,
               bint populate=True, stop=None):
        """Create, size and map a new segment (mode 0600).

        The segment is reserved (``posix_fallocate``) and, with ``populate``, pre-faulted
        in steps of :data:`CREATE_STEP` bytes with the GIL released; the liveness lock is
        taken before the first step (so no cleanup takes a segment being made for an
        orphan).

        Parameters
        ----------
        name : str
            POSIX shm name; must not exist yet.
        size : int
            Bytes of the data area, a positive multiple of ``block_size``.
        block_size : int
            Bytes per block, a multiple of 4096 (default 64 KiB, docs/DESIGN.md "Words").
        token : bytes, optional
            16 bytes recorded in the header (random by default).
        populate : bool
            Pre-fault the mapping (``MADV_POPULATE_WRITE`` per step, or MAP_POPULATE on
            kernels before 5.14) so the first copies do not page-fault.
        stop : callable, optional
            ``stop() -> bool``, called between steps: True gives up at once (the segment
            is unlinked, :class:`CreateStopped` raised). A server passes its stop request
            (SIGTERM during start-up).

        Raises
        ------
        CreateStopped
            ``stop()`` returned True.
        ValueError
            Bad name, size or block size.
        FileExistsError
            A segment of that name exists.
        OSError
            ENOSPC when /dev/shm has not ``size`` bytes free (checked with statvfs and
            then by ``posix_fallocate``, so a full /dev/shm is an error here and never a
            SIGBUS later); other errno values from shm_open/fallocate/mmap.
        """
        cdef Pool self
        cdef int rc, fd
        cdef long total, off, n
        cdef char* p
        name = _normalize_name(name)
        if block_size < 4096 or block_size % 4096:
            raise ValueError(f"block_size must be a positive multiple of 4096, got {block_size}")
        if size <= 0 or size % block_size:
            raise ValueError(
                f"size must be a positive multiple of block_size ({block_size}), got {size}")
        if token is None:
            token = os.urandom(16)
        if not isinstance(token, bytes) or len(token) != 16:
            raise ValueError("token must be 16 bytes")
        total = _HEADER + size
        _check_shm_space(total)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError:
            raise FileExistsError(f"shared-memory segment {name} already exists") from None
        except posix_ipc.PermissionsError as exc:
            raise PermissionError(f"cannot create shared-memory segment {name}: {exc}") from None
        self = Pool.__new__(Pool)
        try:
            fd = shm.fd
            # Liveness lock: a segment whose creator is gone has no lock, and
            # kvshm.segments.cleanup (``kvshm ctl cleanup``, a starting server) removes it.
            self._lock_fd = os.dup(fd)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # marked as a kvshm pool being made from the first byte on: a creator killed
            # in the steps below leaves a segment that kvshm.segments.cleanup recognises
            # (and removes, its lock gone) and that attach refuses (not _MAGIC)
            os.pwrite(fd, _MAKING_MAGIC, 0)
            off = 0
            while off < total:
                if stop is not None and stop():
                    raise CreateStopped(f"creation of {name} stopped")
                n = min(<long>CREATE_STEP, total - off)
                with nogil:
                    rc = posix_fallocate(fd, off, n)
                if rc != 0:
                    raise OSError(rc, f"cannot reserve {total} bytes for shared-memory "
                                      f"segment {name} ({os.strerror(rc)}); free space in "
                                      "/dev/shm or ask for a smaller pool")
                off += n
            self._map_fd(fd, total, False)
            if populate:
                off = 0
                while off < total:
                    if stop is not None and stop():
                        raise CreateStopped(f"creation of {name} stopped")
                    n = min(<long>CREATE_STEP, total - off)
                    p = self._map + off
                    with nogil:
                        rc = madvise(p, n, MADV_POPULATE_WRITE)
                    if rc != 0:           # before Linux 5.14: one MAP_POPULATE mapping
                        munmap(self._map, self._map_size)
                        self._map = self._base = NULL
                        self._map_fd(fd, total, True)
                        break
                    off += n
        except BaseException:
            if self._map != NULL:
                munmap(self._map, self._map_size)
                self._map = self._base = NULL
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
            try:
                shm.close_fd()
            finally:
                try:
                    shm.unlink()
                except posix_ipc.ExistentialError:   # already unlinked by name
                    pass
            raise
        shm.close_fd()
        self.name = name
        self._size = size
        self._block_size = block_size
        self.token = token
        self.creator_pid = getpid()
        self._opener_pid = self.creator_pid
        self._created = True
        self._write_header()
        return self

    @staticmethod
    def attach(name, *, bint populate=True):
        """Map an existing segment made by :meth:`Pool.create` (possibly in another process).

        Raises
        ------
        FileNotFoundError
            No segment of that name.
        PermissionError
            The segment belongs to another user (mode 0600).
        ValueError
            The segment is not a kvshm pool (bad magic or version, too small).
        """
        cdef Pool self
        name = _normalize_name(name)
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no shared-memory segment {name}") from None
        except posix_ipc.PermissionsError as exc:
            raise PermissionError(f"cannot open shared-memory segment {name}: {exc}") from None
        self = Pool.__new__(Pool)
        try:
            total = shm.size
            if total < _HEADER + 4096:
                raise ValueError(f"{name} is not a kvshm pool ({total} bytes)")
            self._map_fd(shm.fd, total, populate)
        finally:
            shm.close_fd()
        try:
            magic, version, flags, size, block_size, pid, created, token = \
                _HEADER_FMT.unpack_from(self._header_bytes())
            if magic != _MAGIC or version != _LAYOUT_VERSION:
                raise ValueError(f"{name} is not a kvshm pool of layout {_LAYOUT_VERSION}")
            if size + _HEADER > total or block_size == 0 or size % block_size:
                raise ValueError(f"{name} has an inconsistent header")
        except BaseException:
            munmap(self._map, self._map_size)
            self._map = self._base = NULL
            raise
        self.name = name
        self._size = size
        self._block_size = block_size
        self.token = token
        self.creator_pid = pid
        self._opener_pid = getpid()
        self._created = False
        return self

    cdef _map_fd(self, int fd, long total, bint populate):
        cdef int flags = MAP_SHARED
        cdef void* p
        if populate:
            flags |= MAP_POPULATE
        with nogil:
            p = mmap(NULL, total, PROT_READ | PROT_WRITE, flags, fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, f"mmap of {total} bytes failed: {os.strerror(errno)}")
        madvise(p, total, MADV_HUGEPAGE)   # a hint; ignored unless tmpfs huge pages are on
        self._map = <char*>p
        self._base = self._map + _HEADER
        self._map_size = total

    cdef bytes _header_bytes(self):
        return (<char*>self._map)[:_HEADER_FMT.size]

    cdef _write_header(self):
        cdef bytes h = _HEADER_FMT.pack(_MAGIC, _LAYOUT_VERSION, 0, self._size,
                                        self._block_size, self.creator_pid,
                                        0, self.token)
        memcpy(self._map, <char*>h, len(h))

    # ------------------------------------------------------------ lifetime

    def close(self):
        """Unmap the segment. Idempotent.

        Raises
        ------
        BufferError
            A view from :meth:`view` is still alive (release it first), or a copy is
            running in another thread.
        """
        if self._map == NULL:
            return
        if self._exports > 0:
            raise BufferError(f"{self._exports} view(s) of pool {self.name} are still alive")
        if self._busy > 0:
            raise BufferError(f"{self._busy} copy(ies) into or out of pool {self.name} "
                              "are running in other threads")
        munmap(self._map, self._map_size)
        self._map = self._base = NULL

    def unlink(self):
        """Remove the segment name (the memory goes when every mapping is closed).

        Only the creating process may unlink; idempotent there.

        Raises
        ------
        PermissionError
            Called from a process that did not create the segment (a client, a forked child).
        """
        if not self.owner:
            raise PermissionError(
                f"only the creating process (pid {self.creator_pid}) may unlink {self.name}")
        if self._unlinked:
            return
        self._unlinked = True
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass
        self._drop_lock()

    cdef _drop_lock(self):
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        """Close; the creating process also unlinks."""
        self.close()
        if self.owner:
            self.unlink()

    def __del__(self):
        # Clean up before warning: the warning may be an error (-W error::ResourceWarning)
        # and must not leave the mapping or the segment behind.
        cdef bint leaked = self._map != NULL
        if leaked and self._exports == 0:
            munmap(self._map, self._map_size)
            self._map = self._base = NULL
        if self.owner and not self._unlinked:
            try:
                self.unlink()
            except Exception:
                pass
        if leaked:
            warnings.warn(f"Pool {self.name} was never closed", ResourceWarning, source=self)

    # ------------------------------------------------------------ properties

    @property
    def closed(self):
        """True once :meth:`close` ran."""
        return self._map == NULL

    @property
    def owner(self):
        """True in the process that created the segment (never in a forked child)."""
        return self._created and getpid() == self.creator_pid

    @property
    def size(self):
        return self._size

    @property
    def block_size(self):
        return self._block_size

    @property
    def num_blocks(self):
        return self._size // self._block_size

    @property
    def address(self):
        self._check_open()
        return <uintptr_t>self._base

    @property
    def num_views(self):
        """Number of live buffer exports from :meth:`view`."""
        return self._exports

    def __repr__(self):
        state = "closed" if self._map == NULL else "open"
        return (f"<Pool {self.name} size={self._size} block_size={self._block_size} "
                f"{state}>")

    # ------------------------------------------------------------ checks

    cdef inline int _check_open(self) except -1:
        if self._base == NULL:
            raise ValueError(f"pool {self.name} is closed")
        return 0

    cdef inline int _begin(self) except -1:
        # Check the pool is open and keep it mapped (close() refuses) until _end().
        self._check_open()
        self._busy += 1
        return 0

    cdef inline void _end(self) noexcept:
        self._busy -= 1

    cdef inline int _check_range(self, int64_t offset, int64_t size) except -1:
        if size < 0:
            raise ValueError(f"negative size {size}")
        if offset < 0 or offset > self._size or size > self._size - offset:
            raise IndexError(
                f"range [{offset}, {offset + size}) is outside the pool of {self._size} bytes")
        return 0

    # ------------------------------------------------------------ copies

    def write(self, int64_t offset, src):
        """Copy all of ``src`` into the pool at ``offset``. Returns the bytes copied.

        Raises
        ------
        IndexError
            ``[offset, offset + nbytes(src))`` is not inside the pool.
        ValueError
            The pool is closed or ``src`` is not contiguous.
        TypeError
            ``src`` is not a buffer or CPU tensor.
        """
        cdef Span s
        self._begin()
        try:
            h = _span_of(src, False, &s, "src")
            self._check_range(offset, s.size)
            with nogil:
                memcpy(self._base + offset, s.ptr, s.size)
        finally:
            self._end()
        return s.size

    def stream_write(self, int64_t offset, src):
        """:meth:`write` with non-temporal stores: the copy bypasses this CPU's caches
        (faster for a value another process reads later, larger than a few KiB; the
        write-behind put). Ordered before anything this thread does after it returns.
        Returns the bytes copied; raises as :meth:`write`.
        """
        cdef Span s
        self._begin()
        try:
            h = _span_of(src, False, &s, "src")
            self._check_range(offset, s.size)
            with nogil:
                kv_stream_copy(self._base + offset, s.ptr, s.size)
        finally:
            self._end()
        return s.size

    def read_into(self, int64_t offset, dst, int64_t size=-1):
        """Copy ``size`` bytes (default: all of ``dst``) from ``offset`` into ``dst``.

        Returns the bytes copied.

        Raises
        ------
        IndexError
            The pool range is outside the pool.
        ValueError
            ``size`` is larger than ``dst`` or negative (other than the default -1), the
            pool is closed, ``dst`` is not contiguous.
        TypeError
            ``dst`` is not a writable buffer or CPU tensor.
        """
        cdef Span d
        self._begin()
        try:
            h = _span_of(dst, True, &d, "dst")
            if size == -1:
                size = d.size
            elif size > d.size:
                raise ValueError(f"dst holds {d.size} bytes, {size} asked")
            self._check_range(offset, size)     # ValueError for any other negative size
            with nogil:
                memcpy(d.ptr, self._base + offset, size)
        finally:
            self._end()
        return size

    def view(self, int64_t offset, int64_t size, *, bint readonly=False):
        """A zero-copy memoryview of ``[offset, offset + size)``.

        The pool refuses to close while the view (or a memoryview derived from it) lives;
        call ``release()`` on it, or drop it.

        Raises
        ------
        IndexError
            The range is outside the pool.
        """
        self._check_open()
        self._check_range(offset, size)
        cdef _ViewExport e = _ViewExport.__new__(_ViewExport)
        e.pool = self
        e.offset = offset
        e.size = size
        e.readonly = readonly
        return memoryview(e)

    def scatter(self, src, offsets, sizes, src_offsets=None):
        """Copy pieces of one buffer ``src`` to many pool ranges, in one call.

        Piece i is ``sizes[i]`` bytes taken from ``src`` at ``src_offsets[i]`` (default: the
        pieces follow each other from byte 0) and written at pool ``offsets[i]``.

        Parameters
        ----------
        src : buffer or CPU tensor, contiguous
        offsets, sizes, src_offsets : sequences of int (or int64 buffers), same length

        Returns
        -------
        int
            Total bytes copied.

        Raises
        ------
        IndexError
            A pool range or a source range is out of bounds (checked for every piece before
            any byte moves).
        ValueError
            Lengths differ, a size is negative, or ``src`` is not contiguous.
        """
        cdef Span s
        self._begin()
        try:
            h = _span_of(src, False, &s, "src")
            return self._copy_pieces(s, offsets, sizes, src_offsets, True)
        finally:
            self._end()

    def gather(self, offsets, sizes, dst, dst_offsets=None):
        """Copy many pool ranges into pieces of one buffer ``dst``, in one call.

        Range i (``offsets[i]``, ``sizes[i]`` bytes) lands in ``dst`` at ``dst_offsets[i]``
        (default: one after the other from byte 0). Raises as :meth:`scatter`; ``dst``
        must be writable.
        """
        cdef Span d
        self._begin()
        try:
            h = _span_of(dst, True, &d, "dst")
            return self._copy_pieces(d, offsets, sizes, dst_offsets, False)
        finally:
            self._end()

    cdef int64_t _copy_pieces(self, Span buf, offsets, sizes, buf_offsets,
                              bint to_pool) except -1:
        cdef const int64_t[:] off = _as_int64(offsets)
        cdef const int64_t[:] sz = _as_int64(sizes)
        cdef const int64_t[:] boff
        cdef bint has_boff = buf_offsets is not None
        cdef Py_ssize_t i, n = off.shape[0]
        cdef int64_t pos = 0, total = 0, b
        if sz.shape[0] != n:
            raise ValueError(f"{n} offsets but {sz.shape[0]} sizes")
        if has_boff:
            boff = _as_int64(buf_offsets)
            if boff.shape[0] != n:
                raise ValueError(f"{n} offsets but {boff.shape[0]} buffer offsets")
        else:
            boff = off
        for i in range(n):
            self._check_range(off[i], sz[i])
            b = boff[i] if has_boff else pos
            if b < 0 or sz[i] > buf.size - b or b > buf.size:
                raise IndexError(f"piece {i} [{b}, {b + sz[i]}) is outside the buffer "
                                 f"of {buf.size} bytes")
            pos = b + sz[i]
            total += sz[i]
        pos = 0
        with nogil:
            for i in range(n):
                b = boff[i] if has_boff else pos
                if to_pool:
                    memcpy(self._base + off[i], buf.ptr + b, sz[i])
                else:
                    memcpy(buf.ptr + b, self._base + off[i], sz[i])
                pos = b + sz[i]
        return total

    def read_bytes(self, int64_t offset, int64_t size):
        """A new ``bytes`` object holding ``[offset, offset + size)`` (one copy).

        Raises IndexError when the range is outside the pool.
        """
        cdef bytes out
        cdef char* dst
        self._begin()
        try:
            self._check_range(offset, size)
            out = PyBytes_FromStringAndSize(NULL, size)
            dst = PyBytes_AS_STRING(out)
            with nogil:
                memcpy(dst, self._base + offset, size)
        finally:
            self._end()
        return out

    def read_bytes_many(self, offsets, sizes):
        """``[read_bytes(o, s) for o, s in zip(offsets, sizes)]`` in one call.

        Every range is checked before any byte moves (IndexError).
        """
        cdef const int64_t[:] off = _as_int64(offsets)
        cdef const int64_t[:] sz = _as_int64(sizes)
        cdef Py_ssize_t i, n = off.shape[0]
        cdef char** dsts
        cdef list out
        self._check_open()
        if sz.shape[0] != n:
            raise ValueError(f"{n} offsets but {sz.shape[0]} sizes")
        for i in range(n):
            self._check_range(off[i], sz[i])
        out = [PyBytes_FromStringAndSize(NULL, sz[i]) for i in range(n)]
        dsts = <char**>malloc(max(n, 1) * sizeof(char*))
        if dsts == NULL:
            raise MemoryError()
        for i in range(n):
            dsts[i] = PyBytes_AS_STRING(out[i])
        self._begin()
        try:
            with nogil:
                for i in range(n):
                    memcpy(dsts[i], self._base + off[i], sz[i])
        finally:
            self._end()
            c_free(dsts)
        return out

    def write_many(self, offsets, srcs):
        """Copy each buffer ``srcs[i]`` whole to pool ``offsets[i]``, in one call.

        Returns the total bytes copied. Every range is checked before any byte moves
        (IndexError); buffers as :meth:`write`.
        """
        self._begin()
        try:
            return self._many(offsets, srcs, None, True)
        finally:
            self._end()

    def write_values(self, offsets, PackedValues values not None):
        """Copy value ``i`` of ``values`` to pool ``offsets[i]`` for every ``offsets[i]
        >= 0`` (-1: value ``i`` is not written), in one call with the GIL released.

        ``offsets``: int64, as many as ``values``. Returns the bytes copied. Every range
        is checked before any byte moves (IndexError); ValueError when the lengths
        differ or the pool is closed.
        """
        cdef const int64_t[:] off = _as_int64(offsets)
        cdef Py_ssize_t i, n = off.shape[0], lo = values._lo
        cdef _Frames f = values._f
        # the lengths PackedValues.of checked against the frames (not the request's list,
        # which may have changed since: one source of truth for what is copied)
        cdef const Py_ssize_t* sz = f.lens + lo
        cdef int64_t total = 0
        if n != values._hi - lo:
            raise ValueError(f"{n} offsets but {values._hi - lo} values")
        self._begin()
        try:
            for i in range(n):
                if off[i] >= 0:
                    self._check_range(off[i], sz[i])
                    total += sz[i]
            with nogil:
                for i in range(n):
                    if off[i] >= 0:
                        memcpy(self._base + off[i], f.ptrs[lo + i], sz[i])
        finally:
            self._end()
        return total

    def read_groups(self, offsets, sizes, counts):
        """Pool ranges (``offsets[i]``, ``sizes[i]`` bytes) gathered into new bytes
        objects, ``counts[j]`` consecutive ranges into the j-th (a GET reply's packed
        frames), in one call with the GIL released for the copies.

        ``offsets``, ``sizes``: int64; ``counts``: ints >= 0 adding up to ``len(offsets)``.
        Every range is checked before any byte moves (IndexError); ValueError for
        lengths or counts that do not match.
        """
        cdef const int64_t[:] off = _as_int64(offsets)
        cdef const int64_t[:] sz = _as_int64(sizes)
        # the counts as checked, a private copy (as the offsets and sizes): ``counts``
        # is the caller's, which another thread may change while a group is copied
        # with the GIL released; read again, a grown count overran its bytes object
        cdef const int64_t[:] cnt = _as_int64(counts)
        cdef Py_ssize_t i, j, k, n = off.shape[0], ng = cnt.shape[0], c
        cdef int64_t acc
        cdef char* dst
        cdef list out = []
        if sz.shape[0] != n:
            raise ValueError(f"{n} offsets but {sz.shape[0]} sizes")
        self._begin()
        try:
            i = 0
            for j in range(ng):
                if cnt[j] < 0 or cnt[j] > n - i:
                    raise ValueError(f"counts add up to more than the {n} ranges")
                c = cnt[j]
                acc = 0
                for k in range(i, i + c):
                    self._check_range(off[k], sz[k])
                    acc += sz[k]
                out.append(PyBytes_FromStringAndSize(NULL, acc))
                i += c
            if i != n:
                raise ValueError(f"counts add up to {i}, not the {n} ranges")
            i = 0
            for j in range(ng):
                c = cnt[j]
                dst = PyBytes_AS_STRING(out[j])
                with nogil:
                    for k in range(i, i + c):
                        memcpy(dst, self._base + off[k], sz[k])
                        dst += sz[k]
                i += c
        finally:
            self._end()
        return out

    def read_many_into(self, offsets, dsts, sizes=None):
        """Copy pool ``offsets[i]`` into each ``dsts[i]``, in one call.

        ``sizes[i]`` bytes (default: all of ``dsts[i]``) are copied; a size larger than its
        buffer is a ValueError. Returns the total bytes copied.
        """
        self._begin()
        try:
            return self._many(offsets, dsts, sizes, False)
        finally:
            self._end()

    cdef int64_t _many(self, offsets, bufs, sizes, bint to_pool) except -1:
        cdef const int64_t[:] off = _as_int64(offsets)
        cdef const int64_t[:] sz
        cdef Py_ssize_t i, n = off.shape[0]
        cdef Span* spans
        cdef int64_t total = 0
        self._check_open()
        bufs = list(bufs)
        if len(bufs) != n:
            raise ValueError(f"{n} offsets but {len(bufs)} buffers")
        if sizes is not None:
            sz = _as_int64(sizes)
            if sz.shape[0] != n:
                raise ValueError(f"{n} offsets but {sz.shape[0]} sizes")
        spans = <Span*>malloc(max(n, 1) * sizeof(Span))
        if spans == NULL:
            raise MemoryError()
        holders = []
        try:
            for i in range(n):
                holders.append(_span_of(bufs[i], not to_pool, &spans[i],
                                        "src" if to_pool else "dst"))
                if sizes is not None:
                    if sz[i] > spans[i].size or sz[i] < 0:
                        raise ValueError(
                            f"buffer {i} holds {spans[i].size} bytes, {sz[i]} asked")
                    spans[i].size = sz[i]
                self._check_range(off[i], spans[i].size)
                total += spans[i].size
            with nogil:
                for i in range(n):
                    if to_pool:
                        memcpy(self._base + off[i], spans[i].ptr, spans[i].size)
                    else:
                        memcpy(spans[i].ptr, self._base + off[i], spans[i].size)
        finally:
            c_free(spans)
        return total


cdef object _as_int64(object seq):
    """A new int64 array of a sequence of ints or of an int64 buffer: always a private
    copy. The callers check every offset and size in it, then copy with the GIL released;
    a caller's buffer (a numpy array another thread writes) may change meanwhile, so
    what is checked must be what the copy loop reads (a copy of n int64: cheap)."""
    import array
    try:
        m = memoryview(seq)
    except TypeError:
        return array.array("q", seq)
    if m.format in ("q", "l", "<q", "=q", "<l", "=l") and m.itemsize == 8 and m.ndim == 1:
        a = array.array("q")
        a.frombytes(m.cast("B") if m.c_contiguous else m.tobytes())
        return a
    return array.array("q", m.tolist())


def _check_shm_space(long total, path="/dev/shm"):
    try:
        st = os.statvfs(path)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if total > free:
        raise OSError(28, f"a pool of {total} bytes does not fit in {path} "
                          f"({free} bytes free); free space there or ask for a smaller pool")


# ---------------------------------------------------------------- packed values


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void *op)


cdef class _Frames:
    """The frames of a :class:`PackedValues`, their buffers held, and where each value
    starts (shared by every slice of it)."""
    cdef Py_buffer* bufs
    cdef Py_ssize_t nbufs
    cdef char** ptrs            # per value: its first byte
    cdef Py_ssize_t* lens       # per value: its length, as checked against its frame
    cdef Py_ssize_t nvals
    cdef list sizes             # the same lengths as ints (a copy of the request's list)
    cdef list frames            # the frame objects (memoryview slices are made of them)
    cdef list first             # per frame: the index of its first value

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.bufs != NULL:
            for i in range(self.nbufs):
                PyBuffer_Release(&self.bufs[i])
            c_free(self.bufs)
        c_free(self.ptrs)
        c_free(self.lens)


@cython.final
cdef class PackedValues:
    """The values of a PUT packed back to back in its payload frames (the layout of
    :mod:`kvshm.zmq_ctrl.frames`), read in place: no view or bytes object per value.

    A sequence of the values: ``len()``, ``v[i]`` (a 1-d ``B`` memoryview of value ``i``,
    zero-copy) and ``v[a:b]`` (a PackedValues of values ``a:b``, sharing the frames; step
    1 only). :meth:`Pool.write_values` copies them into the pool in one C loop. The
    frames' buffers are held (exported) while any slice lives.
    """

    cdef _Frames _f
    cdef Py_ssize_t _lo
    cdef Py_ssize_t _hi

    @staticmethod
    def of(frames, counts, sizes):
        """The values of ``frames`` laid as ``counts`` (values per frame) and ``sizes``
        (bytes per value) say, or None unless the layout is plain: lists, as many
        counts as frames, each count an int >= 1, the counts adding up to ``len(sizes)``,
        sizes ints >= 0, each frame a contiguous buffer exactly the sum of its values'
        sizes (anything else: None, and the caller's general path answers it, errors
        included).

        The three lists are copied first and only the copies are checked and kept: a
        caller's list changed afterwards (or by a frame's buffer export during the
        checks) changes nothing of what :meth:`Pool.write_values`, ``sizes()`` and
        ``v[i]`` use."""
        cdef Py_ssize_t nf, ns, i, fi, c, k, pos, n, total = 0
        cdef _Frames f
        cdef PackedValues out
        cdef object cnt, s
        cdef Py_buffer* b
        cdef long long v
        cdef int ovf = 0
        if type(frames) is not list or type(counts) is not list or type(sizes) is not list:
            return None
        frames, counts, sizes = list(frames), list(counts), list(sizes)
        nf = len(frames)
        ns = len(sizes)
        if len(counts) != nf or nf == 0:
            return None
        for cnt in counts:
            # a count over ns (a hostile peer's 2**62s) could wrap total round: over-read
            if type(cnt) is not int or cnt < 1 or cnt > ns:
                return None
            total += <Py_ssize_t>cnt
        if total != ns:
            return None
        for s in sizes:
            # (C compares: no int object per size; an int past 64 bits overflows)
            if type(s) is not int:
                return None
            v = PyLong_AsLongLongAndOverflow(s, &ovf)
            if ovf or v < 0 or v > PY_SSIZE_T_MAX:
                return None
        # only ints: off the collector's lists (in no cycle), so no young collection
        # while the PUT lives walks its 100 k items (kvshm._gcutil; KVSHM_UNTRACK=0 off)
        if _UNTRACK:
            PyObject_GC_UnTrack(<void*>sizes)
        f = _Frames.__new__(_Frames)
        f.bufs = <Py_buffer*>malloc(nf * sizeof(Py_buffer))
        f.ptrs = <char**>malloc(max(ns, 1) * sizeof(char*))
        f.lens = <Py_ssize_t*>malloc(max(ns, 1) * sizeof(Py_ssize_t))
        if f.bufs == NULL or f.ptrs == NULL or f.lens == NULL:
            raise MemoryError()
        f.sizes = sizes
        f.frames = frames
        f.first = []
        i = 0
        for fi in range(nf):
            try:
                PyObject_GetBuffer(frames[fi], &f.bufs[fi], PyBUF_ANY_CONTIGUOUS)
            except (TypeError, BufferError, ValueError):
                return None
            f.nbufs = fi + 1
            b = &f.bufs[fi]
            c = counts[fi]
            f.first.append(i)
            pos = 0
            for k in range(i, i + c):
                n = <Py_ssize_t>sizes[k]
                if n > b.len - pos:         # no sum that wraps round to the frame's length
                    return None
                f.ptrs[k] = <char*>b.buf + pos
                f.lens[k] = n
                pos += n
            if pos != b.len:
                return None
            i += c
        f.nvals = ns
        out = PackedValues.__new__(PackedValues)
        out._f = f
        out._lo = 0
        out._hi = ns
        return out

    def __len__(self):
        return self._hi - self._lo

    def sizes(self):
        """Bytes of each value (a list of int)."""
        return self._f.sizes[self._lo:self._hi]

    def __getitem__(self, item):
        cdef Py_ssize_t i, a, b, step, fi
        cdef PackedValues out
        cdef _Frames f = self._f
        if isinstance(item, slice):
            a, b, step = item.indices(self._hi - self._lo)
            if step != 1:
                raise ValueError("PackedValues slices take a step of 1")
            out = PackedValues.__new__(PackedValues)
            out._f = f
            out._lo = self._lo + a
            out._hi = self._lo + max(a, b)
            return out
        i = item
        if i < 0:
            i += self._hi - self._lo
        if i < 0 or i >= self._hi - self._lo:
            raise IndexError("PackedValues index out of range")
        i += self._lo
        # the frame holding value i: the last whose first value is <= i
        fi = _bisect_right(f.first, i) - 1
        m = memoryview(f.frames[fi])
        if m.ndim != 1 or m.itemsize != 1:
            m = m.cast("B")
        a = f.ptrs[i] - <char*>f.bufs[fi].buf
        return m[a:a + f.lens[i]]


cdef Py_ssize_t _bisect_right(list xs, Py_ssize_t x):
    cdef Py_ssize_t lo = 0, hi = len(xs), mid
    while lo < hi:
        mid = (lo + hi) // 2
        if x < <Py_ssize_t>xs[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo
