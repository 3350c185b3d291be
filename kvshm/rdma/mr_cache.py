"""Registering caller buffers once: a cache of memory regions by address range.

An RDMA WRITE reads, and a READ writes, the caller's own buffer (no copy), so the buffer
must lie in a memory region registered with the client's protection domain. Registering
costs a system call and pins pages, so :class:`MrCache` registers each buffer once and
reuses the region for every later transfer that falls inside it.

What is registered: the whole allocation the buffer belongs to (the root numpy array of a
view or slice, the storage of a torch tensor, the bytes/bytearray object), so every page,
layer or chunk sliced from one large KV-cache buffer shares one region. An allocation
larger than ``whole_max`` bytes is registered piecewise, one region per range asked for.

Why it is safe: a registered region pins the *physical* pages that were mapped at
registration. If the caller freed the buffer and something else were allocated at the same
address, an address-keyed cache would hand out a region whose pages are no longer the
caller's memory, and transfers would silently go to the old pages. So every entry holds a
reference to the object that owns the memory (it cannot be freed, and its address cannot be
reused, while the entry lives), and a hit re-checks that the owner's memory is still where
it was registered (a resized bytearray or torch storage moves). The price is that cached
buffers stay alive until evicted: the cache is bounded by ``max_bytes`` (by default what
RLIMIT_MEMLOCK still allows), least recently used first, and :meth:`MrCache.close`
deregisters everything.
"""

from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvshm.rdma import constants as C
from kvshm.rdma.errors import RdmaError

if TYPE_CHECKING:
    from kvshm.rdma.verbs import MemoryRegion, ProtectionDomain

__all__ = ["MrCache", "buffer_address", "owner_range"]

log = logging.getLogger(__name__)


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a contiguous buffer (read-only ones too)."""
    if not view.readonly and view.nbytes:   # ctypes is ten times quicker than numpy
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(view))
        except (TypeError, ValueError):
            pass
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def _storage_range(t: Any) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
        return int(st.data_ptr()), int(st.nbytes())
    except Exception:
        return None


def owner_range(view: memoryview) -> tuple[Any, int, int, bool]:
    """``(owner, start, length, stable)`` of the allocation ``view`` lies in.

    ``owner`` is the object keeping that memory alive; ``stable`` says its address cannot
    change while it is referenced (numpy arrays, bytes); a resizable owner (bytearray,
    torch storage, anything else) is re-checked on every cache hit.
    """
    obj: Any = view.obj
    if isinstance(obj, np.ndarray):
        root: Any = obj
        while isinstance(root.base, np.ndarray):
            root = root.base
        base = root.base
        if base is not None and hasattr(base, "untyped_storage"):   # torch .numpy()
            r = _storage_range(base)
            if r is not None:
                return base, r[0], r[1], False
        if root.flags.c_contiguous or root.flags.f_contiguous:
            return root, int(root.__array_interface__["data"][0]), int(root.nbytes), True
        return root, buffer_address(view), view.nbytes, True
    if isinstance(obj, bytes):
        return obj, buffer_address(memoryview(obj)), len(obj), True
    if obj is not None and hasattr(obj, "untyped_storage"):
        r = _storage_range(obj)
        if r is not None:
            return obj, r[0], r[1], False
    if obj is not None:
        r = _current_range(obj)
        if r is not None:
            return obj, r[0], r[1], False
    return obj if obj is not None else view, buffer_address(view), view.nbytes, False


@dataclass
class _Entry:
    owner: Any
    start: int
    length: int
    stable: bool
    mr: "MemoryRegion"
    access: int = 0
    batch: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def still_valid(self) -> bool:
        """Whether the owner's memory still covers the registered range."""
        if self.stable:
            return True
        r = _current_range(self.owner)
        return r is not None and r[0] <= self.start and self.end <= r[0] + r[1]


def _current_range(owner: Any) -> tuple[int, int] | None:
    if hasattr(owner, "untyped_storage"):
        return _storage_range(owner)
    try:
        m = memoryview(owner)
        if m.ndim != 1 or m.format != "B":
            m = m.cast("B")
        return buffer_address(m), m.nbytes
    except (TypeError, ValueError, BufferError):
        return None


