"""Checks of reply fields that pair answers with the keys asked (EXISTS, PIN,
MATCH_PREFIX, GET and LOOKUP sizes, LOOKUP places): a reply whose answers would land on
other keys, or outside the pool, is refused (ProtocolError), never read.

Used by :mod:`kvshm.client`, :mod:`kvshm.aio` and :mod:`kvshm.handoff` (here so that
none of them imports another for it).
"""

from __future__ import annotations

from typing import Any

from kvshm.errors import ProtocolError


def _int_in(o: Any, lo: int, hi: int) -> bool:
    return type(o) is int and lo <= o <= hi


def _py_sizes_ok(sizes: list[Any], n: int, most: int) -> bool:
    return len(sizes) == n and all(_int_in(s, -2, most) for s in sizes)


def _py_places_ok(offsets: list[Any], sizes: list[Any], capacity: int) -> bool:
    if len(offsets) != len(sizes):
        return False
    for o, sz in zip(offsets, sizes):
        if sz < 0:
            continue
        if type(o) is int:
            if not 0 <= o <= capacity - sz:
                return False
            continue
        if type(o) not in (list, tuple) or not o:
            return False
        total = 0
        for x in o:
            if type(x) not in (list, tuple) or len(x) != 2 or \
                    not _int_in(x[0], 0, capacity) or not _int_in(x[1], 0, capacity) or \
                    x[0] > capacity - x[1]:
                return False
            total += x[1]
        if total < sz:
            return False
    return True


try:
    from kvshm._batch import all_bools as _all_bools   # one C loop of pointer compares
except ImportError:                 # not built: the same check in Python
    def _all_bools(v: list[Any]) -> bool:
        return all(x is True or x is False for x in v)
try:
    from kvshm._batch import places_ok as _places_ok, sizes_ok as _sizes_ok
except ImportError:                 # not built (or built before them): in Python
    _sizes_ok, _places_ok = _py_sizes_ok, _py_places_ok

__all__ = ["found_of", "prefix_of", "count_of", "sizes_of", "places_of", "sums_of",
           "MAX_COUNT", "MAX_SIZE"]

#: Most entries a DELETE without keys (EVICT, PURGE) may say it removed: more than any
#: pool holds (one entry takes at least one byte of it, and no pool is 2**48 bytes).
MAX_COUNT = 1 << 48
#: Largest value size a GET or LOOKUP reply may state when the pool's size is not known.
MAX_SIZE = 1 << 62


def found_of(body: Any, n: int, what: str = "EXISTS") -> list[bool]:
    """The ``found`` list of an EXISTS (or, ``what``, PIN) reply for ``n`` keys, as sent:
    ``n`` bools.

    Raises ProtocolError when it is not a list of ``n`` bools: a reply that would put
    answers on other keys (pipelined parts, a bad server), or an item that is no answer
    (None, a str, an int: truthy or not, it is not what the server sends), is never read
    as one."""
    found = body.get("found") if isinstance(body, dict) else None
    if type(found) is not list or len(found) != n:
        got = len(found) if isinstance(found, list) else type(found).__name__
        raise ProtocolError(f"{what} reply for {n} keys has found of {got}")
    if not _all_bools(found):
        bad = next(x for x in found if x is not True and x is not False)
        raise ProtocolError(f"{what} reply for {n} keys has a found item {bad!r:.40} "
                            "(True or False wanted)")
    return found  # type: ignore[no-any-return]


def prefix_of(body: Any, n: int) -> int:
    """The ``n`` of a MATCH_PREFIX reply for ``n`` keys, as sent: an int in [0, n].

    Raises ProtocolError otherwise (a count past the keys asked would be read as keys
    held that were never asked about)."""
    got = body.get("n") if isinstance(body, dict) else None
    if type(got) is not int or not 0 <= got <= n:
        raise ProtocolError(f"MATCH_PREFIX reply for {n} keys has n of {got!r:.40}")
    return got


