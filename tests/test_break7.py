"""break7: today's new paths attacked (direct libzmq Frames, the C index, the sliced codec,
the lean client paths); each finding kept as a test."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

try:
    from kvshm.zmq_ctrl import _zmqc
except ImportError:     # pragma: no cover - not built
    _zmqc = None  # type: ignore[assignment]

needs_zmqc = pytest.mark.skipif(_zmqc is None, reason="kvshm.zmq_ctrl._zmqc is not built")


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any]]:
    ctx = zmq.Context()
    a = ctx.socket(zmq.PAIR)
    b = ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    a.bind("inproc://break7")
    b.connect("inproc://break7")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


@needs_zmqc
def test_frame_made_from_python_does_not_abort() -> None:
    # Frame() held a message libzmq never initialized: len(), bytes or a memoryview of it
    # tripped libzmq's assertion and aborted the whole process
    code = ("from kvshm.zmq_ctrl import _zmqc as z\n"
            "f = z.Frame()\n"
            "assert len(f) == 0 and f.bytes == b'' and bytes(memoryview(f)) == b''\n"
            "del f\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@needs_zmqc
def test_received_frame_is_read_only(pair: tuple[Any, Any]) -> None:
    # the buffer said readonly=1 but granted PyBUF_WRITABLE requests: readinto() and
    # socket.recv_into() wrote into the received libzmq message
    a, b = pair
    data = b"hello world" * 10000
    a.send(data)
    (f,) = _zmqc.recv_multipart(b, 0, 10)
    assert isinstance(f, _zmqc.Frame)
    with pytest.raises((BufferError, TypeError)):
        io.BytesIO(b"QQ").readinto(f)  # type: ignore[arg-type]
    assert f.bytes == data and memoryview(f).readonly


@pytest.fixture
def store(shm_name: str) -> Iterator[Any]:
    from kvshm._pool import Pool
    from kvshm.limits import Limits
    from kvshm.store import Store, StoreConfig

    pool = Pool.create(shm_name, 64 * 4096, 4096)
    st = Store(pool, StoreConfig(limits=Limits(max_batch=100_000)))
    yield st
    pool.close()
    pool.unlink()


def test_pins_never_wrap(store: Any) -> None:
    # Entry.pins is a C int since the index went to Cython: the C pin loops wrapped an
    # entry's 2**31-th pin to -2**31 (then to 0 at 2**32: evictable while pinned); the
    # Python int it was never wrapped. At the limit a key reads as a miss (GET, LOOKUP)
    # or the pin is refused (pin_entries), its count unchanged.
    assert store.put([b"k"], [b"v" * 100]) == [0]
    e = store.index.get(b"k")
    top = 2**31 - 1
    e.pins = top
    store._pins += top
    store._pinned_entries += 1
    try:
        entries, _ = store.pin_for_send([b"k"])
        assert entries == [None] and e.pins == top
        offsets, sizes, _ = store.lookup(b"peer", 1, [b"k"])
        assert sizes == [-1] and e.pins == top
        with pytest.raises(OverflowError):
            store.pin_entries([e])
        assert e.pins == top
        with pytest.raises(OverflowError):
            store._pin(e)               # the Python path: refused on assignment
        assert e.pins == top
    finally:
        e.pins = 0
        store._pins -= top
        store._pinned_entries -= 1
    entries, _ = store.pin_for_send([b"k"])
    assert entries == [e] and e.pins == 1
    store.unpin(entries)
    assert e.pins == 0 and store.stats()["pins"] == 0


@needs_zmqc
def test_zero_copy_send_lets_go_of_the_value_once_received(pair: tuple[Any, Any]) -> None:
    # a send whose tracker the caller drops (the client's put of a value >= 64 KiB sent
    # zero-copy) kept the value referenced until a later tracked send: a put of a big
    # value pinned the caller's buffer for good (pyzmq lets go once libzmq is done)
    a, b = pair
    v = bytes(1 << 20)
    base = sys.getrefcount(v)
    _zmqc.send_parts(a, [b"head", v], 0, 1)           # tracker dropped at once
    got = _zmqc.recv_multipart(b, 0, 1 << 30)
    assert [len(x) for x in got] == [4, 1 << 20]
    for _ in range(1000):                             # the peer answers: any receive
        a.send(b"reply")                              # lets go of what is done
        assert _zmqc.recv_multipart(b, 0) == [b"reply"]
        if sys.getrefcount(v) == base:
            break
    assert sys.getrefcount(v) == base and not _zmqc._orphans


def test_client_put_lets_go_of_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # the same through a client's put (the lean remote path): the caller's buffer is
    # no longer referenced once a later request came back
    sys.path.insert(0, os.path.dirname(__file__))
    from servers import ServerProcess

    from kvshm.client import Client

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    srv = ServerProcess(prealloc_size=1 / 32)
    try:
        with Client(srv.address, transport="tcp", timeout=30) as c:
            c.put(b"warm", b"x")
            v = os.urandom(1 << 20)
            base = sys.getrefcount(v)
            c.put(b"k", v)
            for _ in range(1000):
                if sys.getrefcount(v) == base:
                    break
                assert c.exists(b"k")
            assert sys.getrefcount(v) == base
            assert c.get(b"k") == v
    finally:
        srv.stop()


def test_held_behind_queue_is_bounded(shm_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A peer's messages behind its large header being decoded were held in Python
    # without bound: read off the socket (256 a turn) past libzmq's receive HWM, before
    # any session check, for as long as the decode lasts (a header of 100 M one-byte
    # items: ~25 k turns). Once a peer has HELD_MAX messages waiting, the rest of its
    # decode runs at once (as before the sliced codec); its requests keep their order.
    import msgpack

    from kvshm._pool import Pool
    from kvshm.limits import Limits
    from kvshm.store import Store, StoreConfig
    from kvshm.zmq_ctrl import router as router_mod
    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, decode_reply

    monkeypatch.setattr(router_mod, "HELD_MAX", 40)
    bs = 4096
    ctx = zmq.Context()
    pool = Pool.create(shm_name, 256 * bs, bs)
    store = Store(pool, StoreConfig(limits=Limits(max_batch=1_000_000)))
    loop = router_mod.ServiceLoop(store, ["tcp://127.0.0.1:0"], {"version": PROTOCOL_VERSION},
                                  7, context=ctx, slice_keys=1)
    a = ctx.socket(zmq.DEALER)
    a.setsockopt(zmq.LINGER, 0)
    a.connect(loop.endpoints[0])
    try:
        def head(op: int, rid: int, body: dict[str, Any]) -> bytes:
            return msgpack.packb([PROTOCOL_VERSION, op, rid, 7, body], use_bin_type=True)

        big = head(int(Op.EXISTS), 1, {"keys": [b"k%06d" % i for i in range(20000)]})
        assert len(big) >= router_mod.STREAM_HEADER_BYTES
        a.send_multipart([big])
        n = 400
        for i in range(n):
            a.send_multipart([head(int(Op.PUT), 2 + i, {"keys": [b"p%d" % i]}), b"v%d" % i])
        got: list[int] = []
        most = 0
        for _ in range(200_000):
            loop.turn(1)
            most = max([most, *(len(q) for q in loop._held.values())])
            while a.poll(0):
                st, rid, body = decode_reply(a.recv_multipart()[0])
                assert st == 0, body
                got.append(rid)
            if len(got) == n + 1:
                break
        assert most <= 40
        assert sorted(got) == list(range(1, n + 2))
        # the PUTs in the order sent (the EXISTS, sliced once decoded, may come last)
        assert [r for r in got if r != 1] == list(range(2, n + 2))
        assert store.index.get(b"p%d" % (n - 1)) is not None
        assert not loop._held and not loop._decodes
    finally:
        a.close(0)
        loop.close()
        ctx.term()
        pool.close()
        pool.unlink()


def test_entry_linked_twice_is_refused() -> None:
    # The index's LRU list is threaded through the entries (borrowed pointers): an entry
    # inserted under a second key (Entry.key is writable), into a second index, or made
    # again with __init__ while linked was linked twice: a self-loop (iterating the index
    # never ended, growing a list without bound) or pointers into another index's list
    # (use after free once either dropped it). The OrderedDict before took all of these.
    from kvshm._index import Entry, Index

    ix = Index()
    a = Entry(b"a", 0, 1, 1)
    b = Entry(b"b", 1, 1, 1)
    ix.insert(a)
    ix.insert(b)
    b.key = b"c"
    with pytest.raises(ValueError):
        ix.insert(b)
    other = Index()
    with pytest.raises(ValueError):
        other.insert(a)
    with pytest.raises(ValueError):
        a.__init__(b"a", 5, 1, 1)
    assert len(other) == 0 and len(ix) == 2
    assert [e.key for e in ix.lru()] == [b"a", b"c"] and a.start == 0
    b.key = b"b"
    assert ix.insert(b) is b                        # its own key again: allowed
    assert ix.remove(b"b") is b and ix.remove(b"a") is a
    other.insert(a)                                 # unlinked now: may go elsewhere
    assert ix.insert(b) is None
    assert [e.key for e in other.lru()] == [b"a"] and [e.key for e in ix.lru()] == [b"b"]
    assert [e.key for e in other.clear()] == [b"a"]
    ix.insert(a)                                    # clear() let go of it
    assert [e.key for e in ix.lru()] == [b"b", b"a"]


@needs_zmqc
@pytest.mark.parametrize("bad", ["text", None, memoryview(b"abcdef")[::2]],
                         ids=["str", "None", "strided"])
@pytest.mark.parametrize("track_from", [-1, 1])
def test_send_parts_with_a_bad_part_sends_nothing(pair: tuple[Any, Any], bad: Any,
                                                  track_from: int) -> None:
    # A part without a contiguous buffer failed after the parts before it went out with
    # SNDMORE: the socket's next message was glued onto that one (on the server's
    # ROUTER: another peer's reply delivered as extra frames of this one's). pyzmq's
    # send_multipart checks the types before sending anything.
    a, b = pair
    with pytest.raises((TypeError, BufferError)):
        _zmqc.send_parts(a, [b"first", bytes(100_000), bad], 0, track_from)
    _zmqc.send_parts(a, [b"next"])
    assert _zmqc.recv_multipart(b, 0) == [b"next"]
    assert _zmqc.sweep(5.0) == 0


def test_zero_copy_reply_survives_overwrite_and_eviction(shm_name: str) -> None:
    # (a guard, no finding) GET replies sent zero-copy from the pool to a peer that does
    # not read them yet, while the key is overwritten and the pool filled past eviction:
    # every reply read later has the bytes it had when asked (the entry stays pinned
    # until libzmq is done with the frame)
    import hashlib

    import msgpack

    from kvshm._pool import Pool
    from kvshm.limits import Limits
    from kvshm.store import Store, StoreConfig
    from kvshm.zmq_ctrl import router as router_mod
    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, decode_reply

    bs = 4096
    ctx = zmq.Context()
    pool = Pool.create(shm_name, 4096 * bs, bs)
    store = Store(pool, StoreConfig(limits=Limits(max_batch=100_000)))
    loop = router_mod.ServiceLoop(store, ["tcp://127.0.0.1:0"], {"version": PROTOCOL_VERSION},
                                  7, context=ctx)
    slow = ctx.socket(zmq.DEALER)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 4096)
    fast = ctx.socket(zmq.DEALER)
    for s in (slow, fast):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(loop.endpoints[0])
    rid = [0]

    def head(op: int, body: dict[str, Any]) -> bytes:
        rid[0] += 1
        return msgpack.packb([PROTOCOL_VERSION, op, rid[0], 7, body], use_bin_type=True)

    def call(op: int, body: dict[str, Any], frames: list[bytes]) -> int:
        fast.send_multipart([head(op, body), *frames])
        for _ in range(20000):
            loop.turn(1)
            if fast.poll(0):
                st, _, _ = decode_reply(fast.recv_multipart()[0])
                return st
        raise AssertionError("no reply")

    try:
        v1 = os.urandom(300 << 10)
        want = hashlib.sha256(v1).digest()
        assert call(int(Op.PUT), {"keys": [b"k"]}, [v1]) == 0
        for _ in range(30):
            slow.send_multipart([head(int(Op.GET), {"keys": [b"k"]})])
        for _ in range(200):
            loop.turn(1)
        assert loop._sending                        # zero-copy replies still in flight
        for i in range(60):                         # overwrite, then evict everything
            assert call(int(Op.PUT), {"keys": [b"k%d" % i if i else b"k"]},
                        [os.urandom(300 << 10)]) == 0
        assert store.counters["evictions"] > 0
        hits = 0
        for _ in range(20000):
            loop.turn(1)
            while slow.poll(0):
                m = slow.recv_multipart()
                st, _, body = decode_reply(m[0])
                if st == 0 and body["sizes"][0] >= 0 and m[1:]:
                    assert hashlib.sha256(b"".join(m[1:])).digest() == want
                    hits += 1
            if not loop._sending and not slow.poll(0) and hits:
                break
        assert hits > 0
    finally:
        slow.close(0)
        fast.close(0)
        loop.close()
        ctx.term()
        pool.close()
        pool.unlink()
