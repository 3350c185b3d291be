"""break20: hostile review of shared index layout 4 (01f392d), break19's batch-probe stop
fixes (6568d9c / d525e01 / f8afcd4) and the EXISTS found-list check (7c17019). (The slot
checks follow layout 5: 64-byte slots, a meta word @8, the key @16.)"""

from __future__ import annotations

import itertools
import mmap
import struct

import posix_ipc
import pytest

from kvshm import Pool
from kvshm._shmindex import (HEADER_SIZE, KEY_MAX, MISS, SLOT_DATA, SLOT_KEY_OFFSET,
                             SLOT_META_OFFSET, SLOT_SIZE, SLOT_SIZE_MAX, IndexReader,
                             IndexWriter, default_slots)

BS = 4096
EPOCH = 20


class Table:
    def __init__(self, name: str, blocks: int = 64, slots: int = 0) -> None:
        self.pool = Pool.create(name, blocks * BS, BS)
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         slots or default_slots(blocks), epoch=EPOCH,
                                         block_size=BS, num_blocks=blocks,
                                         token=self.pool.token)
        self.reader = IndexReader(self.writer.name, self.writer.reads_name, self.pool, EPOCH)

    def close(self) -> None:
        self.reader.close()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


@pytest.fixture
def table(shm_name):
    t = Table(shm_name)
    yield t
    t.close()


KEYLENS = (1, 39, 40, 41, 56, 64, 80, 87, 88, 89, 120, 151, KEY_MAX)


def _key(n: int, tag: int) -> bytes:
    return bytes((tag * 7 + i) % 251 + 1 for i in range(n))


def _runs(ne: int, first: int) -> list[tuple[int, int]]:
    # ne runs of one block each, not adjacent (first, first+2, ...)
    return [(first + 2 * j, 1) for j in range(ne)]


def _value(tag: int, size: int) -> bytes:
    return bytes((tag + i) % 256 for i in range(size))


def _meta(s: bytes) -> int:
    return struct.unpack_from("<Q", s, SLOT_META_OFFSET)[0]


def _slot_bytes(name: str, slot: int) -> bytes:
    shm = posix_ipc.SharedMemory(name)
    m = mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ)
    shm.close_fd()
    try:
        return m[HEADER_SIZE + slot * SLOT_SIZE:HEADER_SIZE + (slot + 1) * SLOT_SIZE]
    finally:
        m.close()


def test_held_every_key_length_checksum_and_run_count_round_trips(table):
    """Keys of 1..152 bytes, with and without a checksum, in 1..8 runs: every read path
    answers the value and size written, and an overwrite of each with a different size,
    run count and checksum presence reads the new one (get, get_into, get_many_into,
    lookup, exists_batch, match_prefix); the meta word's size never holds key/run bytes."""
    w, r, p = table.writer, table.reader, table.pool
    tag = 0
    for n, has_sum, ne in itertools.product(KEYLENS, (False, True), range(1, 9)):
        tag += 1
        k = _key(n, tag)
        size = (ne - 1) * BS + 1 + tag % 97
        runs = _runs(ne, 0)
        v = _value(tag, size)
        for j, (b, _c) in enumerate(runs):
            p.write(b * BS, v[j * BS:(j + 1) * BS])
        csum = 0x0102030405060708 + tag if has_sum else None
        i = w.publish(k, size, runs, csum)
        assert i >= 0
        inline = n + 8 * ne + (8 if has_sum else 0) <= SLOT_DATA
        s = _slot_bytes(w.name, i)
        assert _meta(s) & SLOT_SIZE_MAX == size
        assert (_meta(s) >> 48) & 0xFF == n and ((_meta(s) >> 61) & 7) + 1 == ne
        assert bool((_meta(s) >> 59) & 3) == (not inline), (n, has_sum, ne)
        if inline:
            assert s[SLOT_KEY_OFFSET:SLOT_KEY_OFFSET + n] == k
        assert r.lookup(k)[1:] == (size, tuple(runs), csum)
        assert r.get(k) == v
        out = bytearray(size + 3)
        assert r.get_into(k, out) == size and bytes(out[:size]) == v
        assert r.exists_batch([k, k + b"x" if n < KEY_MAX else k[:-1]]) == [True, False]
        assert r.match_prefix([k, k]) == 2
        # overwrite: another size, run count and checksum presence
        ne2 = 9 - ne
        size2 = (ne2 - 1) * BS + 5 + tag % 13
        runs2 = _runs(ne2, 1)
        v2 = _value(tag + 1, size2)
        for j, (b, _c) in enumerate(runs2):
            p.write(b * BS, v2[j * BS:(j + 1) * BS])
        csum2 = None if has_sum else 0xFEDCBA9876543210
        assert w.publish(k, size2, runs2, csum2) == i
        assert _meta(_slot_bytes(w.name, i)) & SLOT_SIZE_MAX == size2
        assert r.lookup(k)[1:] == (size2, tuple(runs2), csum2)
        assert r.get(k) == v2
        out = bytearray(size2)
        assert r.get_into(k, out) == size2 and bytes(out) == v2
        small = bytearray(size2 - 1)
        with pytest.raises(ValueError):
            r.get_into(k, small)
        assert w.unpublish(k)
        assert r.get(k) is None and r.exists_batch([k]) == [False]


