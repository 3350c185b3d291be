"""PackedValues keeps the sizes it checked: :meth:`Pool.write_values` and ``sizes()`` use
them, never the request's list again.

Failed on main (b21225c) before the fix: ``PackedValues.of`` checked the request's
``sizes`` list against the frames and kept the list itself; ``write_values`` (and
``sizes()``, which the store allocates from, and ``v[i]``) read it again, so a list
changed after the check made ``write_values`` copy past the value's frame bytes (a read
past the frame's buffer) and past the blocks allocated for it (another value's blocks).
"""

from __future__ import annotations

import pytest

from kvshm import Pool
from kvshm._pool import PackedValues
from kvshm.store import Store, StoreConfig
from kvshm.store.outcome import Outcome

BS = 4096


@pytest.fixture
def pool(shm_name):
    p = Pool.create(shm_name, 8 * BS, BS)
    yield p
    p.close()
    p.unlink()


def _mutations() -> dict[str, object]:
    def grow(s: list) -> None:
        s[0] = 3 * BS                   # past the value's frame bytes and its block

    def bad_type(s: list) -> None:
        s[1] = "2"

    def negative(s: list) -> None:
        s[0] = -1

    def shrink(s: list) -> None:
        s.clear()

    def longer(s: list) -> None:
        s.append(10 ** 6)
        s.reverse()

    return {"grow": grow, "bad_type": bad_type, "negative": negative,
            "shrink": shrink, "longer": longer}


MUT = _mutations()


@pytest.mark.parametrize("how", sorted(MUT))
def test_sizes_changed_after_the_check_change_nothing(pool, how):
    frames, counts, sizes = [b"aaabb", b"cccc"], [2, 1], [3, 2, 4]
    pv = PackedValues.of(frames, counts, sizes)
    assert pv is not None
    MUT[how](sizes)                     # the request's list, after the check
    assert pv.sizes() == [3, 2, 4] and pv[1:].sizes() == [2, 4]
    assert [bytes(pv[i]) for i in range(3)] == [b"aaa", b"bb", b"cccc"]
    assert pool.write_values([0, BS, 2 * BS], pv) == 9
    assert pool.read_bytes(0, 3 * BS + 16) == (
        b"aaa".ljust(BS, b"\0") + b"bb".ljust(BS, b"\0") + b"cccc".ljust(BS, b"\0")
        + b"\0" * 16)
    got = pv.sizes()
    got[0] = 99                         # a copy: the checked sizes stay
    assert pv.sizes() == [3, 2, 4]


def test_store_allocates_and_writes_the_checked_sizes(pool):
    store = Store(pool, StoreConfig())
    assert store.put([b"next"], [b"N" * 10]) == [Outcome.OK]
    frames, counts, sizes = [b"xyz" + b"w" * 5], [2], [3, 5]
    pv = PackedValues.of(frames, counts, sizes)
    sizes[0] = 2 * BS                   # changed between the check and the store's copy
    assert store.put([b"a", b"b"], pv) == [Outcome.OK, Outcome.OK]
    ea, eb = store.index.get(b"a"), store.index.get(b"b")
    assert (ea.size, eb.size) == (3, 5)
    assert store.pool.read_bytes(ea.start * BS, 3) == b"xyz"
    assert store.pool.read_bytes(eb.start * BS, 5) == b"wwwww"
    en = store.index.get(b"next")
    assert store.pool.read_bytes(en.start * BS, 10) == b"N" * 10
    assert store.stats(verify=True)["accounting_ok"]
