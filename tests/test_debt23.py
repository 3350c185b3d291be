"""debt23: correctness debts earlier reviews noticed and left (found items unchecked,
removal counts unchecked, a failed send unanswered, a timed-out HELLO's lazy COMMITs,
an ALLOC reply short of offsets, a GET reply placed before its layout is checked, a vLLM
layout key that is not injective, the two frame-layout walks)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvshm.errors import ProtocolError
from kvshm.zmq_ctrl.protocol import Op


@pytest.fixture(scope="module")
def server():
    from servers import ServerProcess
    srv = ServerProcess(prealloc_size=1 / 16)
    yield srv
    srv.stop()


def _patch_sync(monkeypatch: pytest.MonkeyPatch, op: int, body: dict[str, Any]) -> None:
    """Every reply to ``op`` a Client reads (request, request_many, call1) gets ``body``."""
    import kvshm.zmq_ctrl.channel as chmod

    req, many, call1 = chmod.Channel.request, chmod.Channel.request_many, chmod.Channel.call1

    def request(self, o, *a, **k):
        r = req(self, o, *a, **k)
        return (r[0], r[1], dict(body), r[3]) if o == op else r

    def request_many(self, reqs, *a, **k):
        got = many(self, reqs, *a, **k)
        return [(g[0], g[1], dict(body), g[3]) if q[0] == op else g
                for q, g in zip(reqs, got)]

    def fake_call1(self, kind, o, *a, **k):
        r = call1(self, kind, o, *a, **k)
        return (0, dict(body), []) if o == op else r

    monkeypatch.setattr(chmod.Channel, "request", request)
    monkeypatch.setattr(chmod.Channel, "request_many", request_many)
    monkeypatch.setattr(chmod.Channel, "call1", fake_call1)


def _patch_async(monkeypatch: pytest.MonkeyPatch, op: int, body: dict[str, Any]) -> None:
    import kvshm.aio as aio

    orig = aio._Conn.request

    async def request(self, o, *a, **k):
        r = await orig(self, o, *a, **k)
        return (r[0], dict(body), r[2]) if o == op else r

    monkeypatch.setattr(aio._Conn, "request", request)


# ------------------------------------------- 1: the items of a found list are bools

BAD_ITEMS = ([None], ["x"], [1], [0], [1.0], [True, None, False], [False, b""])


@pytest.mark.parametrize("bad", BAD_ITEMS, ids=repr)
def test_found_items_that_are_not_bools_are_refused(server, monkeypatch, bad):
    """found_of checked the list and its length, not its items: ``[None]`` or ``["x"]``
    came back from exists_batch / exists as an answer (and from pin as keys held).
    Now ProtocolError on every remote path (failed before: no error raised)."""
    import kvshm.client as client_mod
    from kvshm.aio import AsyncClient
    from kvshm.client import Client

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    n = len(bad)
    keys = [b"d23-f-%d" % i for i in range(n)]
    body = {"found": list(bad)}
    with Client(server.address, transport="tcp", timeout=10) as c:
        c.put_batch(keys, [b"v"] * n)
        with monkeypatch.context() as m:
            _patch_sync(m, Op.EXISTS, body)
            with pytest.raises(ProtocolError, match="found item"):
                c.exists_batch(keys)
            if n == 1:
                for call1 in (False, True):
                    m.setattr(client_mod, "_CALL1", call1)
                    with pytest.raises(ProtocolError, match="found item"):
                        c.exists(keys[0])
        with monkeypatch.context() as m:
            _patch_sync(m, Op.PIN, body)
            with pytest.raises(ProtocolError, match="found item"):
                c.pin(keys, 30)
        assert c.exists_batch(keys) == [True] * n

    async def run() -> None:
        async with AsyncClient(server.address, transport="tcp", timeout=10) as a:
            with monkeypatch.context() as m:
                _patch_async(m, Op.EXISTS, body)
                with pytest.raises(ProtocolError, match="found item"):
                    await a.exists_batch(keys)
            assert await a.exists_batch(keys) == [True] * n

    asyncio.run(run())


def test_found_items_of_a_pipelined_part_are_checked(server, monkeypatch):
    """exists_batch of a batch sent as pipelined parts (op_exists_parts) checks each
    part's items too (failed before: a part of Nones was returned)."""
    import kvshm.client as client_mod
    from kvshm.client import Client

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    monkeypatch.setattr(client_mod, "PIPELINE", True)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 4)
    keys = [b"d23-p-%d" % i for i in range(4 * client_mod.PIPE_MIN_PARTS)]
    with Client(server.address, transport="tcp", timeout=10) as c:
        assert client_mod._parts(len(keys), Op.EXISTS) == 4
        with monkeypatch.context() as m:
            _patch_sync(m, Op.EXISTS, {"found": [False, None, False, False]})
            with pytest.raises(ProtocolError, match="found item"):
                c.exists_batch(keys)
        assert c.exists_batch(keys) == [False] * len(keys)