# --------------------- 7c17019: found_of on every EXISTS path, _exists1 included

@pytest.fixture(scope="module")
def server():
    from servers import ServerProcess
    srv = ServerProcess(prealloc_size=1 / 16)
    yield srv
    srv.stop()


BAD_FOUND = ([], [True, True], "x", None, {"a": 1}, (True,))


@pytest.mark.parametrize("call1", [False, True], ids=["call1-off", "call1-on"])
@pytest.mark.parametrize("bad", range(len(BAD_FOUND) + 1))
def test_single_key_exists_refuses_a_bad_found_list(server, monkeypatch, call1, bad):
    """Client.exists of one key (``_exists1``: the lean one-key path, through
    Channel.call1 or Channel.request) reads the reply's found list with found_of, as
    exists_batch does: a reply of no answer, two answers, or a found that is not a list
    (or no found at all) is ProtocolError, not IndexError/KeyError/TypeError or the
    first of two answers (failed before: ``rbody["found"][0]``)."""
    import kvshm.client as client_mod
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import ProtocolError

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    monkeypatch.setattr(client_mod, "_CALL1", call1)
    with Client(server.address, transport="tcp", timeout=10) as c:
        c.put("b20-one", b"v")
        assert c.exists("b20-one") and not c.exists("b20-none")
        body = {} if bad == len(BAD_FOUND) else {"found": BAD_FOUND[bad]}
        orig_req, orig_call1 = chmod.Channel.request, chmod.Channel.call1

        def request(self, op, *a, **k):
            r = orig_req(self, op, *a, **k)
            return (r[0], r[1], dict(body), r[3]) if op == Op.EXISTS else r

        def fake_call1(self, kind, op, *a, **k):
            r = orig_call1(self, kind, op, *a, **k)
            return (0, dict(body), []) if op == Op.EXISTS else r

        from kvshm.zmq_ctrl.protocol import Op
        monkeypatch.setattr(chmod.Channel, "request", request)
        monkeypatch.setattr(chmod.Channel, "call1", fake_call1)
        with pytest.raises(ProtocolError):
            c.exists("b20-one")
        monkeypatch.setattr(chmod.Channel, "request", orig_req)
        monkeypatch.setattr(chmod.Channel, "call1", orig_call1)
        assert c.exists("b20-one") and not c.exists("b20-none")


@pytest.mark.parametrize("bad", range(len(BAD_FOUND) + 1))
def test_held_async_exists_refuses_a_bad_found_list(server, monkeypatch, bad):
    """(held) AsyncClient.exists / exists_batch: found_of on the one request."""
    import asyncio

    import kvshm.aio as aio
    from kvshm.aio import AsyncClient
    from kvshm.errors import ProtocolError
    from kvshm.zmq_ctrl.protocol import Op

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    body = {} if bad == len(BAD_FOUND) else {"found": BAD_FOUND[bad]}
    conn = next(v for v in vars(aio).values() if isinstance(v, type)
                and "request" in vars(v) and asyncio.iscoroutinefunction(vars(v)["request"]))
    orig = conn.request

    async def run():
        async with AsyncClient(server.address, transport="tcp", timeout=10) as c:
            await c.put("b20-a", b"v")
            assert await c.exists_batch(["b20-a", "b20-z"]) == [True, False]

            async def request(self, op, *a, **k):
                r = await orig(self, op, *a, **k)
                return (r[0], dict(body), r[2]) if op == Op.EXISTS else r

            monkeypatch.setattr(conn, "request", request)
            for keys in (["b20-a"], ["b20-a", "b20-z", "b20-y"]):
                with pytest.raises(ProtocolError):
                    await c.exists_batch(keys)
            with pytest.raises(ProtocolError):
                await c.exists("b20-a")
            monkeypatch.setattr(conn, "request", orig)
            assert await c.exists_batch(["b20-a", "b20-z"]) == [True, False]

    asyncio.run(run())