class MrCache:
    """Memory regions over caller buffers, registered once and reused.

    Parameters
    ----------
    pd : ProtectionDomain
    access : int
        Access flags of regions over writable buffers (``LOCAL_WRITE``: RDMA READ writes
        into them). A read-only buffer (an RDMA WRITE source only: bytes, a read-only
        mapping) is registered without ``LOCAL_WRITE``, which the kernel would refuse
        for read-only pages; a writable view of the same memory later gets its own.
    max_bytes : int or None
        Bound on registered bytes (None: no bound). Regions used by the batch in progress
        are never evicted, so one batch may pass it.
    whole_max : int
        Allocations up to this size are registered whole; larger ones by range.

    Thread safety: the caller serializes (the RDMA mover holds its lock).
    """

    def __init__(self, pd: "ProtectionDomain", *, access: int, max_bytes: int | None = None,
                 whole_max: int = 4 << 30) -> None:
        self.pd = pd
        self.access = access
        self.max_bytes = max_bytes
        self.whole_max = whole_max
        self._by_owner: dict[int, list[_Entry]] = {}
        # id(exporting object) -> (that object, its entry): skips owner_range() when a
        # caller passes views of the same objects again (bounded; holds the objects)
        self._recent: dict[int, tuple[Any, _Entry]] = {}
        self._lru: "OrderedDict[int, _Entry]" = OrderedDict()
        self._batch = 1
        self.bytes = 0
        self.registrations = 0
        self.hits = 0
        self._closed = False

    def __len__(self) -> int:
        return len(self._lru)

    def next_batch(self) -> None:
        """Start a new batch: regions used from now on are kept until the next one."""
        self._batch += 1

    def lookup(self, view: memoryview) -> tuple[int, int]:
        """``(address, lkey)`` of ``view``'s bytes, registering its allocation if needed.

        Raises
        ------
        RdmaError
            Registration failed (memlock limit, bad address).
        """
        if self._closed:
            raise RdmaError("the memory-region cache is closed")
        addr = buffer_address(view)
        n = view.nbytes
        obj = view.obj
        access = self.access & ~C.ACCESS_LOCAL_WRITE if view.readonly else self.access
        rec = self._recent.get(id(obj))
        if rec is not None and rec[0] is obj:
            e = rec[1]
            if (id(e) in self._lru and e.start <= addr and addr + n <= e.end
                    and e.access & access == access and e.still_valid()):
                return self._hit(e, addr)
        owner, start, length, stable = owner_range(view)
        for e in self._by_owner.get(id(owner), ()):
            if e.owner is owner and e.start <= addr and addr + n <= e.end:
                if e.still_valid() and e.access & access == access:
                    self._remember(obj, e)
                    return self._hit(e, addr)
                if not e.still_valid():
                    self._drop(e)
                    break
        for e in list(self._lru.values()):   # memory shared by another owner object
            if (e.start <= addr and addr + n <= e.end and e.access & access == access
                    and e.still_valid()):
                self._remember(obj, e)
                return self._hit(e, addr)
        if not start <= addr or addr + n > start + length or length > max(self.whole_max, n):
            start, length = addr, n
        e = self._register(owner, start, length, stable, access)
        self._remember(obj, e)
        return addr, e.mr.lkey

    def _remember(self, obj: Any, e: _Entry) -> None:
        if obj is None:
            return
        if len(self._recent) >= 4096:
            self._recent.clear()
        self._recent[id(obj)] = (obj, e)

    def _hit(self, e: _Entry, addr: int) -> tuple[int, int]:
        self.hits += 1
        e.batch = self._batch
        self._lru.move_to_end(id(e))
        return addr, e.mr.lkey

    def _register(self, owner: Any, start: int, length: int, stable: bool,
                  access: int) -> _Entry:
        self._evict(length)
        mr = self.pd.reg_mr(start, max(length, 1), access)
        e = _Entry(owner, start, length, stable, mr, access, self._batch)
        self._by_owner.setdefault(id(owner), []).append(e)
        self._lru[id(e)] = e
        self.bytes += length
        self.registrations += 1
        log.debug("registered %d bytes at 0x%x (lkey 0x%x)", length, start, mr.lkey)
        return e

    def _evict(self, need: int) -> None:
        if self.max_bytes is None:
            return
        for e in list(self._lru.values()):
            if self.bytes + need <= self.max_bytes:
                return
            if e.batch != self._batch:
                self._drop(e)

    def _drop(self, e: _Entry) -> None:
        self._lru.pop(id(e), None)
        lst = self._by_owner.get(id(e.owner))
        if lst is not None:
            try:
                lst.remove(e)
            except ValueError:
                pass
            if not lst:
                del self._by_owner[id(e.owner)]
        self.bytes -= e.length
        try:
            e.mr.close()
        except Exception as exc:   # a deregistration failure leaks the pin, nothing else
            log.warning("deregistering a memory region failed: %s", exc)

    def forget(self, owner: Any) -> None:
        """Deregister the regions over ``owner`` (a buffer the caller is done with)."""
        for e in list(self._by_owner.get(id(owner), ())):
            if e.owner is owner:
                self._drop(e)
        self._recent = {k: v for k, v in self._recent.items() if id(v[1]) in self._lru}

    def close(self) -> None:
        """Deregister every region and drop the references. Idempotent."""
        for e in list(self._lru.values()):
            self._drop(e)
        self._recent.clear()
        self._closed = True