def test_the_servers_found_lists_pass_the_check(server, monkeypatch):
    """What the server sends (bools) passes: the remote paths answer as before."""
    from kvshm.client import Client

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    with Client(server.address, transport="tcp", timeout=10) as c:
        c.put_batch([b"d23-ok-a", b"d23-ok-b"], [b"1", b"2"])
        assert c.exists_batch([b"d23-ok-a", b"d23-ok-z", b"d23-ok-b"]) == [True, False, True]
        assert c.exists(b"d23-ok-a") is True and c.exists(b"d23-ok-z") is False
        c.unpin(c.pin([b"d23-ok-a", b"d23-ok-b"], 30))


# ------------------------------------- 2: DELETE / EVICT / PURGE counts are checked

BAD_COUNTS = (-1, "2", None, True, 2.0, [1], 1 << 60)


@pytest.mark.parametrize("bad", [*BAD_COUNTS, "missing"], ids=repr)
def test_a_bad_removal_count_is_refused(server, monkeypatch, bad):
    """delete / evict / purge returned the reply's ``n`` as it came (a str, a negative,
    a huge count; none: KeyError). Now ProtocolError, as prefix_of does for MATCH_PREFIX
    (failed before: no error, or KeyError)."""
    from kvshm.aio import AsyncClient
    from kvshm.client import Client

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    body = {} if bad == "missing" else {"n": bad}
    calls = ((Op.DELETE, lambda c: c.delete([b"d23-c-a", b"d23-c-b"])),
             (Op.EVICT, lambda c: c.evict(1.0)),
             (Op.PURGE, lambda c: c.purge()))
    with Client(server.address, transport="tcp", timeout=10) as c:
        for op, call in calls:
            with monkeypatch.context() as m:
                _patch_sync(m, op, body)
                with pytest.raises(ProtocolError, match=op.name):
                    call(c)
        assert c.delete([b"d23-c-a"]) == 0

    async def run() -> None:
        async with AsyncClient(server.address, transport="tcp", timeout=10) as a:
            for op, call in calls:
                with monkeypatch.context() as m:
                    _patch_async(m, op, body)
                    with pytest.raises(ProtocolError, match=op.name):
                        await call(a)
            assert await a.delete([b"d23-c-a"]) == 0

    asyncio.run(run())


def test_a_delete_count_past_the_keys_asked_is_refused(server, monkeypatch):
    """DELETE of 2 keys answered n=3: more removed than asked is no answer."""
    from kvshm.client import Client

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    with Client(server.address, transport="tcp", timeout=10) as c:
        with monkeypatch.context() as m:
            _patch_sync(m, Op.DELETE, {"n": 3})
            with pytest.raises(ProtocolError, match="DELETE"):
                c.delete([b"d23-c-a", b"d23-c-b"])
        with monkeypatch.context() as m:
            _patch_sync(m, Op.DELETE, {"n": 2})
            assert c.delete([b"d23-c-a", b"d23-c-b"]) == 2   # (the bound itself passes)


def test_good_removal_counts_come_back(server, monkeypatch):
    from kvshm.client import Client

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    with Client(server.address, transport="tcp", timeout=10) as c:
        c.put_batch([b"d23-g-a", b"d23-g-b"], [b"1", b"2"])
        assert c.delete([b"d23-g-a", b"d23-g-a", b"d23-g-z"]) == 1
        assert c.evict(1.0) == 0
        assert c.purge() >= 1
        assert c.purge() == 0


# ------------------------------ 3: a reply whose send fails (not ZMQ) is answered


@pytest.fixture
def bed(shm_name):
    from test_srvdisp import Bed

    b = Bed(shm_name)
    assert b.req(Op.EXISTS, 1, {"keys": [b"warm-up"]})[2] == {"found": [False]}
    yield b
    b.close()