@pytest.mark.parametrize("bad", range(len(BAD_FOUND) + 1))
@pytest.mark.parametrize("part", [0, 2, 4], ids=["first", "middle", "last"])
def test_held_pipelined_exists_refuses_a_bad_found_in_any_part(server, monkeypatch, bad,
                                                               part):
    """(held) a pipelined exists_batch (parts of 64 keys, the last of 44) whose part
    ``part`` has a bad found (too short, too long, not a list, none): ProtocolError, and
    the client answers right afterwards."""
    import kvshm.client as client_mod
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import ProtocolError
    from kvshm.zmq_ctrl.protocol import Op

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    monkeypatch.setattr(client_mod, "PIPELINE", True)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 64)
    keys = [f"b20p-{i:04d}".encode() for i in range(300)]
    body = {} if bad == len(BAD_FOUND) else {"found": BAD_FOUND[bad]}
    with Client(server.address, transport="tcp", timeout=10) as c:
        c.put_batch(keys[::3], [b"v"] * 100)
        want = [i % 3 == 0 for i in range(300)]
        assert c.exists_batch(keys) == want
        orig_many = chmod.Channel.request_many
        seen = []

        def many(self, reqs, *a, **k):
            rs = list(orig_many(self, reqs, *a, **k))
            if len(rs) == 5:
                seen.append(1)
                r = rs[part]
                rs[part] = (r[0], r[1], dict(body), r[3])
            return rs

        monkeypatch.setattr(chmod.Channel, "request_many", many)
        with pytest.raises(ProtocolError):
            c.exists_batch(keys)
        assert seen
        monkeypatch.setattr(chmod.Channel, "request_many", orig_many)
        assert c.exists_batch(keys) == want


# ------------- break19's _stopped: holds and misses at every piece/segment edge

def test_held_holds_and_misses_at_every_piece_and_segment_edge(shm_name):
    """(held) With 1, 2, 3 and 4 threads and one key at a time: a slot held in a write
    (odd version) and/or an absent key at each piece's/segment's last key, the next
    piece's first key and the one after, alone and side by side (a miss then a hold,
    a hold then a miss): exists_batch answers None or exactly the truth; match_prefix
    FALLBACK or exactly the truth (a miss before a hold may be answered)."""
    import sys as _sys
    _sys.path.insert(0, __import__("os").path.dirname(__file__))
    from kvshm._shmindex import BATCH_SEGMENT, FALLBACK
    from test_break19 import _hold
    from test_localx_threads import PIECE, Tables

    from test_localx_threads import EPOCH as TEPOCH

    t = Tables(shm_name, blocks=32768, initial=4096)
    try:
        three = IndexReader(t.writer.name, t.writer.reads_name, t.pool, TEPOCH)
        three.batch_threads = 3
        three.threads_min = 1
        t.readers["three"] = three
        n = 2 * BATCH_SEGMENT + 700
        keys = [b"edge-%08d" % i for i in range(n)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i, 1)]) >= 0
        shm = posix_ipc.SharedMemory(t.writer.name)
        m = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        edges = sorted({e + d for e in range(PIECE, n, PIECE) for d in (-1, 0, 1)})
        wrong = []
        fell = 0
        try:
            for at in edges:
                for kind in ("hold", "miss", "miss+hold", "hold+miss"):
                    asked = list(keys)
                    holds = []
                    if kind == "miss":
                        asked[at] = b"absent-%d" % at
                    elif kind == "miss+hold":
                        asked[at] = b"absent-%d" % at
                        holds = [at + 1]
                    elif kind == "hold+miss":
                        holds = [at]
                        asked[at + 1] = b"absent-%d" % at
                    else:
                        holds = [at]
                    truth = [not k.startswith(b"absent") for k in asked]
                    prefix = truth.index(False) if False in truth else n
                    held = [_hold(m, t.readers["one"], asked[h]) for h in holds]
                    try:
                        for label, r in t.readers.items():
                            got = r.exists_batch(asked)
                            fell += got is None
                            if got is not None and got != truth:
                                wrong.append((label, at, kind, "exists"))
                            if got is None and not holds:
                                wrong.append((label, at, kind, "exists None"))
                            mp = r.match_prefix(asked)
                            if mp != FALLBACK and mp != prefix:
                                wrong.append((label, at, kind, "mp", mp, prefix))
                            if mp == FALLBACK and (not holds or holds[0] > prefix):
                                wrong.append((label, at, kind, "mp fallback"))
                    finally:
                        for where, version in held:
                            struct.pack_into("<Q", m, where, version)
        finally:
            m.close()
        assert wrong == [] and fell >= len(edges) * 3 * len(t.readers)
    finally:
        t.close()


