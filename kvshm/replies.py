"""Checks of reply fields that pair answers with the keys asked (EXISTS, PIN,
MATCH_PREFIX): a reply whose answers would land on other keys is refused, never read.

Used by :mod:`kvshm.client`, :mod:`kvshm.aio` and :mod:`kvshm.handoff` (here so that
none of them imports another for it).
"""

from __future__ import annotations

from typing import Any

from kvshm.errors import ProtocolError

try:
    from kvshm._batch import all_bools as _all_bools   # one C loop of pointer compares
except ImportError:                 # not built: the same check in Python
    def _all_bools(v: list[Any]) -> bool:
        return all(x is True or x is False for x in v)

__all__ = ["found_of", "prefix_of", "count_of", "MAX_COUNT"]

#: Most entries a DELETE without keys (EVICT, PURGE) may say it removed: more than any
#: pool holds (one entry takes at least one byte of it, and no pool is 2**48 bytes).
MAX_COUNT = 1 << 48


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
