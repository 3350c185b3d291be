"""Write-behind puts that come quickly share one PLACE (issue 13.2's put figure).

While PLACEs are unanswered (``kvshm.client.PLACE_WINDOW``) or the client streams puts,
a put is held and sent with the next ones as one multi-key PLACE (the message always
carried lists: an old server takes it). The semantics stay those of
``tests/test_write_behind.py``: this client reads a held write at once, others see it
once the server has the PLACE (at most ``PLACE_HOLD_S`` later, or at this client's next
request of another kind, in order), ``flush()`` waits for all, refusals inside a held
PLACE are raised by the next call. The copy into the pool uses non-temporal stores
(``Pool.stream_write``).
"""

from __future__ import annotations

import gc
import os
import signal

import numpy as np
import pytest

import kvshm
import kvshm.client as kclient
from kvshm import Client, Pool
from kvshm.errors import WriteRefused
from kvshm.zmq_ctrl.protocol import Status
from servers import ServerProcess
from test_faults import wait_for

KiB = 1024


def _val(i: int, n: int) -> bytes:
    return bytes([i % 251]) * n


@pytest.fixture(scope="module")
def srv():
    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


@pytest.fixture
def hold_all(monkeypatch):
    """Every write-behind put is held (as when the server is far behind)."""
    monkeypatch.setattr(kclient, "PLACE_WINDOW", 0)


@pytest.fixture
def no_age_cut(monkeypatch):
    """A held PLACE is sent only by a request of its client (or the batch limits): no
    1 ms age cut, no place-flush thread. For tests that count what was gathered: with
    the age cut, how much gathers depends on how fast this loaded box runs the puts."""
    monkeypatch.setattr(kclient, "PLACE_HOLD_S", 3600.0)
    monkeypatch.setattr(kclient._PlaceFlusher, "kick", lambda self: None)


def _places(c: Client) -> tuple[int, int]:
    r = c.stats()["reservations"]
    return r["places"], r["placed_keys"]


# ---------------------------------------------------------------- the copy


def test_stream_write_copies_exactly_at_any_alignment(shm_name):
    pool = Pool.create(shm_name, 4 << 20, 65536)
    try:
        rng = np.random.default_rng(7)
        for off, n in [(0, 0), (0, 5), (3, 4095), (1, 4096), (7, 4097), (64, 70_001),
                       (13, 1 << 20), (4096, 65536), (100, 65536 + 3)]:
            src = rng.integers(0, 256, n, dtype=np.uint8)
            pool.write(off, np.zeros(n + 200, np.uint8))
            assert pool.stream_write(off + 100, src) == n
            got = np.frombuffer(pool.read_bytes(off, n + 200), np.uint8)
            assert not got[:100].any() and not got[100 + n:].any()
            assert np.array_equal(got[100:100 + n], src), (off, n)
        assert pool.stream_write(0, bytearray(b"abc")) == 3       # any buffer
        with pytest.raises(IndexError):
            pool.stream_write((4 << 20) - 2, b"abc")
        with pytest.raises(TypeError):
            pool.stream_write(0, 12)
    finally:
        pool.close()


# ---------------------------------------------------------------- gathering


