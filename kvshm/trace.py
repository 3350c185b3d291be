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
import functools
import gzip
import importlib.resources
import io
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import IO, Callable, Iterable, Iterator, Sequence

import numpy as np

__all__ = [
    "BUNDLED_TRACE",
    "TraceError",
    "SimResult",
    "bundled_trace",
    "load_trace",
    "load_requests",
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
    return load_requests(path, limit)[0]


def load_requests(path: str | None = None, limit: int | None = None
                  ) -> tuple[list[list[int]], list[int | None]]:
    """The ``hash_ids`` and the ``input_length`` (tokens; None where a line has none) of
    each request of a trace, in file order: as :func:`load_trace`, plus the lengths.

    In the Mooncake traces a request of ``input_length`` tokens has
    ``ceil(input_length / 512)`` hash ids: its last block is partial unless the length
    is a multiple of 512 (:mod:`kvshm.replay.workload` checks that where it matters).
    """
    if path is None:
        with bundled_trace() as p:
            return load_requests(p, limit)
    out: list[list[int]] = []
    lengths: list[int | None] = []
    if limit is not None and limit <= 0:
        return out, lengths
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
                n = obj.get("input_length")
                if n is not None and (type(n) is not int or n < 0):
                    raise TraceError(f"{path}:{lineno}: input_length must be an integer "
                                     f">= 0, got {n!r}")
                out.append(ids)
                lengths.append(n)
                if limit is not None and len(out) >= limit:
                    break
        except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, OSError) as exc:
            if isinstance(exc, (FileNotFoundError, PermissionError)):
                raise
            raise TraceError(f"{path}:{lineno + 1}: cannot read ({exc})") from None
    return out, lengths


# ---------------------------------------------------------------------- block bytes

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def block_key(hash_id: int, prefix: bytes = b"kvshm-replay/") -> bytes:
    """The store key of block ``hash_id``: ``prefix`` + the id in decimal."""
    return b"%s%d" % (prefix, hash_id)


def block_words(ids: np.ndarray) -> np.ndarray:
    """The 64-bit key word of each block id (splitmix64 of the id: a bijection, so two
    ids never share it).

    ``ids`` is a 1-D uint64 array; returns a new uint64 array of the same shape.
    """
    z = ids.astype(np.uint64) + _GOLDEN         # array arithmetic wraps, never warns
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=8)
def _positions(width: int) -> np.ndarray:
    """Word w of a row is XORed with ``(w + 1) * golden``: distinct for every w (the
    multiplier is odd), so every word of a block differs from every other word of it."""
    pos = (np.arange(1, width + 1, dtype=np.uint64) * _GOLDEN)
    pos.flags.writeable = False
    return pos


def fill_blocks(rows: np.ndarray, ids: np.ndarray) -> None:
    """Write the bytes of blocks ``ids`` into ``rows``.

    ``rows`` is a C-contiguous uint64 array of shape ``(len(ids), W)``: one block of
    ``8 * W`` bytes a row. Word w of block k is ``block_words(k) ^ (w + 1) * golden``:
    it depends on the key and on the position, so every 8-byte word of a block differs
    from every other word of it and from the word at the same place of any other block.
    A block copied to the wrong place, shifted, left stale, or reordered inside itself
    (two pages swapped) fails :func:`check_blocks`. A value shorter than a row is the
    first words of the row (the pattern of a position does not depend on the length).
    Cost: one pass at memory speed.
    """
    np.bitwise_xor(block_words(ids)[:, None], _positions(rows.shape[1])[None, :], out=rows)


def poison_blocks(rows: np.ndarray, ids: np.ndarray) -> None:
    """Make the first and last word of each row wrong for its block before a read, so
    that a copy which never reached them (a short or skipped copy into a reused buffer)
    fails :func:`check_blocks`."""
    if rows.shape[1] == 0 or len(ids) == 0:
        return
    pos = _positions(rows.shape[1])
    words = block_words(ids)
    rows[:, 0] = ~(words ^ pos[0])
    rows[:, -1] = ~(words ^ pos[-1])


def check_blocks(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """A bool per row: whether row i holds exactly the bytes of block ``ids[i]`` (all
    ``rows.shape[1]`` words; pass ``rows[:, :n]`` to check the first n)."""
    if len(ids) == 0:
        return np.ones(0, dtype=bool)
    words = block_words(ids)
    ok = (np.bitwise_xor(rows, _positions(rows.shape[1])[None, :])
          == words[:, None]).all(axis=1)
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


def simulate_lru(requests: Iterable[Request], capacity: int,
                 cost: Callable[[int], int] | None = None,
                 shards: Iterable[Sequence[int]] | None = None) -> SimResult:
    """An exact LRU cache of ``capacity``, fed the accesses a replay makes.

    Per request, in order: hits = the leading keys present; those are read, each
    refreshed to most recently used in request order; every key after the first miss
    is then written in request order: refreshed if present, else inserted as most
    recently used, evicting the least recently used keys while more than ``capacity``
    is held. This is what ``kvshm replay`` asks of the store.

    Parameters
    ----------
    requests : iterable of sequence of int
        Keys of each request (block ids, or the chunk keys of
        :mod:`kvshm.replay.workload`).
    capacity : int
        What the cache holds (>= 1): entries, or with ``cost`` the units it counts; with
        ``shards``, what each shard holds.
    cost : callable, optional
        What one key costs in those units (its bytes, or its blocks); default 1 each.
    shards : iterable of sequence of int, optional
        Per request, the shard (0, 1, ...) holding each of its keys: one exact LRU cache
        of ``capacity`` per shard, a request's hits still the leading keys present, each
        in its own shard (a cluster whose placement put the keys there: ``kvshm replay
        --hosts``). Default: one shard.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    ods: list[OrderedDict[int, int]] = []
    sizes: list[int] = []
    per: list[int] = []
    hits = blocks = evictions = 0
    shard_iter = iter(shards) if shards is not None else None
    one = [0]
    for ids in requests:
        n = len(ids)
        blocks += n
        where = next(shard_iter) if shard_iter is not None else one * n
        if len(where) != n:
            raise ValueError(f"a request of {n} keys has {len(where)} shards")
        while len(ods) <= max(where, default=0):
            ods.append(OrderedDict())
            sizes.append(0)
        h = 0
        while h < n and ids[h] in ods[where[h]]:
            ods[where[h]].move_to_end(ids[h])
            h += 1
        per.append(h)
        hits += h
        for i in range(h, n):
            b = ids[i]
            k = where[i]
            od = ods[k]
            if b in od:
                od.move_to_end(b)
                continue
            c = 1 if cost is None else cost(b)
            if c > capacity:
                raise ValueError(f"key {b} costs {c}, more than the capacity {capacity}")
            od[b] = c
            sizes[k] += c
            while sizes[k] > capacity:
                sizes[k] -= od.popitem(last=False)[1]
                evictions += 1
    return SimResult(hits, blocks, evictions, per)


def unbounded_hits(requests: Iterable[Request]) -> SimResult:
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