def test_a_reply_that_cannot_be_sent_is_answered_internal(bed):
    """A handler's reply with a frame _send cannot send (no buffer protocol: a bug)
    raised out of _send after ServiceLoop._sends counted it, so _handle took the request
    as answered and sent nothing: the client waited out its timeout. Now INTERNAL, and
    the loop serves on (failed before: no reply)."""
    from kvshm.zmq_ctrl.protocol import Status

    def bad_frames(session, req_id, body, frames, on_sent):
        return Status.OK, {"n": 1}, [object()]

    bed.loop.add_ops({Op.STATS: bad_frames})
    st, rid, body, frames = bed.req(Op.STATS, 7, {})
    assert st == Status.INTERNAL and rid == 7 and "internal error" in body["error"]
    assert frames == []
    assert bed.loop.errors["internal"] == 1
    assert bed.req(Op.EXISTS, 8, {"keys": [b"k"]})[2] == {"found": [False]}


def test_a_pinned_reply_that_cannot_be_sent_settles_its_pins(bed):
    """A GET's reply (its entries pinned until sent) whose send fails: answered INTERNAL
    and the pins settled, not left held (failed before: no reply, pins held)."""
    from kvshm.zmq_ctrl.protocol import Status

    bed.store.put([b"pk"], [b"x" * 300_000])
    real = bed.loop._handlers[Op.GET]

    def get_then_bad(session, req_id, body, frames, on_sent):
        st, rbody, fr = real(session, req_id, body, frames, on_sent)
        assert on_sent      # (the entries are pinned until the reply is sent)
        return st, rbody, [*fr, object()]

    bed.loop.add_ops({Op.GET: get_then_bad})
    st, rid, body, frames = bed.req(Op.GET, 9, {"keys": [b"pk"]})
    assert st == Status.INTERNAL and rid == 9
    s = bed.store.stats()
    assert s["pins"] == 0 and s["pinned"] == 0 and not bed.loop._sending
    bed.loop.add_ops({Op.GET: real})
    st, rid, body, frames = bed.req(Op.GET, 10, {"keys": [b"pk"]})
    assert st == Status.OK and b"".join(frames) == b"x" * 300_000


# -------------------------- 4: lazy COMMITs of a request that failed go again


def _other_has(address: str, key: str) -> bool:
    from kvshm.client import Client
    with Client(address, transport="tcp", timeout=10) as other:
        return other.exists(key)


@pytest.mark.parametrize("where", ["hello", "request"])
def test_lazy_commits_of_a_failed_request_are_sent_again(server, monkeypatch, where):
    """A lazily committed put returned; its COMMIT rode on a HELLO (or another request)
    that failed before reaching the server (here: raised ServerUnavailable unsent). The
    COMMIT was neither sent again nor reported: the grant lapsed with its lease, flush()
    passed and the key was missing. Now it goes again with the next request and is
    applied (failed before: the key was never stored, no error)."""
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import ServerUnavailable

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    key = f"d23-lazy-{where}"
    with Client(server.address, lazy_commit=True, transport="shm", timeout=10) as c:
        c.put(key, b"L" * 9000)                     # its COMMIT queued (lazy)
        assert c._session.commits
        orig = chmod.Channel.request
        failed = []

        def request(self, op, body, *a, **k):
            if not failed and "commit" in body and (op == Op.HELLO) == (where == "hello"):
                failed.append(op)
                raise ServerUnavailable("test: not sent")
            return orig(self, op, body, *a, **k)

        monkeypatch.setattr(chmod.Channel, "request", request)
        if where == "hello":
            c._session.need_hello = True            # (as after a timeout)
        with pytest.raises(ServerUnavailable, match="not sent"):
            c.exists_batch([b"d23-x", b"d23-y"])
        assert failed
        monkeypatch.setattr(chmod.Channel, "request", orig)
        c.flush()
        assert _other_has(server.address, key)


def test_a_lazy_commit_sent_twice_is_answered_committed_not_lost(server, monkeypatch):
    """The request carrying a lazy COMMIT reached the server (applied) but failed on
    the way back: sent again, the server knows the grant as committed (the session's
    recent commits) and answers it committed, so the client's flush reports no false
    failure, and the key is there. (Before, the re-sent COMMIT was refused and flush
    raised LeaseExpired, "may have been stored", for a write that had landed.)"""
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import ServerUnavailable

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    with Client(server.address, lazy_commit=True, transport="shm", timeout=10) as c:
        again0 = c.stats()["commits_again"]
        c.put("d23-twice", b"T" * 9000)
        orig = chmod.Channel.request
        failed = []

        def request(self, op, body, *a, **k):
            r = orig(self, op, body, *a, **k)
            if not failed and "commit" in body:
                failed.append(op)
                raise ServerUnavailable("test: reply lost")
            return r

        monkeypatch.setattr(chmod.Channel, "request", request)
        with pytest.raises(ServerUnavailable, match="reply lost"):
            c.exists_batch([b"d23-x", b"d23-y"])
        monkeypatch.setattr(chmod.Channel, "request", orig)
        c.flush()                                   # the re-sent COMMIT: committed
        assert failed
        assert _other_has(server.address, "d23-twice")
        assert c.stats()["commits_again"] == again0 + 1