def test_puts_while_the_server_is_behind_share_a_place(srv, no_age_cut):
    """With the server stopped nothing is answered: the first PLACE_WINDOW puts go one
    PLACE each, the rest are gathered (PLACE_BATCH_KEYS a PLACE); this client reads
    them all at once, others once flush() returns."""
    with Client(srv.address, write_behind=True) as c, Client(srv.address) as other:
        c.put("warm", b"w")
        c.flush()
        p0, k0 = _places(other)
        # what the reservation holds (nothing is refilled while the server is stopped)
        n = min(c.session.wb.free, kclient.PLACE_WINDOW + 3 * kclient.PLACE_BATCH_KEYS)
        assert n > kclient.PLACE_WINDOW + kclient.PLACE_BATCH_KEYS
        vals = {f"gather{i}": _val(i, 3000 + i) for i in range(n)}
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            for k, v in vals.items():
                c.put(k, v)
            wb = c.session.wb
            assert sum(map(len, wb.outstanding.values())) == n    # none answered
            assert len(wb.outstanding) < n                        # fewer PLACEs
            assert c.get("gather0") == vals["gather0"]
            assert c.get(f"gather{n - 1}") == vals[f"gather{n - 1}"]
            assert c.exists_batch(list(vals)) == [True] * n
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        c.flush()
        assert not c.session.wb.outstanding and not c.session.wb.placed
        p1, k1 = _places(other)
        assert k1 - k0 == n
        per = min(kclient.PLACE_BATCH_KEYS, c.session.wb.batch_blocks)   # 1 block a value
        w = kclient.PLACE_WINDOW
        assert p1 - p0 <= w + -(-(n - w) // per) + 1, (p1 - p0, n, per)
        assert other.get_batch(list(vals)) == list(vals.values())
        c.delete(list(vals) + ["warm"])
        s = other.stats(verify=True)
        assert s["accounting_ok"] and s["reservations"]["accounting_ok"], s


def test_a_stream_of_puts_is_sent_in_few_places(srv):
    """Puts in a tight loop (each within PLACE_HOLD_S of the one before) are gathered
    even when the server keeps up: far fewer PLACEs than puts."""
    with Client(srv.address, write_behind=True) as c, Client(srv.address) as other:
        c.put("warm", b"w")
        c.flush()
        p0, k0 = _places(other)
        n = 600
        src = np.frombuffer(_val(3, 4 * KiB), np.uint8)
        for i in range(n):
            c.put(f"stream{i}", src)
        c.flush()
        p1, k1 = _places(other)
        # (a put that finds the reservation dry and its refill late takes ALLOC/COMMIT)
        assert k1 - k0 >= n // 2
        assert p1 - p0 <= (k1 - k0) // 2, (p1 - p0, k1 - k0)
        assert other.get_batch([f"stream{i}" for i in range(n)]) == [src.tobytes()] * n
        c.delete([f"stream{i}" for i in range(n)] + ["warm"])


def test_a_held_place_is_sent_without_another_call(srv, hold_all, monkeypatch):
    """A held PLACE reaches the server within PLACE_HOLD_S even when this client makes
    no other call (its place-flush thread; the idle flush is pushed out of the way)."""
    monkeypatch.setattr(kclient, "IDLE_FLUSH_S", 60.0)
    with Client(srv.address, write_behind=True) as c, Client(srv.address) as other:
        c.put("warm", b"w")
        c.flush()
        c.put("lonely", b"L" * 5000)
        assert c.session.wb.held_rid, "held"
        wait_for(lambda: other.exists("lonely"), timeout=10,
                 what="the held PLACE to be sent by the place-flush thread")
        assert other.get("lonely") == b"L" * 5000
        c.flush()
        c.delete(["lonely", "warm"])
        flusher = c._flusher
        assert flusher is not None and flusher.thread.is_alive()
    assert not flusher.thread.is_alive(), "close() ends the place-flush thread"


def test_place_flush_thread_ends_with_a_forgotten_client(srv, hold_all):
    c = Client(srv.address, write_behind=True)
    c.put("forgotten", b"f" * 100)
    c.flush()
    c.put("forgotten2", b"f" * 100)
    t = c._flusher.thread
    del c                               # (its idle-flush timer may hold it a moment)
    wait_for(lambda: gc.collect() >= 0 and not t.is_alive(), timeout=10,
             what="the place-flush thread of a collected client to end")
    with Client(srv.address) as other:
        other.delete(["forgotten", "forgotten2"])


# ---------------------------------------------------------------- semantics


def test_held_writes_keep_their_order_with_other_requests(srv, hold_all, no_age_cut):
    """A held PLACE goes before this client's next request of another kind: a put of
    the same key by another path, a delete, and a second put of the same key held in
    the same PLACE all end as they were called. (The PLACE is held until a request
    sends it: no 1 ms age limit, no place-flush thread; with them the test's look at
    ``held_keys`` depended on how fast this loaded box ran the two puts.)"""
    with Client(srv.address, write_behind=True) as c, Client(srv.address) as other:
        c.put("warm", b"w")
        c.flush()
        wb = c.session.wb
        c.put("order", b"1" * 9000)                  # held
        assert wb.held_rid
        big = _val(5, wb.want * wb.bs)               # ALLOC/COMMIT: after the PLACE
        c.put("order", big)
        assert other.get("order") == big and c.get("order") == big
        c.put("sum", b"1" * 9000)                    # held
        c.put("sum", b"2" * 7000, checksum=True)     # the generator's PLACE: after it
        c.put("dup", b"a" * 6000)
        c.put("dup", b"b" * 5000)                    # the same key twice in one PLACE
        assert c.session.wb.held_keys.count(b"dup") == 2
        assert c.get("dup") == b"b" * 5000
        c.put("gone", b"g" * 100)
        c.delete("gone")                             # the PLACE goes first
        with pytest.raises(kvshm.KeyNotFound):
            c.get("gone")
        c.flush()
        assert other.get("order") == big
        assert other.get("sum", verify=True) == b"2" * 7000
        assert other.get("dup") == b"b" * 5000
        assert not other.exists("gone")
        c.delete(["order", "sum", "dup", "warm"])
        s = other.stats(verify=True)
        assert s["accounting_ok"] and s["reservations"]["accounting_ok"], s


def test_refusals_inside_a_held_place_are_raised_by_the_next_call():
    """The pins a PLACE takes count against the pin quota: the keys of a held PLACE
    past it are refused one by one, raised by the next call, and not stored; the
    others are."""
    with ServerProcess("--max-client-pinned", "768KiB", prealloc_size=1 / 16) as s, \
            Client(s.address, write_behind=True) as c, Client(s.address) as other:
        c.put("warm", b"w")
        c.flush()
        n = 20                                      # 64 KiB blocks: 12 may be pinned
        os.kill(s.pid, signal.SIGSTOP)              # no reply, so no RELEASE meanwhile
        try:
            for i in range(n):
                c.put(f"q{i}", _val(i, 1000))
        finally:
            os.kill(s.pid, signal.SIGCONT)
        with pytest.raises(WriteRefused) as ei:
            c.flush()
        failed = ei.value.failed
        assert failed and set(failed.values()) == {Status.QUOTA_EXCEEDED}, failed
        keys = [f"q{i}".encode() for i in range(n)]
        assert set(failed) <= set(keys)
        got = other.get_batch(keys)
        for k, v in zip(keys, got):
            assert (v is None) == (k in failed), k
        assert c.get_batch(keys) == got             # no stale own reads either
        c.flush()                                   # reported once
        other.delete(keys + [b"warm"])
        st_ = other.stats(verify=True)
        assert st_["accounting_ok"] and st_["reservations"]["accounting_ok"], st_
