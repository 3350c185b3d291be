"""Hostile review of what landed on 2 Dec (helper break23): the 80-byte Entry (checksum,
meta and runs in one field), the shared table's growth policy, the debt fixes and the
fast path's trim."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvshm.index import Entry

BS = 4096


class _Obj:
    pass


_REC = _Obj()
# what a tier (or a hostile caller) may keep as meta or checksum: ints (a meta that is an
# int must not read as a checksum), bools, tuples and lists that look like runs, strings
_VALUES = st.sampled_from([
    None, 0, 7, -1, 2**64 - 1, 2**70, True, False, ((1, 2),), [(1, 2)], ((1, 2), (3, 4)),
    (), "odd", b"x", 1.5, _REC])


class EntryModel(RuleBasedStateMachine):
    """Entry's attributes against a plain Python record of what was set."""

    def __init__(self) -> None:
        super().__init__()
        self.e = Entry(b"k" * 20, 5, 3, 3 * BS - 10)
        self.start, self.nblocks = 5, 3
        self.checksum = None
        self.meta = None
        self.ext = None           # None: one run (start, nblocks); else a tuple

    @rule(v=_VALUES)
    def set_checksum(self, v):
        self.e.checksum = v
        self.checksum = v

    @rule(v=_VALUES)
    def set_meta(self, v):
        self.e.meta = v
        self.meta = v

    @rule(kind=st.sampled_from(["whole", "part", "two", "many", "freed", "list"]))
    def set_extents(self, kind):
        s, n = self.start, self.nblocks
        runs = {"whole": ((s + 1, n),), "part": ((s, n + 1),),
                "two": ((s, 1), (s + 9, n - 1)),
                "many": tuple((s + 3 * i, 1) for i in range(n)),
                "freed": (), "list": [[s + 2, 1], [s + 7, n - 1]]}[kind]
        self.e.extents = runs
        if kind == "whole":
            self.start = s + 1
            self.ext = None
        else:
            self.ext = tuple(runs)

    @rule()
    def free(self):
        self.e.start = -1
        self.start = -1
        self.e.extents = ()
        self.ext = ()

    @rule(s=st.integers(0, 50))
    def reuse(self, s):
        # an entry placed again (as a tier's promotion does): start, then one run
        self.e.start = s
        self.e.extents = ((s, self.nblocks),)
        self.start = s
        self.ext = None

    @invariant()
    def agrees(self):
        e = self.e
        assert e.checksum is self.checksum or (
            type(self.checksum) is int and e.checksum == self.checksum
            and type(e.checksum) is int), (e.checksum, self.checksum)
        assert e.meta is self.meta or (type(self.meta) is int and e.meta == self.meta
                                       and type(e.meta) is int), (e.meta, self.meta)
        want = ((self.start, self.nblocks),) if self.ext is None else self.ext
        assert e.extents == want, (e.extents, want)
        assert e.nruns == len(want)
        assert e.start == self.start and e.nblocks == self.nblocks


EntryModel.TestCase.settings = settings(max_examples=300, stateful_step_count=30,
                                        deadline=None)
test_entry_attributes_agree_with_a_plain_record = EntryModel.TestCase


# ---------------------------------------------------------------- 2. the table's growth

