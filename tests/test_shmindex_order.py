"""The memory order of the shared index's table names (kvshm/_shmindex.pyx, read as text).

A growth or rebuild renames the tables in the header (old_base, old_nslots, base, nslots)
under the table sequence; readers re-check the sequence only before a miss, so the slots
a probe touches come from the names as loaded. The order relied on (the comment above
``IndexWriter._begin_migration``): the writer stores the names with release stores in the
order old_base, old_nslots, base, nslots, and readers load them with acquire loads in the
opposite order, so a reader that sees a name stored later sees every one stored before.

No ARM host is here: x86 gives that order for plain stores anyway (its stores are seen
in program order), so no test run here can fail on the old code's relaxed stores. This
test reads the contract from the source instead; it failed on main (b21225c), whose
migration stores were relaxed and whose reader prefault loaded base, nslots, base.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvshm

SRC = Path(kvshm.__file__).parent / "_shmindex.pyx"
NAMES = ["old_base", "old_nslots", "base", "nslots"]

pytestmark = pytest.mark.skipif(not SRC.exists(), reason="kvshm/_shmindex.pyx not shipped")


def _bodies(src: str, name: str) -> list[str]:
    """The text of each cdef/def function ``name`` (of any class; to the next def at
    its indent)."""
    out = []
    for m in re.finditer(rf"^( *)(?:cdef|def|cpdef)[^\n]*\b{name}\(", src, re.M):
        indent = len(m.group(1))
        rest = src[m.end():]
        end = re.search(rf"^ {{0,{indent}}}(?:cdef|def|cpdef|@|class|# ---) ", rest, re.M)
        out.append(rest[:end.start()] if end else rest)
    assert out, name
    return out


def _body(src: str, name: str) -> str:
    (b,) = _bodies(src, name)
    return b


def _stores(body: str) -> list[tuple[str, str]]:
    return re.findall(r"kvx_store_(rel|rlx)\(&h\.(\w+),", body)


def _loads(body: str) -> list[tuple[str, str]]:
    return [(k, f) for k, f in re.findall(r"kvx_load_(acq|rlx)\(&self\._h\.(\w+)\)", body)
            if f in NAMES]


def test_the_atomics_are_what_their_names_say():
    src = SRC.read_text()
    assert "kvx_store_rel(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE)" \
        in src
    assert "kvx_load_acq(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE)" \
        in src
    assert "kvx_fence_rel(void) { __atomic_thread_fence(__ATOMIC_RELEASE)" in src


def test_migration_names_the_tables_with_release_stores_in_order():
    src = SRC.read_text()
    begin = _stores(_body(src, "_begin_migration"))
    # the sequence made odd (then the release fence), the names, the sequence even
    assert begin[0] == ("rlx", "table_seq") and begin[-1] == ("rel", "table_seq")
    assert "kvx_fence_rel()" in _body(src, "_begin_migration")
    assert begin[1:-1] == [("rel", n) for n in NAMES]
    end = _stores(_body(src, "_end_migration"))
    assert end[0] == ("rlx", "table_seq") and end[-1] == ("rel", "table_seq")
    assert end[1:-1] == [("rel", "old_nslots"), ("rel", "old_base")]


@pytest.mark.parametrize("fn", ["_find", "_tables", "validate", "_prefault"])
def test_readers_load_the_names_with_acquire_in_the_opposite_order(fn):
    """Each name once, nslots first: a reader that loaded a name stored later than
    another loads that other one after it (sees it as new)."""
    found = [ld for ld in (_loads(b) for b in _bodies(SRC.read_text(), fn)) if ld]
    assert found, fn
    for loads in found:
        assert all(k == "acq" for k, _ in loads), loads
        order = [f for _, f in loads]
        assert len(order) == len(set(order)), f"{fn} loads a name twice: {order}"
        assert order == [n for n in reversed(NAMES) if n in order], order
        assert order[0] == "nslots", order
