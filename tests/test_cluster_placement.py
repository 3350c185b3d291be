"""Placement core (kvshm/cluster/_hrw.pyx): the bucket table, its exactness against the
definition, its determinism across processes, shares, and joins at bucket level."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from kvshm.cluster import _hrw
from kvshm.cluster.placement import Placement

from test_cluster import keys_of, members

M64 = (1 << 64) - 1
C1, C2, C3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * C2) & M64
    z = ((z ^ (z >> 27)) * C3) & M64
    return z ^ (z >> 31)


def reference(bucket: int, seeds: list[int], weights: list[float], r: int) -> list[int]:
    """The definition, in Python: every node scored exactly, sorted by (q, t, -index)."""
    g = _mix((((bucket + 1) * C1) & M64) + C2 & M64)
    rows = []
    for j, (s, w) in enumerate(zip(seeds, weights)):
        z = ((g ^ s) * C3) & M64
        z ^= z >> 29
        t = ((((~z) & M64) >> 12) * 2 + 1) / 2.0 ** 53
        rows.append((_hrw.neg_ln1m(t) * (1.0 / w), t, -j))
    rows.sort()
    return [-row[2] for row in rows[:r]]


def seeds_of(m: int) -> list[int]:
    return [_hrw.hash_key(f"node-{j}".encode()) for j in range(m)]


CASES = [("one node", [1.0]), ("two, 100x apart", [1.0, 100.0]), ("equal", [1.0] * 7),
         ("4 sizes", [1.0 + j % 4 for j in range(32)]), ("all different", [1.0 + j for j in range(20)]),
         ("pool bytes", [float(3 << 30), float(1 << 30), float(64 << 30)])]


@pytest.mark.parametrize("name,weights", CASES, ids=[c[0] for c in CASES])
def test_rows_are_the_exact_order_of_the_definition(name: str, weights: list[float]) -> None:
    seeds = seeds_of(len(weights))
    ring = _hrw.Ring(seeds, weights)
    rng = np.random.default_rng(len(weights))
    r = min(4, len(weights))
    for b in rng.integers(0, 1 << _hrw.BUCKET_BITS, 400).tolist():
        assert list(ring.bucket_owners(b, r)) == reference(b, seeds, weights, r), b


def test_the_table_holds_the_computed_rows_for_every_bucket() -> None:
    weights = [1.0, 2.0, 2.0, 4.0, 1.0]
    ring = _hrw.Ring(seeds_of(5), weights)
    direct = _hrw.Ring(seeds_of(5), weights)
    keys = keys_of(_hrw.DIRECT_BELOW - 1, seed=7)
    want = direct.owners(keys, 1, 2)             # fewer keys than DIRECT_BELOW: computed
    assert not direct.built
    ring.build()
    assert ring.built
    assert (ring.owners(keys, 1, 2) == want).all()
    # and more owners than the table holds: computed again, same first columns
    assert (ring.owners(keys, 1, 4)[:, :2] == want).all()
    assert (ring.owners(keys, 1, 4) == direct.owners(keys, 1, 4)).all()


def test_owners_are_the_same_in_another_process() -> None:
    """A deterministic function of key and member list: another interpreter (another
    hash seed, another address layout) computes the same owners."""
    v = members(6, sizes=[1 << 30, 2 << 30, 2 << 30, 3 << 30, 5 << 30, 8 << 30])
    keys = keys_of(5000, seed=11)
    here = Placement(v).owners(keys, 4, 2).tolist()
    code = (
        "import json, sys\n"
        "import numpy as np\n"
        "from kvshm.cluster.placement import Placement\n"
        "from kvshm.cluster.view import View\n"
        "d = json.loads(sys.stdin.read())\n"
        "keys = [bytes.fromhex(k) for k in d['keys']]\n"
        "print(json.dumps(Placement(View.from_dict(d['view'])).owners(keys, 4, 2).tolist()))\n")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(
        {"view": v.to_dict(), "keys": [k.hex() for k in keys]}), capture_output=True,
        text=True, env=env, timeout=120, check=True)
    assert json.loads(out.stdout) == here


def chi2(counts: np.ndarray, expected: np.ndarray) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_bucket_shares_follow_the_weights_and_keys_follow_the_buckets() -> None:
    weights = [1.0, 2.0, 3.0, 4.0, 6.0]
    ring = _hrw.Ring(seeds_of(5), weights)
    ring.build()
    nb = 1 << _hrw.BUCKET_BITS
    # every bucket's first owner: a multinomial draw with p = w / sum(w)
    first = np.array([ring.bucket_owners(b, 1)[0] for b in range(0, nb, 8)])
    counts = np.bincount(first, minlength=5)
    expected = np.array(weights) / sum(weights) * len(first)
    assert chi2(counts, expected) < 18.47, counts          # 4 dof, p = 0.001
    # keys spread over buckets uniformly: given the table, key counts follow its shares
    keys = keys_of(60_000, seed=12)
    own = ring.owners(keys, 1, 1)[:, 0]
    b_of = np.array([_hrw.bucket_of(k) for k in keys])
    rows = np.array([ring.bucket_owners(int(b), 1)[0] for b in np.unique(b_of)])
    assert (own == rows[np.searchsorted(np.unique(b_of), b_of)]).all()
    all_first = np.array([ring.bucket_owners(b, 1)[0] for b in range(nb)])
    share = np.bincount(all_first, minlength=5) / nb
    kc = np.bincount(own, minlength=5)
    assert chi2(kc, share * len(keys)) < 18.47, (kc, share)


def test_a_join_moves_buckets_only_to_the_new_node_and_previous_owner_is_second() -> None:
    w = [1.0, 2.0, 1.0, 3.0]
    old = _hrw.Ring(seeds_of(4), w)
    seeds5 = seeds_of(4) + [_hrw.hash_key(b"newcomer")]
    new = _hrw.Ring(seeds5, w + [2.0])
    old.build()
    new.build()
    probe = [i.to_bytes(8, "little") for i in range(40_000)]
    o_old = old.owners(probe, 1, 1)[:, 0]
    o_new = new.owners(probe, 1, 2)
    moved = o_new[:, 0] != o_old
    assert (o_new[moved, 0] == 4).all()                  # only to the new node
    assert (o_new[moved, 1] == o_old[moved]).all()       # from exactly its second choice
    assert 0.15 < moved.mean() < 0.35                    # its share: 2/9


def test_neg_ln1m_is_accurate_and_checks_its_domain() -> None:
    for t in (1e-15, 1e-9, 1e-4, 0.01, 0.1, 0.2499999, 0.25, 0.3, 0.5, 0.7, 0.9, 0.999,
              1 - 2 ** -40):
        want = -math.log1p(-t)
        assert abs(_hrw.neg_ln1m(t) - want) <= 4e-16 * want, t
    for bad in (0.0, 1.0, -0.5, 2.0):
        with pytest.raises(ValueError):
            _hrw.neg_ln1m(bad)


def test_ring_refuses_bad_member_lists() -> None:
    with pytest.raises(ValueError):
        _hrw.Ring([1, 2], [1.0])
    with pytest.raises(ValueError):
        _hrw.Ring([1, 2], [1.0, 0.0])
    with pytest.raises(ValueError):
        _hrw.Ring([1], [math.inf])
    with pytest.raises(ValueError):
        _hrw.Ring([1], [1.0]).owners([b"a"], 1, 9)
    with pytest.raises(TypeError):
        _hrw.Ring([1], [1.0]).owners(["a"])  # type: ignore[list-item]
    assert _hrw.Ring([], []).owners([b"a"], 1, 2).tolist() == [[-1, -1]]
    assert _hrw.Ring([5], [1.0]).owners([b"a"], 1, 2).tolist() == [[0, -1]]