@pytest.mark.parametrize("growth", [(8, 1), (14, 1), (8, 16), (14, 16), (13, 8)])
def test_growth_extremes_keep_every_key_through_churn_and_tombstones(shm_name, growth):
    """Each policy's extremes, a pool of 512 blocks (a table of at most 1,024 slots,
    starting at 64): fill to one key a block, then delete and add keys at that load
    (tombstones at the table's highest load), with overwrites; a reader made first sees
    exactly the live keys with their runs and sizes; nothing is refused (the pool has room
    for every live key)."""
    from kvshm import Pool
    from kvshm._shmindex import IndexReader, IndexWriter, default_slots

    blocks = 512
    pool = Pool.create(shm_name, blocks * BS, BS)
    w = IndexWriter.create(shm_name + "-index", shm_name + "-reads", default_slots(blocks),
                           epoch=5, block_size=BS, num_blocks=blocks, token=pool.token,
                           initial_slots=64, growth=growth)
    r = IndexReader(w.name, w.reads_name, pool, 5)
    try:
        live: dict[bytes, tuple[int, int]] = {}
        free = list(range(blocks))
        n = 0
        def add(k):
            b = free.pop()
            sz = 1 + (n * 7) % BS
            assert w.publish(k, sz, [(b, 1)]) >= 0, (k, len(live), w.stats())
            live[k] = (b, sz)
        for i in range(blocks):
            n += 1
            add(b"k-%06d" % i)
        assert w.unpublished == 0
        for step in range(3000):
            n += 1
            old = b"k-%06d" % (step * 37 % (blocks + step))
            if old in live:
                b, _ = live.pop(old)
                assert w.unpublish(old)
                free.append(b)
            if free:
                add(b"k-%06d" % (blocks + step))
            if step % 5 == 0 and live:          # an overwrite in place
                k = next(iter(live))
                b, _ = live[k]
                assert w.publish(k, 9, [(b, 1)]) >= 0
                live[k] = (b, 9)
            if step % 500 == 0:
                got = [r.lookup(k) for k in live]
                assert [(g[1], g[2]) for g in got] == [(sz, ((b, 1),))
                                                       for b, sz in live.values()]
        assert w.unpublished == 0, w.stats()
        keys = list(live)
        assert r.exists_batch(keys) == [True] * len(keys)
        gone = [b"k-%06d" % i for i in range(blocks + 3000) if b"k-%06d" % i not in live]
        assert r.exists_batch(gone) == [False] * len(gone)
        for k, (b, sz) in live.items():
            g = r.lookup(k)
            assert (g[1], g[2]) == (sz, ((b, 1),)), (k, g)
    finally:
        r.close()
        w.unlink()
        pool.close()
        pool.unlink()


# ------------------------------------- 3: lazy COMMITs of a failed request, at close

@pytest.fixture(scope="module")
def server():
    from servers import ServerProcess
    srv = ServerProcess(prealloc_size=1 / 16)
    yield srv
    srv.stop()


def _other_has(address: str, key: str) -> bool:
    from kvshm.client import Client
    with Client(address, transport="tcp", timeout=10) as other:
        return other.exists(key)


@pytest.mark.parametrize("where", ["hello", "request"])
def test_a_lazy_commit_requeued_by_a_failed_request_is_sent_at_close(server, monkeypatch,
                                                                     where, caplog):
    """A lazily committed put returned; the request carrying its COMMIT failed before
    reaching the server (980c47c queues the COMMIT again), and the client is closed next,
    with the server alive. close() skipped its flush and its BYE (a HELLO was due), so
    the COMMIT was never sent: the grant lapsed and a write reported done was lost with
    nothing said. It must be committed at close (or, when it cannot be, reported)."""
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import ServerUnavailable
    from kvshm.zmq_ctrl.protocol import Op

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    key = f"b23-close-{where}"
    c = Client(server.address, lazy_commit=True, transport="shm", timeout=10)
    try:
        c.put(key, b"C" * 9000)                     # its COMMIT queued (lazy)
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
            c.exists_batch([b"b23-x", b"b23-y"])
        assert failed
        monkeypatch.setattr(chmod.Channel, "request", orig)
    finally:
        c.close()
    assert _other_has(server.address, key)


@pytest.mark.parametrize("where", ["hello", "request"])
def test_an_async_lazy_commit_requeued_by_a_failed_request_is_sent_at_close(server,
                                                                           monkeypatch,
                                                                           where):
    """AsyncClient.close as Client.close: it skipped its flush while a HELLO was due (or
    the connection was gone), so a lazy COMMIT put back by a failed request was never
    sent and the write, reported done, was lost with nothing said."""
    import asyncio

    import kvshm.aio as aio
    from kvshm.errors import ServerUnavailable

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    key = f"b23-aclose-{where}"

    async def main():
        c = aio.AsyncClient(server.address, lazy_commit=True, transport="shm", timeout=10)
        await c.connect()
        try:
            await c.put(key, b"A" * 9000)
            assert c._session.commits
            orig = aio._Conn.request
            failed = []

            async def request(self, op, body, *a, **k):
                if not failed and isinstance(body, dict) and "commit" in body:
                    failed.append(op)
                    raise ServerUnavailable("test: not sent")
                return await orig(self, op, body, *a, **k)

            monkeypatch.setattr(aio._Conn, "request", request)
            if where == "hello":
                c._session.need_hello = True        # (as after a timeout)
            with pytest.raises(ServerUnavailable, match="not sent"):
                await c.exists_batch([b"b23-x", b"b23-y"])
            assert failed
            monkeypatch.setattr(aio._Conn, "request", orig)
        finally:
            await c.close()

    asyncio.run(main())
    assert _other_has(server.address, key)


