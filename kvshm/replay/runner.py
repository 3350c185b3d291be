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

__all__ = ["Share", "Replayer", "Pace", "MAX_CONSECUTIVE_ERRORS", "KEEP_FIRST"]

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
    """What one client measured: per request (in its order) and totals."""

    index: list[int] = field(default_factory=list)     # request index in the trace
    matched: list[int] = field(default_factory=list)   # leading blocks match_prefix found
    blocks: list[int] = field(default_factory=list)
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


class Replayer:
    """Replays requests through one backend with reusable, preallocated buffers."""

    def __init__(self, backend: Any, block_bytes: int, key_prefix: bytes) -> None:
        import numpy as np

        self.np = np
        self.be = backend
        self.B = block_bytes
        self.words = block_bytes // 8
        self.prefix = key_prefix
        self._r, self._rv = self._grow(None, 64)
        self._w, self._wv = self._grow(None, 64)

    def _grow(self, old: "np.ndarray | None", n: int) -> tuple["np.ndarray", list[memoryview]]:
        rows = max(n, 2 * (0 if old is None else old.shape[0]))
        buf = self.np.empty((rows, self.words), dtype=self.np.uint64)
        return buf, [memoryview(buf[i]).cast("B") for i in range(rows)]

    def run(self, items: Sequence[tuple[int, Sequence[int]]],
            progress: Callable[[int], None] | None = None,
            pacer: Pace | None = None) -> Share:
        from kvshm.trace import check_blocks, fill_blocks, poison_blocks

        np = self.np
        be, B, prefix = self.be, self.B, self.prefix
        sh = Share()
        consecutive = 0
        clock, mono = time.perf_counter, time.monotonic
        for idx, ids in items:
            if pacer is not None:
                pacer.wait(idx)
            n = len(ids)
            m = rd = 0
            moved = 0
            t0 = clock()
            try:
                keys = [b"%s%d" % (prefix, h) for h in ids]
                m = be.match(keys) if n else 0
                if m:
                    if m > self._r.shape[0]:
                        self._r, self._rv = self._grow(self._r, m)
                    rows = self._r[:m]
                    ida = np.array(ids[:m], dtype=np.uint64)
                    poison_blocks(rows, ida)
                    sizes = np.asarray(be.read_into(keys[:m], self._rv[:m]), dtype=np.int64)
                    got = sizes >= 0
                    rd = int(got.argmin()) if not got.all() else m
                    sh.lost += m - rd
                    sh.blocks_read += int(got.sum())
                    nbytes = int(sizes[got].sum())
                    sh.bytes_read += nbytes
                    moved += nbytes
                    ok = check_blocks(rows, ida) & (sizes == B)
                    bad = np.flatnonzero(got & ~ok)
                    if len(bad):
                        sh.mismatches += len(bad)
                        for j in bad[:KEEP_FIRST - len(sh.first_mismatches)]:
                            sh.first_mismatches.append(
                                f"request {idx}: block {ids[j]} (key {keys[j]!r}) read "
                                f"{int(sizes[j])} bytes that are not its bytes")
                if rd < n:
                    k = n - rd
                    if k > self._w.shape[0]:
                        self._w, self._wv = self._grow(self._w, k)
                    fill_blocks(self._w[:k], np.array(ids[rd:], dtype=np.uint64))
                    be.write(keys[rd:], self._wv[:k])
                    sh.bytes_written += k * B
                    moved += k * B
            except Exception as exc:
                sh.errors += 1
                consecutive += 1
                if len(sh.first_errors) < KEEP_FIRST:
                    sh.first_errors.append(f"request {idx}: {type(exc).__name__}: {exc}")
                lat = math.nan
                if consecutive >= MAX_CONSECUTIVE_ERRORS:
                    sh.gave_up = (f"gave up after {consecutive} failed requests in a row "
                                  f"(last: {type(exc).__name__}: {exc})")
            else:
                consecutive = 0
                lat = clock() - t0
            sh.index.append(idx)
            sh.matched.append(m)
            sh.blocks.append(n)
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