# -------------------------- 5: an ALLOC reply short of offsets aborts its grant


@pytest.mark.parametrize("bad", ["short", "long", "no offsets", "offsets not a list",
                                 "short st"])
def test_an_alloc_reply_that_does_not_fit_aborts_the_grant(server, monkeypatch, bad):
    """put_batch over shm read ``[offsets[i] for i in ok]`` before its abort ``try``: an
    ALLOC reply with fewer offsets than statuses raised IndexError (KeyError without
    offsets) and left the reservation to its lease. Now ProtocolError, and the grant is
    aborted with the next request (failed before: IndexError/KeyError, the blocks stayed
    pending)."""
    import kvshm.client as client_mod
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    monkeypatch.setattr(client_mod, "INLINE_PUT", False)
    keys = [b"d23-a-%s-%d" % (bad.encode(), i) for i in range(3)]
    with Client(server.address, transport="shm", timeout=10) as c:
        assert c._session.mover is not None
        base = c.stats()["pending"]
        orig = chmod.Channel.request

        def request(self, op, *a, **k):
            r = orig(self, op, *a, **k)
            if op != Op.ALLOC:
                return r
            rb = dict(r[2])
            if bad == "short":
                rb["offsets"] = rb["offsets"][:-1]
            elif bad == "long":
                rb["offsets"] = rb["offsets"] + rb["offsets"][:1]
            elif bad == "no offsets":
                del rb["offsets"]
            elif bad == "offsets not a list":
                rb["offsets"] = 5
            else:
                rb["st"] = rb["st"][:-1]
                rb["offsets"] = rb["offsets"][:-1]
            return (r[0], r[1], rb, r[3])

        with monkeypatch.context() as m:
            m.setattr(chmod.Channel, "request", request)
            with pytest.raises(ProtocolError, match="ALLOC reply"):
                c.put_batch(keys, [b"A" * 9000] * 3)
        assert c._session.aborts                    # rides on the next request
        assert c.stats()["pending"] == base         # (that one: the grant is gone)
        assert c.exists_batch(keys) == [False] * 3
        c.put_batch(keys, [b"A" * 9000] * 3)
        assert c.exists_batch(keys) == [True] * 3


# ----------------- 6: a GET reply placed into buffers only where its layout says


class _ThreadServer:
    """A Store and its ServiceLoop on TCP in a thread (its GET handler replaceable)."""

    def __init__(self, name: str) -> None:
        import threading

        import zmq

        from kvshm import Pool
        from kvshm.limits import Limits
        from kvshm.segments import token_digest
        from kvshm.store import Store, StoreConfig
        from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION
        from kvshm.zmq_ctrl.router import ServiceLoop

        self.ctx = zmq.Context()
        self.pool = Pool.create(name, 8 << 20, 4096)
        self.store = Store(self.pool, StoreConfig(limits=Limits()))
        hello = {"version": PROTOCOL_VERSION,
                 "pool": {"name": self.pool.name, "size": self.pool.size,
                          "block_size": self.pool.block_size,
                          "token_digest": token_digest(self.pool.token)},
                 "limits": self.store.config.limits.to_wire(), "lease_timeout": 30.0,
                 "server": {}, "ipc": None}
        self.loop = ServiceLoop(self.store, ["tcp://127.0.0.1:0"], hello, 23,
                                context=self.ctx)
        self.address = self.loop.endpoints[0]
        self.thread: Any = None
        self._threading = threading

    def start(self) -> None:
        self.thread = self._threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.loop.stop()
            self.thread.join(30)
        self.loop.close()
        self.ctx.term()
        self.pool.close()
        self.pool.unlink()


@pytest.fixture
def tserver(shm_name):
    s = _ThreadServer(shm_name)
    yield s
    s.close()


