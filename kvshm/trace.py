"""Request traces for ``kvshm replay``: loading, block bytes, and reference hit rates.

A trace is a JSON-lines file (optionally gzip-compressed), one request a line, each with
a ``hash_ids`` list: the prefix-block hashes of the request in order, as in the Mooncake
FAST'25 traces. kvshm ships one of them (``kvshm/data/conversation_trace.jsonl.gz``,
see ``kvshm/data/README.md``); :func:`load_trace` reads it by default.

Three things a replay needs besides the store are here, with no I/O of their own:

* keys and bytes of a block, derived from its hash id alone (:func:`block_key`,
  :func:`fill_blocks`, :func:`check_blocks`), so that every read can be checked byte for
  byte without remembering what was written;
* :func:`simulate_lru`, an exact LRU cache over the same access pattern the store sees,
  whose hit rate is what the store's eviction should reach;
* :func:`unbounded_hits`, the hit rate of a cache that never evicts: no cache can do
  better on the same requests.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.resources
import io
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import IO, Iterator, Sequence

import numpy as np

__all__ = [
    "BUNDLED_TRACE",
    "TraceError",
    "SimResult",
    "bundled_trace",
    "load_trace",
    "block_key",
    "block_words",
    "fill_blocks",
    "poison_blocks",
    "check_blocks",
    "simulate_lru",
    "unbounded_hits",
]

#: File name of the bundled trace inside the ``kvshm.data`` resources.
BUNDLED_TRACE = "conversation_trace.jsonl.gz"

Request = Sequence[int]


class TraceError(ValueError):
    """A trace file that cannot be read: names the file and the line."""


# ---------------------------------------------------------------------- loading

@contextlib.contextmanager
def bundled_trace() -> Iterator[str]:
    """Path of the bundled Mooncake conversation trace (a context manager, as
    :func:`importlib.resources.as_file`: the path is valid inside the ``with``)."""
    res = importlib.resources.files("kvshm").joinpath("data").joinpath(BUNDLED_TRACE)
    with importlib.resources.as_file(res) as path:
        if not os.path.exists(path):
            raise TraceError(f"the bundled trace {BUNDLED_TRACE} is missing from this "
                             "kvshm install (kvshm/data/); pass --trace FILE")
        yield str(path)


def _open_text(path: str) -> IO[str]:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def load_trace(path: str | None = None, limit: int | None = None) -> list[list[int]]:
    """The ``hash_ids`` of each request of a trace, in file order.

    Parameters
    ----------
    path : str, optional
        A JSON-lines file, gzip-compressed or not (detected by its first bytes); each
        non-empty line an object with ``hash_ids``, a list of ints >= 0. Default: the
        bundled trace.
    limit : int, optional
        Read only the first ``limit`` requests.

    Returns
    -------
    list of list of int
        One list of block hash ids per request (a request may have none).

    Raises
    ------
    TraceError
        The file is not a trace (the message names the file and the line).
    OSError
        The file cannot be opened.
    """
    if path is None:
        with bundled_trace() as p:
            return load_trace(p, limit)
    out: list[list[int]] = []
    if limit is not None and limit <= 0:
        return out
    try:
        f = _open_text(path)
    except IsADirectoryError:
        raise TraceError(f"{path} is a directory, not a trace file") from None
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
                ids = obj.get("hash_ids") if isinstance(obj, dict) else None
                if not isinstance(ids, list) or not all(
                        type(h) is int and h >= 0 for h in ids):
                    raise TraceError(f"{path}:{lineno}: expected an object with "
                                     "\"hash_ids\": a list of integers >= 0")
                out.append(ids)
                if limit is not None and len(out) >= limit:
                    break
        except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, OSError) as exc:
            if isinstance(exc, (FileNotFoundError, PermissionError)):
                raise
            raise TraceError(f"{path}:{lineno + 1}: cannot read ({exc})") from None
    return out


# ---------------------------------------------------------------------- block bytes

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def block_key(hash_id: int, prefix: bytes = b"kvshm-replay/") -> bytes:
    """The store key of block ``hash_id``: ``prefix`` + the id in decimal."""
    return b"%s%d" % (prefix, hash_id)


def block_words(ids: np.ndarray) -> np.ndarray:
    """The 64-bit fill word of each block id (splitmix64 of the id).

    ``ids`` is a 1-D uint64 array; returns a new uint64 array of the same shape.
    """
    z = ids.astype(np.uint64) + _GOLDEN         # array arithmetic wraps, never warns
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def fill_blocks(rows: np.ndarray, ids: np.ndarray) -> None:
    """Write the bytes of blocks ``ids`` into ``rows``.

    ``rows`` is a C-contiguous uint64 array of shape ``(len(ids), W)``, W >= 2: one block
    of ``8 * W`` bytes a row. A block holds its id in word 0 and :func:`block_words` of
    its id in every other word, so two blocks of different ids always differ, and a
    block copied to the wrong place, shifted, or left stale is caught by
    :func:`check_blocks`. Cost: one memset-speed pass.
    """
    rows[:, 1:] = block_words(ids)[:, None]
    rows[:, 0] = ids


def poison_blocks(rows: np.ndarray, ids: np.ndarray) -> None:
    """Make the first and last word of each row wrong for its block before a read, so
    that a copy which never reached them (a short or skipped copy into a reused buffer)
    fails :func:`check_blocks`."""
    rows[:, 0] = ~ids
    rows[:, -1] = ~block_words(ids)


def check_blocks(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """A bool per row: whether row i holds exactly the bytes of block ``ids[i]``."""
    if len(ids) == 0:
        return np.ones(0, dtype=bool)
    words = block_words(ids)
    ok = rows[:, 0] == ids
    ok &= (rows[:, 1:] == words[:, None]).all(axis=1)
    return ok  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- reference caches

@dataclass
class SimResult:
    """Outcome of a reference cache over a list of requests.

    Attributes
    ----------
    hits : int
        Leading blocks found, summed over requests.
    blocks : int
        Blocks asked, summed over requests.
    evictions : int
        Entries evicted (always 0 for the unbounded cache).
    per_request : list of int
        Hits of each request, in order.
    """

    hits: int
    blocks: int
    evictions: int = 0
    per_request: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """hits / blocks (0.0 for no blocks)."""
        return self.hits / self.blocks if self.blocks else 0.0


def simulate_lru(requests: Sequence[Request], capacity: int) -> SimResult:
    """An exact LRU cache of ``capacity`` blocks, fed the accesses a replay makes.

    Per request, in order: hits = the leading blocks present; those are read, each
    refreshed to most recently used in request order; every block after the first miss
    is then written in request order: refreshed if present, else inserted as most
    recently used, evicting the least recently used block while more than
    ``capacity`` are held. This is what ``kvshm replay`` asks of the store, one block
    per entry.

    Parameters
    ----------
    requests : sequence of sequence of int
        Block ids of each request.
    capacity : int
        Blocks the cache holds (>= 1).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    od: OrderedDict[int, None] = OrderedDict()
    move = od.move_to_end
    pop = od.popitem
    per: list[int] = []
    hits = blocks = evictions = 0
    size = 0
    for ids in requests:
        n = len(ids)
        blocks += n
        h = 0
        while h < n and ids[h] in od:
            move(ids[h])
            h += 1
        per.append(h)
        hits += h
        for i in range(h, n):
            b = ids[i]
            if b in od:
                move(b)
                continue
            od[b] = None
            size += 1
            if size > capacity:
                pop(last=False)
                size -= 1
                evictions += 1
    return SimResult(hits, blocks, evictions, per)


def unbounded_hits(requests: Sequence[Request]) -> SimResult:
    """The hit rate of a cache that never evicts: the bound for any cache."""
    seen: set[int] = set()
    per: list[int] = []
    hits = blocks = 0
    for ids in requests:
        n = len(ids)
        blocks += n
        h = 0
        while h < n and ids[h] in seen:
            h += 1
        per.append(h)
        hits += h
        seen.update(ids)
    return SimResult(hits, blocks, 0, per)