def test_a_lazy_commit_owed_at_close_to_a_dead_server_is_reported(monkeypatch, caplog):
    """The same close when the server is gone: the flush's HELLO fails, close() returns
    and says (a warning) how many lazily committed writes may not be stored."""
    import logging

    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import ServerUnavailable
    from servers import ServerProcess

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    srv = ServerProcess(prealloc_size=1 / 16)
    try:
        c = Client(srv.address, lazy_commit=True, transport="shm", timeout=2)
        try:
            c.put("b23-dead", b"D" * 9000)
            orig = chmod.Channel.request

            def request(self, op, body, *a, **k):
                if "commit" in body:
                    raise ServerUnavailable("test: not sent")
                return orig(self, op, body, *a, **k)

            monkeypatch.setattr(chmod.Channel, "request", request)
            with pytest.raises(ServerUnavailable, match="not sent"):
                c.exists_batch([b"b23-x"])
            monkeypatch.setattr(chmod.Channel, "request", orig)
            srv.stop()
        finally:
            with caplog.at_level(logging.WARNING, logger="kvshm"):
                c.close()
        assert "1 write(s) committed lazily may not be stored" in caplog.text
    finally:
        srv.stop()


@pytest.mark.parametrize("bad", ["7,4", "x", "13,4,1", "14.5,8", "13,0"])
def test_a_bad_growth_in_the_environment_stops_kvshm_serve_with_a_clear_error(bad):
    """KVSHM_INDEX_GROWTH with a bad value: kvshm serve printed a traceback from deep in
    IndexWriter.create (after the pool was made), the value shown as a tuple ("(7, 4)",
    not what was set). Now one line naming the variable and the value as set, exit
    status 2, before any segment is made."""
    import os
    import subprocess
    import sys

    from servers import unique_shm_name

    name = unique_shm_name()
    p = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--service-port", "0",
                        "--manage-port", "0", "--prealloc-size", "0.0625", "--shm-name",
                        name, "--log-level", "WARNING"],
                       env={**os.environ, "KVSHM_INDEX_GROWTH": bad},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    assert f"KVSHM_INDEX_GROWTH={bad!r}" in p.stderr, p.stderr
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(name.lstrip("/"))]


def test_a_growth_argument_takes_whole_numbers_only(shm_name):
    """growth=(13.9, 8) was taken as (13, 8) and ("13", "8") as (13, 8): int() of
    anything; now a float or a str is refused as the variable's "14.5,8" is."""
    from kvshm._shmindex import IndexWriter

    for bad in ((13.9, 8), ("13", "8"), (13, 8.0)):
        with pytest.raises(ValueError, match="growth"):
            IndexWriter.create(shm_name + "-index", shm_name + "-reads", 64, epoch=1,
                               block_size=BS, num_blocks=64, growth=bad)


# --------------------- 3b: a GET reply placed by Conn.recv(into=) with a hostile layout

