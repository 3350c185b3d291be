"""One client's share of a replay: per request, ``match_prefix`` of its keys, a read of
the leading blocks found (each checked byte for byte), a write of the rest.

:class:`Replayer` reuses preallocated buffers; what it measured is a :class:`Share`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:  # numpy is imported lazily: `kvshm serve` builds the replay parser too
    import numpy as np

from kvshm.replay.workload import Workload

__all__ = ["Share", "Replayer", "Pace", "Item", "MAX_CONSECUTIVE_ERRORS", "KEEP_FIRST"]

#: Consecutive failed requests after which a replay gives up (the server is gone).
MAX_CONSECUTIVE_ERRORS = 20
#: Error and mismatch messages kept for the summary.
KEEP_FIRST = 5



class Pace(Protocol):
    """Holds a client back so K clients stay near trace order
    (:class:`kvshm.replay.clients.Pacer`)."""

    def wait(self, idx: int) -> None: ...

    def done(self, idx: int) -> None: ...


@dataclass
class Share:
    """What one client measured: per request (in its order) and totals.

    A key counts as a hit only when its bytes were read and verified: ``hits`` of a
    request is its leading run of verified keys. ``matched`` is what ``match_prefix``
    said; a key matched but gone when read (evicted in between, by another client's
    writes) is ``lost``, one whose bytes were wrong a mismatch: neither is a hit.
    """

    index: list[int] = field(default_factory=list)     # request index in the trace
    matched: list[int] = field(default_factory=list)   # leading keys match_prefix found
    hits: list[int] = field(default_factory=list)      # leading keys read and verified
    hit_bytes: list[int] = field(default_factory=list)  # value bytes of those
    blocks: list[int] = field(default_factory=list)    # keys of the request
    req_bytes: list[int] = field(default_factory=list)  # value bytes of the request
    moved: list[int] = field(default_factory=list)     # bytes read + written
    latency: list[float] = field(default_factory=list)  # s; NaN for a failed request
    t_end: list[float] = field(default_factory=list)   # time.monotonic() at the end
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    lost: int = 0          # matched, then gone when read (evicted in between)
    mismatches: int = 0
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)
    first_mismatches: list[str] = field(default_factory=list)
    gave_up: str | None = None
    paced_s: float = 0.0   # seconds spent waiting for the other clients (--window)


#: One request to replay: (index in the trace, hash ids, input_length or None).
Item = tuple[int, Sequence[int], "int | None"]


class Replayer:
    """Replays requests through one backend with reusable, preallocated buffers.

    Per request: the keys of :class:`~kvshm.replay.workload.Workload`, ``match``,
    a read of the leading keys found into buffers poisoned first (so a copy that never
    arrived is caught), a check of every word of every value read (the pattern of
    :func:`kvshm.trace.fill_blocks` depends on key and position), a write of every key
    from the first one not read and verified.
    """

    def __init__(self, backend: Any, workload: Workload, key_prefix: bytes) -> None:
        import numpy as np

        self.np = np
        self.be = backend
        self.wl = workload
        self.B = workload.entry_bytes
        self.words = self.B // 8
        self.prefix = key_prefix
        self._r, self._rv = self._grow(None, 64)
        self._w, self._wv = self._grow(None, 64)

    def _grow(self, old: "np.ndarray | None", n: int) -> tuple["np.ndarray", list[memoryview]]:
        rows = max(n, 2 * (0 if old is None else old.shape[0]))
        buf = self.np.empty((rows, self.words), dtype=self.np.uint64)
        return buf, [memoryview(buf[i]).cast("B") for i in range(rows)]

    def run(self, items: Sequence[Item],
            progress: Callable[[int], None] | None = None,
            pacer: Pace | None = None) -> Share:
        from kvshm.trace import check_blocks, fill_blocks, poison_blocks

        np = self.np
        be, B, prefix, wl = self.be, self.B, self.prefix, self.wl
        sh = Share()
        consecutive = 0
        clock, mono = time.perf_counter, time.monotonic
        for idx, ids, length in items:
            if pacer is not None:
                pacer.wait(idx)
            m = rd = hit_bytes = 0
            moved = 0
            n = 0
            req_bytes = 0
            t0 = clock()
            try:
                kints, last = wl.keys(ids, length)
                n = len(kints)
                req_bytes = wl.prefix_bytes(n, last, n)
                keys = [b"%s%d" % (prefix, h) for h in kints]
                m = be.match(keys) if n else 0
                if m:
                    if m > self._r.shape[0]:
                        self._r, self._rv = self._grow(self._r, m)
                    rows = self._r[:m]
                    ida = np.array(kints[:m], dtype=np.uint64)
                    want = np.full(m, B, dtype=np.int64)
                    if m == n:
                        want[-1] = last
                    poison_blocks(rows, ida)
                    if want[-1] != B:           # a partial last value: its own last word
                        poison_blocks(rows[-1:, :last // 8], ida[-1:])
                    sizes = np.asarray(be.read_into(keys[:m], self._rv[:m]), dtype=np.int64)
                    got = sizes >= 0
                    sh.lost += int(m - got.sum())
                    sh.blocks_read += int(got.sum())
                    nbytes = int(sizes[got].sum())
                    sh.bytes_read += nbytes
                    moved += nbytes
                    ok = sizes == want
                    if want[-1] != B:
                        ok[:-1] &= check_blocks(rows[:-1], ida[:-1])
                        ok[-1:] &= check_blocks(rows[-1:, :last // 8], ida[-1:])
                    else:
                        ok &= check_blocks(rows, ida)
                    rd = int(ok.argmin()) if not ok.all() else m
                    hit_bytes = wl.prefix_bytes(n, last, rd)
                    bad = np.flatnonzero(got & ~ok)
                    if len(bad):
                        sh.mismatches += len(bad)
                        for j in bad[:KEEP_FIRST - len(sh.first_mismatches)]:
                            sh.first_mismatches.append(
                                f"request {idx}: key {keys[j]!r} read {int(sizes[j])} bytes "
                                f"(expected {int(want[j])}) that are not its bytes")
                if rd < n:
                    k = n - rd
                    if k > self._w.shape[0]:
                        self._w, self._wv = self._grow(self._w, k)
                    fill_blocks(self._w[:k], np.array(kints[rd:], dtype=np.uint64))
                    values = self._wv[:k]
                    if last != B:
                        values = values[:-1] + [values[-1][:last]]
                    be.write(keys[rd:], values)
                    wrote = (k - 1) * B + last
                    sh.bytes_written += wrote
                    moved += wrote
            except Exception as exc:
                sh.errors += 1
                consecutive += 1
                if len(sh.first_errors) < KEEP_FIRST:
                    sh.first_errors.append(f"request {idx}: {type(exc).__name__}: {exc}")
                lat = math.nan
                rd = hit_bytes = 0     # a failed request hits nothing
                if consecutive >= MAX_CONSECUTIVE_ERRORS:
                    sh.gave_up = (f"gave up after {consecutive} failed requests in a row "
                                  f"(last: {type(exc).__name__}: {exc})")
            else:
                consecutive = 0
                lat = clock() - t0
            sh.index.append(idx)
            sh.matched.append(m)
            sh.hits.append(rd)
            sh.hit_bytes.append(hit_bytes)
            sh.blocks.append(n)
            sh.req_bytes.append(req_bytes)
            sh.moved.append(moved)
            sh.latency.append(lat)
            sh.t_end.append(mono())
            if pacer is not None:
                pacer.done(idx)
            if progress is not None:
                progress(1)
            if sh.gave_up:
                break
        return sh