def count_of(body: Any, what: str, most: int = MAX_COUNT) -> int:
    """The ``n`` of a DELETE / EVICT / PURGE reply (``what``): an int in [0, ``most``]
    (DELETE: the keys asked; EVICT, PURGE: :data:`MAX_COUNT`).

    Raises ProtocolError otherwise (a str, a negative or a huge count is no count of
    entries removed: never handed to the caller as one)."""
    got = body.get("n") if isinstance(body, dict) else None
    if type(got) is not int or not 0 <= got <= most:
        raise ProtocolError(f"{what} reply has n of {got!r:.40} (an int in [0, {most}] "
                            "wanted)")
    return got


def sizes_of(body: Any, n: int, what: str = "GET", most: int = 0) -> list[int]:
    """The ``sizes`` of a GET or LOOKUP reply (``what``) for ``n`` keys, as sent: a list
    of ``n`` ints, each a value's size in bytes (0 .. ``most``: the server's pool size;
    0 or less: :data:`MAX_SIZE`), -1 (a miss) or -2 (refused: over this client's limit).

    Raises ProtocolError otherwise: a list of another length would put values on other
    keys (or past the end of the caller's buffers), an item that is no size (a str, a
    float, a bool, a size past the pool, another negative) is never read as one."""
    sizes = body.get("sizes") if isinstance(body, dict) else None
    if most <= 0 or most > MAX_SIZE:
        most = MAX_SIZE
    if type(sizes) is not list or len(sizes) != n:
        got = len(sizes) if isinstance(sizes, list) else type(sizes).__name__
        raise ProtocolError(f"{what} reply for {n} keys has sizes of {got}")
    if not _sizes_ok(sizes, n, most):
        bad = next(x for x in sizes if not _int_in(x, -2, most))
        raise ProtocolError(f"{what} reply for {n} keys has a size {bad!r:.40} (an int in "
                            f"[-2, {most}] wanted)")
    return sizes


def places_of(body: Any, sizes: list[int], capacity: int) -> list[Any]:
    """The ``offsets`` of a LOOKUP reply whose ``sizes`` passed :func:`sizes_of`, as
    sent: one place per key, for each hit a byte offset (an int, the value within
    ``[0, capacity)`` of the server's pool of ``capacity`` bytes) or byte extents
    ``[[offset, length], ...]`` inside the pool adding up to its size; a miss's place
    is not read.

    Raises ProtocolError otherwise (a place past the pool would be read as other bytes
    or fail in the copy; a list of another length would pair places with other keys)."""
    offsets = body.get("offsets") if isinstance(body, dict) else None
    n = len(sizes)
    if type(offsets) is not list or len(offsets) != n:
        got = len(offsets) if isinstance(offsets, list) else type(offsets).__name__
        raise ProtocolError(f"LOOKUP reply for {n} keys has offsets of {got}")
    if not _places_ok(offsets, sizes, max(capacity, 0)):
        bad = next((o for o, s in zip(offsets, sizes)
                    if s >= 0 and not _py_places_ok([o], [s], capacity)), None)
        raise ProtocolError(f"LOOKUP reply for {n} keys has a place {bad!r:.60} that is "
                            f"not inside the pool of {capacity} bytes")
    return offsets


def sums_of(body: Any, n: int, what: str = "GET") -> list[Any] | None:
    """The ``sums`` of a GET or LOOKUP reply for ``n`` keys (verified reads): None when
    absent, else a list of ``n`` items (an int checksum, or None: stored without one).

    Raises ProtocolError otherwise (a shorter list would check values against other
    keys' checksums, or fail with an IndexError)."""
    sums = body.get("sums") if isinstance(body, dict) else None
    if sums is None:
        return None
    if type(sums) is not list or len(sums) != n:
        got = len(sums) if isinstance(sums, list) else type(sums).__name__
        raise ProtocolError(f"{what} reply for {n} keys has sums of {got}")
    for x in sums:
        if x is not None and type(x) is not int:
            raise ProtocolError(f"{what} reply for {n} keys has a checksum {x!r:.40} "
                                "(an int or None wanted)")
    return sums