@pytest.mark.parametrize("bad", range(len(BAD_FOUND) + 1))
def test_a_pin_reply_with_a_bad_found_list_makes_no_handoff(server, monkeypatch, bad):
    """Client.pin (handoff.op_pin) took ``zip(keys, body["found"])``: a PIN reply with
    fewer answers than keys left the keys past its end out of ``missing``, so a Handoff
    was made for keys the server never said it holds (and a longer list, a non-list or
    none: a Handoff or KeyError/TypeError). Now ProtocolError, as for EXISTS (failed
    before)."""
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from kvshm.errors import ProtocolError
    from kvshm.zmq_ctrl.protocol import Op

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    keys = [b"b20-pin-%d" % i for i in range(3)]
    body = {} if bad == len(BAD_FOUND) else {"found": BAD_FOUND[bad]}
    with Client(server.address, transport="tcp", timeout=10) as c:
        c.put_batch(keys, [b"v"] * 3)
        c.unpin(c.pin(keys, 30))
        orig = chmod.Channel.request

        def request(self, op, *a, **k):
            r = orig(self, op, *a, **k)
            if op == Op.PIN:
                rb = dict(r[2])
                rb.pop("found", None)
                rb.update(body)
                return (r[0], r[1], rb, r[3])
            return r

        monkeypatch.setattr(chmod.Channel, "request", request)
        with pytest.raises(ProtocolError):
            c.pin(keys, 30)
        monkeypatch.setattr(chmod.Channel, "request", orig)
        c.unpin(c.pin(keys, 30))


BAD_N = (4, -1, "2", None, True, 2.0, [1])


@pytest.mark.parametrize("bad", range(len(BAD_N) + 1))
def test_a_match_prefix_reply_past_the_keys_asked_is_refused(server, monkeypatch, bad):
    """Client/AsyncClient.match_prefix returned the reply's ``n`` as it came: a count
    past the keys asked (4 of 3: a connector would count tokens never asked about as
    cached), negative, or not an int (or none: KeyError). Now ProtocolError (prefix_of),
    as found_of for EXISTS (failed before)."""
    import asyncio

    import kvshm.aio as aio
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.aio import AsyncClient
    from kvshm.client import Client
    from kvshm.errors import ProtocolError
    from kvshm.zmq_ctrl.protocol import Op

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    keys = [b"b20-mp-%d" % i for i in range(3)]
    body = {} if bad == len(BAD_N) else {"n": BAD_N[bad]}
    with Client(server.address, transport="tcp", timeout=10) as c:
        c.put_batch(keys[:2], [b"v"] * 2)
        assert c.match_prefix(keys) == 2
        orig = chmod.Channel.request

        def request(self, op, *a, **k):
            r = orig(self, op, *a, **k)
            return (r[0], r[1], dict(body), r[3]) if op == Op.MATCH_PREFIX else r

        monkeypatch.setattr(chmod.Channel, "request", request)
        with pytest.raises(ProtocolError):
            c.match_prefix(keys)
        monkeypatch.setattr(chmod.Channel, "request", orig)
        assert c.match_prefix(keys) == 2

    conn = aio._Conn
    aorig = conn.request

    async def run():
        async with AsyncClient(server.address, transport="tcp", timeout=10) as a:
            assert await a.match_prefix(keys) == 2

            async def arequest(self, op, *x, **k):
                r = await aorig(self, op, *x, **k)
                return (r[0], dict(body), r[2]) if op == Op.MATCH_PREFIX else r

            monkeypatch.setattr(conn, "request", arequest)
            with pytest.raises(ProtocolError):
                await a.match_prefix(keys)
            monkeypatch.setattr(conn, "request", aorig)
            assert await a.match_prefix(keys) == 2

    asyncio.run(run())