def _tamper_cases():
    big = 300_000
    # (values stored, tamper(sizes, counts, frames) -> (sizes, counts, frames))
    return {
        "extra frame": ([big, big], lambda s, c, f: (s, c, [*f, b"\x11" * big])),
        "frame dropped": ([big, big], lambda s, c, f: (s, c, f[:1])),
        "huge count": ([big, big], lambda s, c, f: (s, [2**64 - 1, 0], f)),
        "bool counts": ([big, big], lambda s, c, f: (s, [True, True], f)),
        "negative count": ([big, big], lambda s, c, f: (s, [-1, 3], f)),
        "short counts": ([big, big], lambda s, c, f: (s, c[:1], f)),
        "split value overflows": ([big], lambda s, c, f: (
            s, [1, 0], [bytes(f[0])[:100_000], b"\x22" * 250_000])),
        "split value short": ([big], lambda s, c, f: (
            s, [1, 0], [bytes(f[0])[:100_000], b"\x22" * 150_000])),
        "sizes past the buffer": ([big, big], lambda s, c, f: ([big * 2, big], c, f)),
        "zero counts only": ([big, big], lambda s, c, f: (s, [0, 0], f)),
        "packed small split": ([100, 200], lambda s, c, f: (s, [1, 1], [bytes(f[0])[:100],
                                                                       bytes(f[0])[100:]])),
    }


