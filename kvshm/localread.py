"""Same-host reads without a round trip (docs/DESIGN.md, "Same-host reads without a round
trip").

A client that attached the server's pool (the shm mover) also maps the server's shared
index read-only (:class:`kvshm._shmindex.IndexReader`) and answers ``exists``,
``match_prefix`` and gets by itself: look the key up, copy its blocks out of the pool,
check the slot's version did not change; a change, a closed or dead server, a key the
table does not hold or a full reads ring means the read goes to the server as before
(``FALLBACK``). The server applies the reads recorded here to its LRU before any
eviction decision, so eviction stays exact LRU.

TCP and RDMA clients keep the protocol; so does a client with lazy commits not yet sent
(its own writes must stay visible to it) and a read with ``verify=True``. A client that
writes behind (``write_behind=True``) reads its own values not yet acknowledged from
the blocks it placed them in (:class:`Placed`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence

from kvshm._shmindex import FALLBACK, MISS, IndexReader

__all__ = ["attach", "fits", "read_batch", "Placed", "FALLBACK", "MISS", "IndexReader",
           "ENV_DISABLE"]

log = logging.getLogger(__name__)

#: Set (to anything but "" or "0") to make clients ignore the shared index (benchmarks of
#: the round-trip path, debugging).
ENV_DISABLE = "KVSHM_NO_LOCAL_READS"


def attach(hello: dict[str, Any], mover: Any, epoch: int,
           max_key_bytes: int) -> IndexReader | None:
    """The reader of the server's shared index, or None (no table announced, not the shm
    mover, disabled, or the table cannot be mapped: reads then ask the server)."""
    info = hello.get("shared_index")
    if not info or mover is None or getattr(mover, "name", None) != "shm":
        return None
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return None
    try:
        return IndexReader(str(info["name"]), str(info["reads"]), mover.pool, int(epoch),
                           int(max_key_bytes))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("shared index %s not used: %s", info.get("name"), exc)
        return None


def fits(keys: Any, limits: Any) -> bool:
    """Whether ``keys`` may go to the reader as given (a list or tuple within the batch
    limit); the reader checks each key's type and length itself and falls back on any
    other, so the client's own checks then raise as before."""
    return type(keys) in (list, tuple) and len(keys) <= limits.max_batch


def read_batch(reader: IndexReader, keys: Sequence[bytes], views: Sequence[Any] | None,
               sink: Any, mover: Any) -> tuple[list[int], list[Any]] | None:
    """Read ``keys`` lock-free as ``_Session.op_lookup_copy`` would: ``(sizes, data)``
    with -1 / None for misses, or None when any key must be asked of the server (then
    nothing of this attempt counts; the server's answer overwrites what was copied).

    ``views``: writable byte views, one per key (get_into); ``sink``: places single-run
    values itself (kvshm.paged ``from_pool``); neither: new bytes per hit.
    """
    n = len(keys)
    if sink is not None:
        loc = reader.locate(keys)
        if loc is None:
            return None
        offsets, sizes, tokens = loc
        hits = [i for i in range(n) if offsets[i] >= 0]
        if hits:
            sink.from_pool(mover, [offsets[i] for i in hits], [sizes[i] for i in hits],
                           hits)
        if not reader.validate(tokens):
            return None
        return list(sizes), [None] * n
    if views is not None:
        got = reader.get_many_into(keys, views)
        if FALLBACK in got:
            return None
        data: list[Any] = [views[i][:s] if s >= 0 else None for i, s in enumerate(got)]
        return got, data
    vals = reader.get_many(keys)
    if FALLBACK in vals:
        return None
    return [len(v) if isinstance(v, bytes) else -1 for v in vals], vals


class Placed:
    """This client's own write-behind values whose PLACE the server has not answered.

    ``key -> (request id, size in bytes, byte extents [(offset, length), ...], checksum)``.
    The server pins a placed entry under its PLACE's request id until this client
    RELEASEs it (after reading the reply, :meth:`settle`), so its blocks cannot be reused
    while it is listed here: reads of these keys copy straight from them (read your own
    writes, no round trip). :attr:`lock` is held during such a copy and while a reply is
    settled, so a release is never queued while a copy of that value runs.
    """

    __slots__ = ("map", "lock")

    def __init__(self) -> None:
        self.map: dict[bytes, tuple[int, int, list[tuple[int, int]], int | None]] = {}
        self.lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.map)

    def __contains__(self, key: object) -> bool:
        return key in self.map

    def add(self, rid: int, keys: Sequence[bytes], sizes: Sequence[int],
            extents: Sequence[list[tuple[int, int]]], sums: Sequence[Any] | None) -> None:
        with self.lock:
            for i, k in enumerate(keys):
                self.map[k] = (rid, sizes[i], extents[i], None if sums is None else sums[i])

    def settle(self, rid: int, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` where they still name request ``rid`` (a later write of the
        same key stays)."""
        with self.lock:
            m = self.map
            for k in keys:
                v = m.get(k)
                if v is not None and v[0] == rid:
                    del m[k]

    def drop(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` whatever wrote them (deleted, or written again another way)."""
        with self.lock:
            for k in keys:
                self.map.pop(k, None)

    def clear(self) -> None:
        with self.lock:
            self.map.clear()

    def get(self, pool: Any, key: bytes) -> bytes | None:
        """The placed value of ``key`` (new bytes), or None when it is not listed."""
        with self.lock:
            v = self.map.get(key)
            if v is None:
                return None
            size, ext = v[1], v[2]
            if len(ext) == 1:
                return pool.read_bytes(ext[0][0], size)
            parts = []
            left = size
            for off, n in ext:
                k = min(n, left)
                parts.append(pool.read_bytes(off, k))
                left -= k
            return b"".join(parts)

    def get_into(self, pool: Any, key: bytes, view: memoryview) -> int:
        """Copy the placed value of ``key`` into ``view``; its size, or MISS when it is
        not listed. Raises ValueError when ``view`` is too small."""
        with self.lock:
            v = self.map.get(key)
            if v is None:
                return MISS
            size, ext = v[1], v[2]
            if view.nbytes < size:
                raise ValueError(f"output buffer for key {key!r} holds {view.nbytes} "
                                 f"bytes; the value is {size} bytes")
            pos = 0
            for off, n in ext:
                k = min(n, size - pos)
                if k <= 0:
                    break
                pool.read_into(off, view[pos:pos + k], k)
                pos += k
            return size