LAYOUTS = {
    # two small values packed in one frame of 300 bytes; sizes say 100 + 250
    "packed": ([100, 200], lambda sz: [100, 250], None),
    # two large values, a frame each; sizes say 200000 + 400000 (frames of 300000)
    "alone": ([300_000, 300_000], lambda sz: [200_000, 400_000], None),
    # two large values, a frame each; counts say both are in the first
    "counts": ([300_000, 300_000], None, lambda c: [2, 0]),
}


@pytest.mark.parametrize("how", list(LAYOUTS))
def test_a_get_reply_that_does_not_fit_its_sizes_writes_nothing(tserver, monkeypatch, how):
    """TCP get_batch_into (ZMTP ``Conn.recv(into=)``) placed a reply's payload into
    ``outs[i][:sizes[i]]`` as it arrived, and only then checked the frames' lengths
    against counts and sizes (frames.placed): a reply whose layout did not match its
    sizes wrote into the caller's buffers before raising ProtocolError. Now each frame
    is placed only when its length is the one the layout gives it (failed before: the
    buffers were written)."""
    import kvshm.client as client_mod
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client

    if not chmod.INTO:
        pytest.skip("KVSHM_ZMTP_INTO=0")
    values, bad_sizes, bad_counts = LAYOUTS[how]
    keys = [b"d23-g-%d" % i for i in range(len(values))]
    tserver.store.put(keys, [bytes([65 + i]) * n for i, n in enumerate(values)])
    real = tserver.loop._handlers[Op.GET]

    bad = [True]

    def tampered(session, req_id, body, frames, on_sent):
        st, rb, fr = real(session, req_id, body, frames, on_sent)
        if not bad[0]:
            return st, rb, fr
        if bad_sizes is not None:
            rb["sizes"] = bad_sizes(rb["sizes"])
        if bad_counts is not None:
            rb["counts"] = bad_counts(rb["counts"])
        return st, rb, fr

    tserver.loop.add_ops({Op.GET: tampered})
    tserver.start()
    monkeypatch.setattr(client_mod, "PIPELINE", False)
    with Client(tserver.address, transport="tcp", timeout=10) as c:
        assert c._chan.zmtp
        outs = [bytearray(b"\xee" * 500_000) for _ in keys]
        with pytest.raises(ProtocolError, match="GET reply"):
            c.get_batch_into(keys, outs)
        assert all(o == b"\xee" * 500_000 for o in outs)
        bad[0] = False
        assert c.get_batch_into(keys, outs) == values
        assert all(o[:n] == bytes([65 + i]) * n for i, (o, n) in enumerate(zip(outs, values)))


# --------------------- 8: frames.unpack and frames.placed share one walk of the frames


def _layouts():
    import itertools
    # (frame lengths, counts, sizes): valid and not, values over several frames included
    yield [30], [3], [10, 10, 10]
    yield [10, 20], [1, 2], [10, 15, 5]
    yield [4, 4, 2], [1, 0, 0], [10]
    yield [4, 6, 5], [1, 0, 1], [10, 5]
    yield [5, 4, 6], [1, 1, 0], [5, 10]
    yield [], [], []
    for lens, counts, sizes in itertools.product(([4, 6], [10], [3, 3, 4]),
                                                 ([1, 0], [2], [0, 1], [1, 1], [1, 0, 0],
                                                  [2, 0], [1, 1, 0]),
                                                 ([10], [4, 6], [5, 5], [3, 3, 4])):
        yield lens, counts, sizes


def test_unpack_and_placed_agree_on_every_layout():
    """The shared walk (frames._groups) changes no answer: the Python unpack gives the
    C unpack's values or both refuse, and placed (frames as their lengths) accepts
    exactly the layouts unpack accepts."""
    import kvshm.zmq_ctrl.frames as F

    for lens, counts, sizes in _layouts():
        frames = [bytes(range(sum(lens[:i]), sum(lens[:i + 1]))) for i in range(len(lens))]
        try:
            py = [bytes(v) for v in F._py_unpack(frames, counts, sizes)]
        except F.FrameLayoutError:
            py = None
        if F._batch is not None:
            try:
                c = [bytes(v) for v in F.unpack(frames, counts, sizes)]
            except F.FrameLayoutError:
                c = None
            assert py == c, (lens, counts, sizes)
        if lens:
            try:
                ok = F.placed(list(lens), counts, sizes)
            except F.FrameLayoutError:
                ok = False
            assert ok == (py is not None), (lens, counts, sizes)
        if py is not None:
            assert b"".join(py) == b"".join(frames)