@pytest.mark.parametrize("how", list(_tamper_cases()))
def test_a_hostile_get_layout_never_writes_past_what_it_says(shm_name, monkeypatch, how):
    """Conn.recv(into=) against replies whose frames, counts and sizes disagree: the call
    either returns the values (a layout that is in fact consistent) or raises
    ProtocolError; the bytes of each out buffer past the value's stored size are never
    written, the client keeps working (the next, untampered call is right)."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_debt23 import _ThreadServer

    import kvshm.client as client_mod
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import ProtocolError
    from kvshm.zmq_ctrl.protocol import Op

    if not chmod.INTO:
        pytest.skip("KVSHM_ZMTP_INTO=0")
    values, tamper = _tamper_cases()[how]
    ts = _ThreadServer(shm_name)
    try:
        keys = [b"b23-g-%d" % i for i in range(len(values))]
        ts.store.put(keys, [bytes([65 + i]) * n for i, n in enumerate(values)])
        real = ts.loop._handlers[Op.GET]
        bad = [True]

        def tampered(session, req_id, body, frames, on_sent):
            st, rb, fr = real(session, req_id, body, frames, on_sent)
            if bad[0]:
                rb["sizes"], rb["counts"], fr = tamper(rb["sizes"], rb["counts"], fr)
            return st, rb, fr

        ts.loop.add_ops({Op.GET: tampered})
        ts.start()
        monkeypatch.setattr(client_mod, "PIPELINE", False)
        room = 700_000
        with Client(ts.address, transport="tcp", timeout=10) as c:
            assert c._chan.zmtp
            outs = [bytearray(b"\xee" * room) for _ in keys]
            try:
                got = c.get_batch_into(keys, outs)
            except ProtocolError:
                got = None
            for o, n in zip(outs, values):
                assert o[n:] == b"\xee" * (room - n), (how, o.find(b"\xee", n))
            if got is not None:
                assert got == values
            bad[0] = False
            outs = [bytearray(room) for _ in keys]
            assert c.get_batch_into(keys, outs) == values
            assert all(o[:n] == bytes([65 + i]) * n
                       for i, (o, n) in enumerate(zip(outs, values)))
    finally:
        ts.close()


@pytest.mark.parametrize("growth", ["14,1", "8,1"])
def test_a_server_with_an_extreme_growth_serves_lock_free_reads_through_its_growths(
        growth):
    """kvshm serve with KVSHM_INDEX_GROWTH at an extreme: a writer client fills the table
    through many growths (by 1/16 each) while deleting a quarter of what it wrote
    (tombstones at the table's load); a second client (lock-free reads of the server's
    table, another process from the server) sees every kept key with its bytes after
    each batch, and none deleted; the server refused no key (unpublished 0) and its
    accounting holds."""
    import threading

    from kvshm import Client
    from servers import ServerProcess

    with ServerProcess("--block-size", "4", prealloc_size=1 / 16,
                       env={"KVSHM_INDEX_GROWTH": growth}) as srv:
        with Client(srv.address, transport="shm") as w, \
                Client(srv.address, transport="shm") as r:
            kept: list[bytes] = []
            gone: list[bytes] = []
            errors: list[BaseException] = []
            stop = threading.Event()
            ready = threading.Event()

            def reads():
                try:
                    while not stop.is_set():
                        ks = kept[:]            # (committed before they were listed)
                        if ks:
                            got = r.get_batch(ks[-200:])
                            assert got == [k * 2 for k in ks[-200:]]
                            assert r.exists_batch(ks) == [True] * len(ks)
                            ready.set()
                except BaseException as exc:    # (asserted below)
                    errors.append(exc)
                    ready.set()

            t = threading.Thread(target=reads)
            t.start()
            try:
                for b in range(24):
                    ks = [b"b23-%s-%02d-%04d" % (growth.encode(), b, i) for i in range(400)]
                    w.put_batch(ks, [k * 2 for k in ks])
                    drop = ks[::4]
                    assert w.delete(drop) == len(drop)
                    gone.extend(drop)
                    kept.extend(k for k in ks if k not in set(drop))
                    if b == 0:
                        ready.wait(30)
                    assert not errors, errors
            finally:
                stop.set()
                t.join(60)
            assert not errors, errors
            assert r.exists_batch(kept) == [True] * len(kept)
            assert r.exists_batch(gone) == [False] * len(gone)
            s = w.stats(verify=True)
            si = s["shared_index"]
            assert si["unpublished"] == 0 and si["live"] == len(kept), si
            assert si["rebuilds"] >= 3, si
            assert s["accounting_ok"], s


# ------------------------------------- 1b: checksummed entries through an SSD tier

def test_checksummed_entries_keep_their_checksum_through_spills_and_promotions(
        shm_name, tmp_path):
    """Entries stored with a checksum (an int alone in Entry._x) get a tier's meta when
    spilled (both: a side object), lose it when promoted or overwritten, some stored in
    several runs: random puts (a third without a checksum), reads, deletes on a small
    pool over an SSD tier; every read gives the value's bytes and the checksum it was
    put with, and each live entry's attributes agree (meta only while it has a copy
    below, one run unless its extents say otherwise)."""
    import sys

    import numpy as np
    import xxhash

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_ssd import Tiered, runs_of

    from kvshm.zmq_ctrl.protocol import Status

    t = Tiered(shm_name, str(tmp_path / "ssd"), pool_blocks=32, ssd_blocks=128,
               queue_blocks=4)
    try:
        rng = np.random.default_rng(23)
        truth: dict[bytes, tuple[bytes, int | None]] = {}

        def put(k, v, csum):
            t.rid += 1
            r = None
            while r is None:
                r = t.store.alloc_entries(b"w", t.rid, [k], [len(v)],
                                          None if csum is None else [csum], defer=True)
                if r is None:
                    t.woke.wait(0.5)
                    t.woke.clear()
                    t.store.service()
            offsets, st = r
            assert st == [Status.OK], st
            pos = 0
            for o, n in runs_of(offsets[0], len(v)):
                t.pool.write(o, v[pos:pos + n])
                pos += n
            assert t.store.commit(b"w", [t.rid]) == []
            t.store.service()

        def get(k):
            t.rid += 1
            hold = t.store.read_hold()
            while not t.store.prepare_read([k], hold):
                t.woke.wait(0.5)
                t.woke.clear()
                t.store.service()
            offsets, sizes, sums = t.store.lookup(b"r", t.rid, [k], hold)
            t.store.release_hold(hold)
            if sizes[0] < 0:
                return None
            data = b"".join(t.pool.read_bytes(o, n) for o, n in runs_of(offsets[0], sizes[0]))
            t.store.release(b"r", [t.rid])
            return data, sums[0]

        for step in range(1200):
            op = rng.integers(0, 10)
            k = b"c%d" % rng.integers(0, 120)
            if op < 5:
                v = bytes(rng.integers(0, 256, int(rng.integers(1, 3 * BS)), dtype=np.uint8))
                csum = None if op == 0 else xxhash.xxh64_intdigest(v)
                put(k, v, csum)
                truth[k] = (v, csum)
            elif op < 9:
                got = get(k)
                if got is not None:
                    v, csum = truth[k]
                    # (one put without: the SSD tier's own xxh64 once it was spilled)
                    assert got[0] == v and got[1] in (csum, xxhash.xxh64_intdigest(v)), (
                        k, got[1], csum)
            else:
                t.store.delete([k])
                truth.pop(k, None)
            if step % 100 == 0:
                t.check()
                for e in t.store.index.lru():
                    v, csum = truth[e.key]
                    assert e.checksum in (csum, xxhash.xxh64_intdigest(v)), e
                    assert e.size == len(truth[e.key][0])
                    assert sum(n for _, n in e.extents) == e.nblocks, e
                    assert e.meta is None or (e.meta.key == e.key
                                              and e.meta.size == e.size), (e, e.meta)
        s = t.check()
        assert s["tiers"]["ssd"]["spills"] > 0 and s["tiers"]["pool"]["promotions"] > 0
        assert s["tiers"]["ssd"]["checksum_failures"] == 0
    finally:
        t.close()


# ------------------------------------- 3c: an ALLOC reply's items (not only its lengths)

@pytest.mark.parametrize("bad", ["negative offset", "offset past the pool", "str offset",
                                 "str status", "float offset", "run past the pool"])
def test_an_alloc_reply_with_bad_items_writes_nothing_and_aborts(server, monkeypatch, bad):
    """e7eb749 checks an ALLOC reply's lists and lengths; its items go to the pool write
    (the client writes the value where the reply says): an offset that is negative,
    past the pool, not an int, or a status that is no status must raise a clear error
    (ProtocolError: they were IndexError, ValueError "not enough values to unpack",
    TypeError "float object is not iterable", ValueError "x is not a valid Status"),
    write nothing outside the blocks granted, and the grant go (aborted with the next
    request)."""
    import kvshm.client as client_mod
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import ProtocolError
    from kvshm.zmq_ctrl.protocol import Op

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    monkeypatch.setattr(client_mod, "INLINE_PUT", False)
    keys = [b"b23-a-%s-%d" % (bad.replace(" ", "-").encode(), i) for i in range(3)]
    with Client(server.address, transport="shm", timeout=10) as c:
        assert c._session.mover is not None
        psize = c._session.mover.pool.size
        base = c.stats()["pending"]
        orig = chmod.Channel.request

        def request(self, op, *a, **k):
            r = orig(self, op, *a, **k)
            if op != Op.ALLOC:
                return r
            rb = dict(r[2])
            off = list(rb["offsets"])
            if bad == "negative offset":
                off[1] = -4096
            elif bad == "offset past the pool":
                off[1] = psize + 4096
            elif bad == "str offset":
                off[1] = "x"
            elif bad == "float offset":
                off[1] = 4096.0
            elif bad == "run past the pool":
                off[1] = [[psize - 4096, 9000]]
            else:
                rb["st"] = [rb["st"][0], "x", rb["st"][2]]
            rb["offsets"] = off
            return (r[0], r[1], rb, r[3])

        with monkeypatch.context() as m:
            m.setattr(chmod.Channel, "request", request)
            with pytest.raises(BaseException) as ei:
                c.put_batch(keys, [b"A" * 9000] * 3)
        assert isinstance(ei.value, ProtocolError), ei.value
        assert c.stats()["pending"] == base         # (the ABORT rode on that one)
        c.put_batch(keys, [b"B" * 9000] * 3)
        assert c.get_batch(keys) == [b"B" * 9000] * 3
        assert c.stats(verify=True)["accounting_ok"]


# ------------------------------------- 3d: frames._groups, fuzzed

def test_unpack_and_placed_agree_on_random_layouts():
    """test_debt23's 69 layouts, fuzzed: any frame lengths, counts (zeros, negatives,
    bools, more or fewer than the frames) and sizes: the Python unpack gives the C
    unpack's values or both refuse (FrameLayoutError, nothing else), and placed accepts
    exactly what unpack accepts."""
    from hypothesis import given

    import kvshm.zmq_ctrl.frames as F

    ints = st.integers(-1, 12)
    counts_st = st.lists(st.one_of(st.integers(-1, 3), st.sampled_from([True, False, 0])),
                         max_size=5)

    @settings(max_examples=800, deadline=None)
    @given(lens=st.lists(st.integers(0, 12), max_size=5), counts=counts_st,
           sizes=st.lists(ints, max_size=6))
    def check(lens, counts, sizes):
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
            assert [len(v) for v in py] == sizes

    check()


def test_a_lazy_commit_resent_after_a_stopped_server_never_overwrites_a_newer_write(
        monkeypatch):
    """A lazy put of v1; the server SIGSTOPped, the request carrying its COMMIT times out
    (it reached the server's socket: applied once the server goes on), the COMMIT queued
    again (980c47c); the server resumed, the same client puts v2 on the same key. v2 must
    be what every reader sees after flush, whatever the re-sent COMMIT met; a report
    (LeaseExpired) may come, a wrong value or a lost v2 may not."""
    import os
    import signal

    from kvshm.client import Client
    from kvshm.errors import KvshmError, LeaseExpired
    from servers import ServerProcess

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    srv = ServerProcess(prealloc_size=1 / 16)
    try:
        with Client(srv.address, lazy_commit=True, transport="shm", timeout=1.5) as c:
            c.put("b23-stop", b"1" * 9000)
            assert c._session.commits
            os.kill(srv.pid, signal.SIGSTOP)
            try:
                with pytest.raises(KvshmError):
                    c.exists_batch([b"b23-x"])
            finally:
                os.kill(srv.pid, signal.SIGCONT)
            reports = 0
            for _ in range(3):
                try:
                    c.put("b23-stop", b"2" * 9000)
                    break
                except LeaseExpired:
                    reports += 1
            for _ in range(3):
                try:
                    c.flush()
                    break
                except LeaseExpired:
                    reports += 1
            with Client(srv.address, transport="tcp", timeout=10) as other:
                assert other.get("b23-stop") == b"2" * 9000
            assert c.get("b23-stop") == b"2" * 9000
            assert reports <= 1
    finally:
        srv.stop()


# ------------------------------------- 4: the fast path's C counters

def test_the_fast_paths_counts_follow_the_requests_it_serves(server):
    """FastPath.counts is now a property over C counters: /stats' fast_path (what
    ServiceLoop.fast_counts reads) counts each one-key PUT, GET and EXISTS the fast path
    served, by op (at most the requests made, each op seen), and reading them twice
    never makes them go back."""
    from kvshm.client import Client

    with Client(server.address, transport="tcp", timeout=10) as c:
        fp0 = c.stats()["fast_path"]
        if fp0["PUT"] + fp0["GET"] + fp0["EXISTS"] + fp0["declined"] == 0:
            c.put("b23-fp-warm", b"w")
            if sum(c.stats()["fast_path"][k] for k in ("PUT", "GET", "EXISTS")) == 0:
                pytest.skip("no fast path in this server")
        fp0 = c.stats()["fast_path"]
        for i in range(20):
            c.put(f"b23-fp-{i}", b"v" * 100)
        for i in range(15):
            assert c.get(f"b23-fp-{i}") == b"v" * 100
        for i in range(10):
            assert c.exists(f"b23-fp-{i}")
        fp1 = c.stats()["fast_path"]
        fp2 = c.stats()["fast_path"]
        served = {k: fp1[k] - fp0[k] for k in ("PUT", "GET", "EXISTS")}
        assert served["PUT"] + fp1["declined"] - fp0["declined"] >= 20
        assert served["PUT"] <= 20 and served["GET"] <= 15 and served["EXISTS"] <= 10
        assert served["PUT"] > 0 and served["GET"] > 0 and served["EXISTS"] > 0, served
        assert all(fp2[k] >= fp1[k] for k in ("PUT", "GET", "EXISTS", "declined"))


def test_lazy_commits_survive_failed_requests_and_hellos_on_two_threads(server, monkeypatch):
    """One lazily committing client on two threads (puts on one, lookups on the other);
    every 7th request that carries COMMITs, HELLOs included, fails before it is sent
    (ServerUnavailable), each failure making a HELLO due. After a flush every put that
    returned is stored, with its bytes; none was reported lost (none was sent twice)."""
    import threading

    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import KvshmError, LeaseExpired, ServerUnavailable

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    orig = chmod.Channel.request
    orig_many = chmod.Channel.request_many
    lock = threading.Lock()
    seen = [0]

    def fail_now(body):
        if isinstance(body, dict) and body.get("commit"):
            with lock:
                seen[0] += 1
                return seen[0] % 7 == 0
        return False

    def request(self, op, body, *a, **k):
        if fail_now(body):
            raise ServerUnavailable("test: not sent")
        return orig(self, op, body, *a, **k)

    def request_many(self, items, *a, **k):
        if items and fail_now(items[0][1]):
            raise ServerUnavailable("test: not sent")
        return orig_many(self, items, *a, **k)

    with Client(server.address, lazy_commit=True, transport="shm", timeout=10) as c:
        monkeypatch.setattr(chmod.Channel, "request", request)
        monkeypatch.setattr(chmod.Channel, "request_many", request_many)
        stored: dict[bytes, bytes] = {}
        reports: list[BaseException] = []
        other: list[BaseException] = []
        stop = threading.Event()

        def looker():
            while not stop.is_set():
                try:
                    c.exists_batch([b"b23-t-x", b"b23-t-y"])
                except LeaseExpired as exc:
                    reports.append(exc)
                except ServerUnavailable:
                    pass
                except BaseException as exc:     # (asserted below)
                    other.append(exc)

        t = threading.Thread(target=looker)
        t.start()
        try:
            for i in range(150):
                k, v = b"b23-t-%03d" % i, bytes([i % 251]) * (5000 + i)
                try:
                    c.put(k, v)
                    stored[k] = v
                except LeaseExpired as exc:
                    reports.append(exc)
                except ServerUnavailable:
                    pass
        finally:
            stop.set()
            t.join(60)
        monkeypatch.setattr(chmod.Channel, "request", orig)
        monkeypatch.setattr(chmod.Channel, "request_many", orig_many)
        for _ in range(3):
            try:
                c.flush()
                break
            except LeaseExpired as exc:
                reports.append(exc)
        assert not other, other
        assert seen[0] >= 14
        assert not reports, reports
        got = c.get_batch(list(stored))
        assert [g == stored[k] for k, g in zip(stored, got)] == [True] * len(stored)
        assert len(stored) > 100


def test_a_get_reply_that_cannot_be_encoded_keeps_no_view_of_the_pool(shm_name,
                                                                     monkeypatch):
    """fb05d1d: a reply _send cannot send drops its frames (views of the pool) before the
    error is logged, so the logged traceback keeps none. A reply whose header msgpack
    cannot encode (a handler's bug) took the other branch and kept them: with a log
    handler that keeps records (a buffering handler; pytest's own capture) the pool
    stayed exported and could not be closed (BufferError). Now both branches drop them:
    INTERNAL answered, pins settled, no view left while the record is kept."""
    import gc
    import logging
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_debt23 import _ThreadServer

    import kvshm.client as client_mod
    from kvshm.client import Client
    from kvshm.errors import KvshmError
    from kvshm.zmq_ctrl.protocol import Op

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    keep = Keep()
    lg = logging.getLogger("kvshm.zmq_ctrl.router")
    lg.addHandler(keep)
    monkeypatch.setattr(lg, "propagate", False)     # (kept here only: dropped below)
    monkeypatch.setattr(client_mod, "PIPELINE", False)
    ts = _ThreadServer(shm_name)
    try:
        keys = [b"b23-enc-%d" % i for i in range(2)]
        ts.store.put(keys, [b"E" * 300_000, b"F" * 300_000])
        real = ts.loop._handlers[Op.GET]

        def tampered(session, req_id, body, frames, on_sent):
            st, rb, fr = real(session, req_id, body, frames, on_sent)
            rb["x"] = {1, 2}                    # msgpack cannot encode a set
            return st, rb, fr

        ts.loop.add_ops({Op.GET: tampered})
        ts.start()
        with Client(ts.address, transport="tcp", timeout=10) as c:
            with pytest.raises(KvshmError, match="internal error"):
                c.get_batch(keys)
            assert c.stats()["pins"] == 0
            assert c.get_batch(keys[:0]) == []
        gc.collect()
        assert any("encoding the reply" in r.getMessage() for r in keep.records)
        assert ts.pool.num_views == 0, ts.pool.num_views
    finally:
        lg.removeHandler(keep)
        keep.records.clear()
        gc.collect()
        ts.close()