_READER = r'''
import sys, struct
from kvshm import Pool
from kvshm._shmindex import IndexReader, FALLBACK, MISS
name, epoch, n_iter = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
keys = [bytes.fromhex(h) for h in sys.argv[4].split(",")]
pool = Pool.attach(name) if hasattr(Pool, "attach") else Pool.open(name)
r = IndexReader(name + "-index", name + "-reads", pool, epoch)
seen = bad = 0
buf = bytearray(9 * 4096)
def ok(v):
    size, tag = struct.unpack_from("<II", v, 0)
    return len(v) == size and v == struct.pack("<II", size, tag) + bytes([tag % 256]) * (size - 8)
for it in range(n_iter):
    for k in keys:
        v = r.get(k)
        if type(v) is int and v == FALLBACK:   # kept changing over its tries: ask the server
            pass
        elif v is not None:
            seen += 1
            bad += not ok(v)
        n = r.get_into(k, buf)
        if n >= 0:
            seen += 1
            bad += not ok(bytes(buf[:n]))
        elif n == MISS:
            bad += 1                      # always present: never a miss
        t = r.lookup(k)
        if t is not None and t is not FALLBACK and not isinstance(t, int):
            size, runs = t[1], t[2]
            bad += not (sum(c for _, c in runs) * 4096 >= size > (sum(c for _, c in runs) - 1) * 4096)
    ex = r.exists_batch(keys)
    bad += ex is not None and not all(ex)
    mp = r.match_prefix(keys)
    bad += mp != FALLBACK and mp != len(keys)
print(seen, bad)
'''


@pytest.mark.parametrize("churn", [False, True], ids=["still", "growth+rebuild"])
def test_held_sizes_and_values_read_in_another_process_during_overwrites(shm_name, churn):
    """(held) One process republishes keys of 40/41/80/88/89/120 bytes over and over
    between alternatives of other sizes, run counts (1..8) and checksum presence (so an
    80-byte key moves inline -> wide); a reader process's get / get_into / lookup always
    answer one whole alternative (its size word @120 read under the seqlock) or none,
    never a miss, exists_batch/match_prefix never a miss; with ``churn`` other keys are
    published and unpublished meanwhile (the table grows from 4096 slots and is rebuilt
    for its tombstones)."""
    import subprocess
    import sys as _sys

    t = Table(shm_name, blocks=16384 if churn else 1024)
    try:
        lens = (40, 41, 80, 88, 89, 120)
        keys = [_key(n, n) for n in lens]
        alts = []             # per key: [(size, runs, csum)]
        block = 0
        for ki, k in enumerate(keys):
            mine = []
            for ai, (ne, has_sum) in enumerate(((1, False), (3, True), (8, True), (2, False),
                                                (8, False), (1, True))):
                tag = ki * 16 + ai + 1
                size = (ne - 1) * 4096 + 100 + 37 * ai
                v = struct.pack("<II", size, tag) + bytes([tag % 256]) * (size - 8)
                runs = [(block + j, 1) for j in range(ne)]
                block += ne
                for j, (b, _c) in enumerate(runs):
                    t.pool.write(b * BS, v[j * BS:(j + 1) * BS])
                mine.append((size, runs, tag if has_sum else None))
            alts.append(mine)
            t.writer.publish(k, *mine[0][:2], mine[0][2])
        env = dict(__import__("os").environ)
        p = subprocess.Popen([_sys.executable, "-c", _READER, shm_name, str(EPOCH), "300",
                              ",".join(k.hex() for k in keys)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        i = 0
        while p.poll() is None:
            for ki, k in enumerate(keys):
                size, runs, csum = alts[ki][i % len(alts[ki])]
                assert t.writer.publish(k, size, runs, csum) >= 0
            if churn:
                for j in range(40):
                    t.writer.publish(b"churn-%09d" % (i * 40 + j), 10, [(0, 1)])
                    if i >= 120:
                        t.writer.unpublish(b"churn-%09d" % ((i - 120) * 40 + j))
            i += 1
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()[-2000:]
        seen, bad = map(int, out.split())
        assert bad == 0 and seen > 0 and i > 10
        assert not churn or t.writer.nslots > 4096          # it grew
    finally:
        t.close()


def test_held_an_empty_or_over_long_key_is_refused_and_every_read_falls_back(table):
    """(held) A key of 0 bytes or past KEY_MAX (153, 1000) is not published (-1, counted
    unpublished), and every read of it says FALLBACK (exists_batch None): never a miss
    that would hide a value the server holds."""
    from kvshm._shmindex import FALLBACK
    w, r = table.writer, table.reader
    for k in (b"", b"x" * (KEY_MAX + 1), b"y" * 1000):
        assert w.publish(k, 10, [(0, 1)]) == -1
        assert r.get(k) == FALLBACK and r.lookup(k) == FALLBACK
        assert r.get_into(k, bytearray(100)) == FALLBACK
        assert r.exists_batch([k, b"a"]) is None and r.match_prefix([k, b"a"]) == FALLBACK
    assert w.unpublished == 3
