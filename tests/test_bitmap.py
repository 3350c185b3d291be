"""BitmapAllocator against a pure-Python reference model (hypothesis stateful), plus unit tests."""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvshm import BitmapAllocator

# 1 block; one word less one, exactly one, one plus one; two words exactly and two and a
# bit; one summary word (64 words = 4096 blocks) plus one block, and plus one word, so
# searches cross summary words and end exactly at the end of the last word.
SIZES = [1, 63, 64, 65, 128, 130, 4097, 4160]


class Model:
    """The reference: one flag per block (1 = free, 0 = allocated); first fit by search.

    A bytearray rather than a list of bools only so that the searches run at C speed
    (``bytes.find``, a regex): hypothesis replays thousands of sequences when it shrinks one.
    """

    def __init__(self, num_blocks: int) -> None:
        self.free = bytearray(b"\x01") * num_blocks

    def __len__(self) -> int:
        return len(self.free)

    def find(self, n: int) -> int:
        return self.free.find(b"\x01" * n)

    def alloc(self, n: int) -> int:
        start = self.find(n)
        if start >= 0:
            self.set(start, n, False)
        return start

    def set(self, start: int, n: int, free: bool) -> None:
        self.free[start : start + n] = bytes([free]) * n

    def in_range(self, start: int, n: int) -> bool:
        return n >= 1 and 0 <= start and start + n <= len(self.free)

    def all_are(self, start: int, n: int, free: bool) -> bool:
        return self.free[start : start + n] == bytes([free]) * n

    @property
    def num_free(self) -> int:
        return self.free.count(1)

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every maximal run of free blocks."""
        return [(m.start(), m.end() - m.start()) for m in re.finditer(b"\x01+", self.free)]

    @property
    def largest_free_run(self) -> int:
        return max((n for _, n in self.free_runs()), default=0)

    def alloc_extents(self, n: int, max_extents: int) -> tuple[tuple[int, int], ...] | None:
        """One run by first fit; else the fewest runs: the longest free runs whole (equal
        lengths: lower start first), then the shortest run holding the rest (best fit,
        lower start first), its first blocks; in block order. None: does not fit."""
        start = self.alloc(n)
        if start >= 0:
            return ((start, n),)
        if n > self.num_free or max_extents < 2:
            return None
        runs = self.free_runs()
        longest = sorted(runs, key=lambda r: (-r[1], r[0]))[:max_extents]
        acc = k = 0
        while k < len(longest) and acc + longest[k][1] < n:
            acc += longest[k][1]
            k += 1
        if k == len(longest):
            return None
        whole = longest[:k]
        rest = n - acc
        last = min((r for r in runs if r[1] >= rest and r not in whole),
                   key=lambda r: (r[1], r[0]))
        chosen = sorted(whole + [(last[0], rest)])
        for s, c in chosen:
            self.set(s, c, False)
        return tuple(chosen)


def _prefill(a: BitmapAllocator, m: Model, layout: str, seed: int) -> None:
    """Give both the same starting layout (through alloc_at, one run at a time)."""
    n = len(m)
    rng = random.Random(seed)
    if layout == "empty":
        return
    if layout == "full":
        a.alloc_at(0, n)
        m.set(0, n, False)
        return
    if layout == "head":  # the first blocks allocated, one free run up to the end
        k = rng.randrange(n)
        if k:
            a.alloc_at(0, k)
            m.set(0, k, False)
        return
    if layout == "stripes":  # allocated/free runs of one length around the word size
        k = rng.choice([1, 3, 63, 64, 65])
        for start in range(0, n, 2 * k):
            run = min(k, n - start)
            a.alloc_at(start, run)
            m.set(start, run, False)
        return
    density = {"sparse": 0.2, "half": 0.5, "dense": 0.95}[layout]
    for i in range(n):
        if rng.random() < density:
            m.set(i, 1, False)
    for match in re.finditer(b"\x00+", m.free):  # each allocated run in one call
        a.alloc_at(match.start(), match.end() - match.start())


class BitmapMachine(RuleBasedStateMachine):
    """Random alloc / alloc_many / alloc_at / free / is_free against the model."""

    def __init__(self) -> None:
        super().__init__()
        self.a: BitmapAllocator
        self.m: Model
        self.runs: list[tuple[int, int]] = []  # runs handed out (some freed since)
        self.extents: list[tuple[tuple[int, int], ...]] = []  # alloc_extents results

    @initialize(
        num_blocks=st.sampled_from(SIZES),
        layout=st.sampled_from(["empty", "full", "head", "stripes", "sparse", "half", "dense"]),
        seed=st.integers(0, 2**32 - 1),
    )
    def setup(self, num_blocks: int, layout: str, seed: int) -> None:
        self.a = BitmapAllocator(num_blocks)
        self.m = Model(num_blocks)
        _prefill(self.a, self.m, layout, seed)

    # ------------------------------------------------------------------ draws

    def _count(self, data: st.DataObject) -> int:
        n = len(self.m)
        choices = [
            st.integers(1, 8),
            st.integers(1, min(200, n + 1)),
            st.sampled_from([63, 64, 65, 127, 128, 129, n, n + 1, n + 64]),
        ]
        lengths = sorted({k for _, k in self.m.free_runs()})
        if lengths:  # exactly the length of a free run, or one less or one more
            choices.append(
                st.tuples(st.sampled_from(lengths), st.integers(-1, 1)).map(
                    lambda t: max(1, t[0] + t[1])
                )
            )
        return data.draw(st.one_of(choices), label="count")

    def _start(self, data: st.DataObject) -> int:
        n = len(self.m)
        edges = sorted({min(x, n - 1) for x in (0, 1, 62, 63, 64, 65, 127, 128, 4095, 4096)})
        return data.draw(st.one_of(st.integers(0, n - 1), st.sampled_from(edges)), label="start")

    def _range(self, data: st.DataObject) -> tuple[int, int]:
        """A (start, n) pair: a run handed out before (maybe freed since), or any run."""
        known = bool(self.runs) and data.draw(st.booleans(), label="known run")
        if known:
            return data.draw(st.sampled_from(self.runs), label="run")
        return self._start(data), self._count(data)

    def _assert_unchanged_around(self, start: int, n: int, num_free: int) -> None:
        assert self.a.num_free == num_free
        lo, hi = max(0, start - 2), min(len(self.m), max(start, 0) + max(n, 0) + 2)
        for i in range(lo, hi):
            assert self.a.is_free(i) == self.m.free[i], i

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        n = self._count(data)
        got = self.a.alloc(n)
        assert got == self.m.alloc(n), n
        if got >= 0:
            self.runs.append((got, n))

    @precondition(lambda self: self.m.num_free > 0)
    @rule(data=st.data())
    def alloc_a_free_run(self, data: st.DataObject) -> None:
        """Ask for exactly the length of a free run (or one block less or more)."""
        _, k = data.draw(st.sampled_from(self.m.free_runs()), label="free run")
        n = max(1, k + data.draw(st.integers(-1, 1), label="delta"))
        got = self.a.alloc(n)
        assert got == self.m.alloc(n), n
        if got >= 0:
            self.runs.append((got, n))

    @rule(data=st.data())
    def alloc_many(self, data: st.DataObject) -> None:
        counts = data.draw(st.lists(st.integers(1, 130), max_size=8), label="counts")
        kind = data.draw(st.sampled_from(["list", "tuple", "int64", "int32"]), label="kind")
        arg: Any = {
            "list": counts,
            "tuple": tuple(counts),
            "int64": np.array(counts, dtype=np.int64),
            "int32": np.array(counts, dtype=np.int32),
        }[kind]
        got = self.a.alloc_many(arg)
        want = [self.m.alloc(c) for c in counts]
        assert got == want
        self.runs.extend((s, c) for s, c in zip(got, counts) if s >= 0)

    @rule(data=st.data())
    def alloc_many_bad_count(self, data: st.DataObject) -> None:
        counts = data.draw(st.lists(st.integers(1, 64), max_size=5), label="counts")
        counts.insert(data.draw(st.integers(0, len(counts))), data.draw(st.integers(-70, 0)))
        before = self.a.num_free
        with pytest.raises(ValueError):
            self.a.alloc_many(counts)
        assert self.a.num_free == before  # checked before anything was allocated

    @rule(data=st.data(), max_extents=st.sampled_from([1, 2, 3, 8, 64]))
    def alloc_extents(self, data: st.DataObject, max_extents: int) -> None:
        n = self._count(data)
        runs_before = self.m.free_runs()
        got = self.a.alloc_extents(n, max_extents)
        assert got == self.m.alloc_extents(n, max_extents), (n, max_extents)
        if got is None:
            return
        # what holds whatever the policy: n blocks, in block order, few runs, none adjacent
        assert sum(c for _, c in got) == n and 1 <= len(got) <= max_extents
        assert all(a + c < b for (a, c), (b, _) in zip(got, got[1:]))
        longest = sorted((k for _, k in runs_before), reverse=True)
        assert sum(longest[: len(got) - 1]) < n  # one run fewer could not hold it
        self.extents.append(got)

    @precondition(lambda self: self.extents)
    @rule(data=st.data())
    def free_extents(self, data: st.DataObject) -> None:
        """Free extents handed out (maybe freed, or partly reused, since): all or nothing."""
        ext = data.draw(st.sampled_from(self.extents), label="extents")
        if data.draw(st.booleans(), label="reversed"):
            ext = tuple(reversed(ext))
        num_free = self.a.num_free
        if all(self.m.all_are(s, c, False) for s, c in ext):
            self.a.free_extents(ext)
            for s, c in ext:
                self.m.set(s, c, True)
        else:
            with pytest.raises(ValueError):
                self.a.free_extents(ext)
            assert self.a.num_free == num_free
            for s, c in ext:
                self._assert_unchanged_around(s, c, num_free)

    @precondition(lambda self: self.m.num_free < len(self.m))
    @rule(data=st.data())
    def free_overlapping_extents(self, data: st.DataObject) -> None:
        """Two runs that overlap (each allocated): refused, nothing freed."""
        used = [i for i, f in enumerate(self.m.free) if not f]
        start = data.draw(st.sampled_from(used), label="start")
        num_free = self.a.num_free
        with pytest.raises(ValueError):
            self.a.free_extents(((start, 1), (start, 1)))
        self._assert_unchanged_around(start, 1, num_free)

    @rule(max_extents=st.sampled_from([-1, 0, 65, 1000]))
    def alloc_extents_bad_limit(self, max_extents: int) -> None:
        with pytest.raises(ValueError):
            self.a.alloc_extents(1, max_extents)

    @rule(n=st.integers(-65, 0))
    def alloc_bad_count(self, n: int) -> None:
        with pytest.raises(ValueError):
            self.a.alloc(n)
        with pytest.raises(ValueError):
            self.a.alloc_extents(n)

    @rule(data=st.data())
    def alloc_at(self, data: st.DataObject) -> None:
        start, n = self._range(data)
        num_free = self.a.num_free
        if self.m.in_range(start, n) and self.m.all_are(start, n, True):
            self.a.alloc_at(start, n)
            self.m.set(start, n, False)
            self.runs.append((start, n))
        else:
            with pytest.raises(ValueError):
                self.a.alloc_at(start, n)
            self._assert_unchanged_around(start, n, num_free)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # a known run is freed once (fine) or again (double free); any other run may be
        # partly free or out of range: the model says which
        start, n = self._range(data)
        num_free = self.a.num_free
        if self.m.in_range(start, n) and self.m.all_are(start, n, False):
            self.a.free(start, n)
            self.m.set(start, n, True)
        else:
            with pytest.raises(ValueError):
                self.a.free(start, n)
            self._assert_unchanged_around(start, n, num_free)

    @precondition(lambda self: self.m.num_free < len(self.m))
    @rule(data=st.data())
    def free_allocated_extent(self, data: st.DataObject) -> None:
        """Free part of an allocated extent, which may span several runs and words."""
        used = [i for i, f in enumerate(self.m.free) if not f]
        start = data.draw(st.sampled_from(used), label="start")
        end = start
        while end < len(self.m) and not self.m.free[end] and end - start < 300:
            end += 1
        n = data.draw(st.integers(1, end - start), label="n")
        self.a.free(start, n)
        self.m.set(start, n, True)

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        start, n = data.draw(st.sampled_from(self.runs), label="run")
        if not self.m.all_are(start, n, False):
            return  # the free rule covers runs that are not all allocated
        self.a.free(start, n)
        self.m.set(start, n, True)
        num_free = self.a.num_free
        with pytest.raises(ValueError):
            self.a.free(start, n)
        self._assert_unchanged_around(start, n, num_free)

    @rule(data=st.data())
    def out_of_range(self, data: st.DataObject) -> None:
        size = len(self.m)
        start, n = data.draw(
            st.one_of(
                st.tuples(st.integers(-130, -1), st.integers(1, 70)),
                st.tuples(st.integers(size, size + 130), st.integers(1, 70)),
                st.integers(1, 130).map(lambda k: (max(0, size - k + 1), k)),  # ends past
                st.tuples(st.integers(0, size - 1), st.integers(-3, 0)),
            ),
            label="range",
        )
        if self.m.in_range(start, n):
            return
        op = data.draw(st.sampled_from(["free", "alloc_at", "is_free"]), label="op")
        num_free = self.a.num_free
        with pytest.raises(ValueError):
            getattr(self.a, op)(start, n)
        self._assert_unchanged_around(start, n, num_free)

    @rule(data=st.data())
    def is_free(self, data: st.DataObject) -> None:
        start, n = self._range(data)
        if self.m.in_range(start, n):
            assert self.a.is_free(start, n) == self.m.all_are(start, n, True)
        else:
            with pytest.raises(ValueError):
                self.a.is_free(start, n)

    @rule()
    def every_block(self) -> None:
        assert bytes(self.a.is_free(i) for i in range(len(self.m))) == self.m.free

    @precondition(lambda self: len(self.m) > 64)
    @rule()
    def reset_sometimes(self) -> None:
        self.a.reset()
        self.m.set(0, len(self.m), True)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def counters_match(self) -> None:
        assert self.a.num_blocks == len(self.a) == len(self.m)
        assert self.a.num_free == self.m.num_free
        assert self.a.num_used == len(self.m) - self.m.num_free
        assert self.a.largest_free_run == self.m.largest_free_run


TestBitmapMachine = BitmapMachine.TestCase
TestBitmapMachine.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------------- unit tests


def test_model_agrees_with_itself() -> None:
    """The reference model is right on a hand-made layout (else the machine proves nothing)."""
    m = Model(10)
    m.set(0, 2, False)
    m.set(5, 1, False)
    assert m.find(3) == 2 and m.find(4) == 6 and m.find(5) == -1
    assert m.largest_free_run == 4 and m.num_free == 7
    assert m.free_runs() == [(2, 3), (6, 4)]
    assert m.all_are(0, 2, False) and m.all_are(6, 4, True) and not m.all_are(4, 2, True)


@pytest.mark.parametrize("bad", [0, -1, -64])
def test_num_blocks_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError):
        BitmapAllocator(bad)


def test_one_block() -> None:
    a = BitmapAllocator(1)
    assert (a.num_free, a.num_used, a.largest_free_run) == (1, 0, 1)
    assert a.alloc(2) == -1
    assert a.alloc(1) == 0
    assert a.alloc(1) == -1
    assert (a.num_free, a.num_used, a.largest_free_run) == (0, 1, 0)
    assert not a.is_free(0)
    with pytest.raises(ValueError):
        a.alloc(0)
    a.free(0, 1)
    with pytest.raises(ValueError):
        a.free(0, 1)  # double free
    assert a.is_free(0) and a.num_free == 1
    with pytest.raises(ValueError):
        a.free(1, 1)
    with pytest.raises(ValueError):
        a.is_free(0, 2)


@pytest.mark.parametrize("num_blocks", SIZES + [128, 4096, 4160])
def test_exact_fill(num_blocks: int) -> None:
    a = BitmapAllocator(num_blocks)
    assert a.alloc(num_blocks + 1) == -1
    assert a.alloc(num_blocks) == 0
    assert a.num_free == 0 and a.largest_free_run == 0
    assert a.alloc(1) == -1
    a.free(0, num_blocks)
    assert a.num_free == num_blocks == a.largest_free_run
    # one block at a time fills it too, in order
    assert a.alloc_many([1] * num_blocks) == list(range(num_blocks))
    assert a.alloc_many([1]) == [-1]
    a.reset()
    assert a.num_free == num_blocks and a.alloc(num_blocks) == 0


def test_word_sized_runs_fill_exactly() -> None:
    a = BitmapAllocator(130)
    assert a.alloc_many([64, 64, 2]) == [0, 64, 128]
    assert a.alloc_many([1]) == [-1]
    a.free(60, 10)  # crosses the word boundary at 64
    assert a.largest_free_run == 10
    assert a.alloc(11) == -1
    assert a.alloc(10) == 60


def test_alloc_many_partial_fit_keeps_the_others() -> None:
    a = BitmapAllocator(100)
    assert a.alloc_many([60, 50, 40]) == [0, -1, 60]
    assert a.num_free == 0


def test_alloc_many_accepts_buffers_and_iterables() -> None:
    a = BitmapAllocator(1000)
    assert a.alloc_many(np.array([3, 5], dtype=np.int64)) == [0, 3]
    assert a.alloc_many(np.array([2], dtype=np.int32)) == [8]
    assert a.alloc_many(c for c in (1, 1)) == [10, 11]
    assert a.alloc_many([]) == []
    with pytest.raises(ValueError):
        a.alloc_many(np.array([4, 0], dtype=np.int64))
    assert a.num_used == 12


SUMMARY = 64 * 64  # blocks covered by one summary word


def test_summary_skip_finds_the_last_block() -> None:
    n = 3 * SUMMARY + 5
    a = BitmapAllocator(n)
    a.alloc_at(0, n - 1)
    assert a.alloc(2) == -1
    assert a.alloc(1) == n - 1
    assert a.alloc(1) == -1 and a.num_free == 0


def test_summary_skip_runs_across_summary_words() -> None:
    n = 3 * SUMMARY + 5
    a = BitmapAllocator(n)
    a.alloc_at(0, n)
    a.free(SUMMARY - 64, 128)  # the last word of summary word 0 and the first of word 1
    a.free(2 * SUMMARY - 3, 6)  # a short run across the next summary boundary
    assert a.largest_free_run == 128
    assert a.alloc(6) == SUMMARY - 64  # first fit: the lower run
    assert a.alloc(122) == SUMMARY - 58
    assert a.alloc(7) == -1
    assert a.alloc(6) == 2 * SUMMARY - 3
    assert a.num_free == 0


def test_summary_skip_over_full_region() -> None:
    n = 1 << 20
    a = BitmapAllocator(n)
    a.alloc_at(0, n - 1000)
    assert a.alloc(1000) == n - 1000
    a.free(n - 1000, 1000)
    assert a.alloc_many([999, 1, 1]) == [n - 1000, n - 1, -1]


def test_repr_and_len() -> None:
    a = BitmapAllocator(65)
    a.alloc(5)
    assert len(a) == 65
    assert "num_blocks=65" in repr(a) and "num_free=60" in repr(a)
