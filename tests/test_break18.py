"""break18: attacks on the work merged to main at 03:00-03:50 UTC (gcpause2's decoder
without a reference cycle, tcpbatch's pipelined exists_batch / Channel.request_many /
pack_keys_request, debt's server no-reply fixes and the write-behind/lazy-commit
reporting). Each finding's test failed before its fix; the others held."""

from __future__ import annotations

import os
import signal

import pytest

import kvshm.client as client_mod
from kvshm import Client
from kvshm.errors import LeaseExpired, ServerUnavailable
from kvshm.zmq_ctrl.protocol import Op
from servers import ServerProcess
from test_faults import free_port


@pytest.mark.parametrize("pipeline", [False, True], ids=["one", "pipelined"])
def test_pipelined_exists_after_restart_reports_lazy_commits_lost(monkeypatch, pipeline):
    """Lazy COMMITs ride on the first part of a pipelined exists_batch; a new server on
    the same port (new epoch) answers it STALE_EPOCH, so no server applied them. As for
    the one request (_roundtrip, 31012e6), the next call must raise LeaseExpired for
    those puts (before: _roundtrip_many requeued them without ``unapplied``: dropped,
    flush() passed and the keys were silently missing)."""
    monkeypatch.setattr(client_mod, "IDLE_FLUSH_S", 3600.0)
    monkeypatch.setattr(client_mod, "PIPELINE", pipeline)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    # exists_batch through the server (the same-host index would answer it here)
    monkeypatch.setattr(client_mod.localread, "fits", lambda keys, limits: False)
    port = free_port()
    srv = ServerProcess(service_port=port, prealloc_size=1 / 64)
    srv2 = None
    c = None
    try:
        c = Client(srv.address, lazy_commit=True, transport="shm", timeout=5)
        c.put("before", b"x" * 100)
        c.flush()
        for i in range(3):
            c.put(f"after{i}", bytes([i]) * 9000)      # COMMIT queued (lazy)
        assert c._session.commits
        srv.kill()
        srv.remove_segment()
        srv2 = ServerProcess(service_port=port, prealloc_size=1 / 64)
        keys = [f"probe{i}".encode() for i in range(1000)]
        seen: list[BaseException] = []
        for _ in range(10):
            try:
                assert c.exists_batch(keys) == [False] * 1000
                break
            except (LeaseExpired, ServerUnavailable) as exc:
                seen.append(exc)
        for _ in range(10):
            try:
                c.flush()
                break
            except (LeaseExpired, ServerUnavailable) as exc:
                seen.append(exc)
        with Client(srv2.address, transport="tcp") as other:
            stored = [other.exists(f"after{i}") for i in range(3)]
        assert stored == [False] * 3
        assert any(isinstance(e, LeaseExpired) for e in seen), seen
    finally:
        if c is not None:
            c.close()
        srv.kill()
        srv.remove_segment()
        if srv2 is not None:
            srv2.stop()


# --------------------------------------------- gcpause2: RequestDecoder's static walk

def _dec_all(frame, budget):
    from kvshm.zmq_ctrl.protocol import DecodeError, RequestDecoder
    try:
        d = RequestDecoder(frame)
        for _ in range(len(frame) + 10):
            r = d.step(budget)
            if r is not None:
                assert d.step(budget) == r          # asked twice: the same result
                return ("ok", r)
        raise AssertionError("never done")
    except DecodeError:
        return ("err", None)


def _one_go(frame):
    from kvshm.zmq_ctrl.protocol import DecodeError, decode_request
    try:
        return ("ok", decode_request(frame))
    except DecodeError:
        return ("err", None)


def test_decoder_every_prefix_and_budget_matches_decode_request():
    """(held) A header with runs of plain items (the _scan_plain fast run) and not-plain
    ones, cut at every byte (each prefix) and decoded a budget of 1, 3, 17, 300 at a
    time: decoded or refused exactly as decode_request decodes or refuses it."""
    import msgpack

    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION
    keys = [b"k%03d" % i for i in range(40)] + ["s\u00e9", 7, -1, 2 ** 63, None, [b"x"]]
    frame = msgpack.packb([PROTOCOL_VERSION, 5, 99, 3,
                           {"keys": keys, "sizes": list(range(300)), "x": {"a": 1}}],
                          use_bin_type=True)
    for budget in (1, 3, 17, 300):
        assert _dec_all(frame, budget) == _one_go(frame)
    for cut in range(len(frame)):
        want = _one_go(frame[:cut])
        assert want[0] == "err"
        for budget in (1, 17):
            assert _dec_all(frame[:cut], budget) == want, (cut, budget)
    assert _dec_all(frame + b"\x00", 5) == ("err", None)


@pytest.mark.parametrize("how", ["abandoned", "error", "done"])
def test_decoder_freed_without_a_collection(how):
    """(held) With the collector off, a decoder abandoned mid-walk (its client gone), one
    that raised mid-walk, or one done, is freed with its generator and body by
    reference counting alone."""
    import gc
    import weakref

    import msgpack

    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, DecodeError, RequestDecoder
    body = {"keys": [b"key-%05d" % i for i in range(5000)]}
    if how == "error":
        body["sizes"] = list(range(100)) + [{1: 2}]   # an int map key: refused
    frame = msgpack.packb([PROTOCOL_VERSION, 5, 1, 1, body], use_bin_type=True)
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        d = RequestDecoder(frame)
        g = weakref.ref(d._gen)
        if how == "abandoned":
            assert d.step(1000) is None
        elif how == "error":
            with pytest.raises(DecodeError):
                while d.step(1000) is None:
                    pass
        else:
            while d.step(1000) is None:
                pass
        del d
        assert g() is None
    finally:
        if was:
            gc.enable()


# ------------------------------------------- debt: Pool copies read what they checked

_GROUPS = r"""
import sys
from kvshm._pool import Pool

name = sys.argv[1]
p = Pool.create(name, 64 * 4096, 4096)
try:
    p.write(0, b"a" * 4096)
    p.write(4096, b"b" * 4096)

    class Counts(list):
        # checked as [1, 1]; read again for the copies as [2, 0]: the first group's
        # bytes object (1 range, 4 KiB) would get 2 ranges copied into it
        calls = 0

        def __getitem__(self, j):
            Counts.calls += 1
            v = list.__getitem__(self, j)
            return v if Counts.calls <= len(self) else [2, 0][j]

    offs, sizes = [0, 4096], [4096, 4096]
    for _ in range(200):
        Counts.calls = 0
        out = p.read_groups(offs, sizes, Counts([1, 1]))
        assert out == [b"a" * 4096, b"b" * 4096], [len(o) for o in out]
    print("ok", flush=True)
finally:
    p.close()
    p.unlink()
"""


def test_read_groups_copies_the_counts_it_checked(shm_name):
    """Pool.read_groups checked each group's ranges against ``counts`` (a caller's
    sequence, read again item by item for the copies, with the GIL released between
    groups: another thread may change it), then copied by what it read the second time:
    a count that grew meanwhile copied past the end of the group's bytes object (heap
    overflow) and read offsets past the private copy (as 2b7fbdc fixed for offsets and
    sizes). It must copy what it checked."""
    import subprocess
    import sys
    try:
        r = subprocess.run([sys.executable, "-c", _GROUPS, shm_name],
                           capture_output=True, text=True, timeout=120)
    finally:
        if os.path.exists("/dev/shm/" + shm_name):     # (the child crashed)
            os.unlink("/dev/shm/" + shm_name)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


# ------------------------------------------ tcpbatch: Channel.request_many, odd servers

# A ROUTER taking N requests, then: "dup" answers each twice (last first) plus a reply
# with an id none of them has; "early" answers the last first, then the others in order,
# each preceded by a stray copy of the last one's reply. Then it answers one more
# request (the next call on the same channel), once.
_FAKE2 = r"""
import sys, msgpack, zmq
mode, n = sys.argv[1], int(sys.argv[2])
s = zmq.Context().socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
got = []
while len(got) < n:
    m = s.recv_multipart()
    v, op, rid, epoch, body = msgpack.unpackb(m[1], raw=False)
    got.append((m[0], rid, body["keys"]))
def answer(ident, rid, keys):
    body = {"found": [k.endswith(b"1") for k in keys]}
    s.send_multipart([ident, msgpack.packb([v, 0, rid, body], use_bin_type=True)])
if mode == "dup":
    for g in reversed(got):
        answer(*g)
        answer(*g)
    answer(got[0][0], 10 ** 9, [b"zz"])
elif mode == "early":
    answer(*got[-1])
    for g in got[:-1]:
        answer(*got[-1])
        answer(*g)
m = s.recv_multipart()
v, op, rid, epoch, body = msgpack.unpackb(m[1], raw=False)
answer(m[0], rid, body["keys"])
import time; time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["dup", "early"])
@pytest.mark.parametrize("zmtp_on", [False, True], ids=["libzmq", "zmtp"])
def test_request_many_duplicate_and_stray_replies(monkeypatch, mode, zmtp_on):
    """(held) Replies duplicated, a stray id, the last part answered first and again
    between the others: each part gets its own reply once, the extra ones go to
    on_stray, and the channel's next request gets its own reply (not a left-over)."""
    import subprocess
    import sys

    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.zmq_ctrl.channel import Channel

    if zmtp_on and not chmod.ZMTP:
        pytest.skip("no ZMTP transport")
    monkeypatch.setattr(chmod, "ZMTP", zmtp_on)
    keys = [f"key-{i:03d}".encode() for i in range(40)]
    parts = [keys[i:i + 10] for i in range(0, 40, 10)]
    p = subprocess.Popen([sys.executable, "-c", _FAKE2, mode, str(len(parts))],
                         stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        ch = Channel(f"tcp://127.0.0.1:{port}", 10.0)
        try:
            stray: list[int] = []
            ch.on_stray = lambda rid, st, body: stray.append(rid)
            reqs = [(Op.EXISTS, {"keys": q}, (), ch.new_id()) for q in parts]
            with ch.lock:
                got = ch.request_many(reqs)
                assert [g[0] for g in got] == [r[3] for r in reqs]
                assert [g[2]["found"] for g in got] == [
                    [k.endswith(b"1") for k in q] for q in parts]
                rid = ch.new_id()
                r = ch.request(Op.EXISTS, {"keys": [b"x1", b"y"]}, req_id=rid)
            assert (r[0], r[2]["found"]) == (rid, [True, False])
            want = ([r[3] for r in reversed(reqs)] + [10 ** 9] if mode == "dup"
                    else [reqs[-1][3]] * (len(parts) - 1))
            assert sorted(stray) == sorted(want)
        finally:
            ch.close()
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


# --------------------------- tcpbatch: one client shared by threads, pipelining on

@pytest.fixture(scope="module")
def shared_server():
    srv = ServerProcess(prealloc_size=1 / 4)
    yield srv
    srv.stop()


@pytest.mark.parametrize("where", ["tcp", "ipc"])
@pytest.mark.parametrize("impl", ["zmtp", "libzmq"])
def test_threads_share_one_pipelining_client(shared_server, monkeypatch, where, impl):
    """(held) tests/test_threads_shared_client.py's run (workers checking every answer,
    server pauses, delays inside the lock) with pipelining on and parts of 2 keys (each
    exists_batch of 4-8 keys pipelined), plus a victim thread whose pipelined
    exists_batch calls get a 1 ms deadline (they time out while their parts' replies are
    still to come): no other thread's call fails or gets another's answer."""
    import threading

    import kvshm.zmq_ctrl.channel as chmod
    import test_threads_shared_client as T
    from kvshm.errors import KvshmError

    if impl == "zmtp" and not chmod.ZMTP:
        pytest.skip("no ZMTP transport")
    monkeypatch.setattr(chmod, "ZMTP", impl == "zmtp")
    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    monkeypatch.setattr(client_mod, "PIPELINE", True)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 2)
    victims: set[int] = set()
    real_many = chmod.Channel.request_many
    pipelined = [0, 0]

    def many(self, reqs, **kw):
        pipelined[0] += 1
        if threading.get_ident() in victims:
            old = self._slice_ms
            self._slice_ms = 1
            kw["timeout"] = 0.001
            try:
                return real_many(self, reqs, **kw)
            finally:
                self._slice_ms = old
        return real_many(self, reqs, **kw)

    monkeypatch.setattr(chmod.Channel, "request_many", many)

    def victim(c, stop, seen):
        victims.add(threading.get_ident())
        i = 0
        while not stop.is_set():
            i += 1
            keys = [f"victim-{(i + j) % 16}".encode() for j in range(8)]
            try:
                if i % 3 == 0:
                    c.put_batch(keys[:2], [b"v" * 3000, b"w" * 70000])
                else:
                    c.exists_batch(keys)
            except ServerUnavailable:
                seen[0] += 1
            except KvshmError:
                pass

    monkeypatch.setattr(T, "_victim", victim)
    if where == "tcp":
        c = Client(shared_server.address, transport="tcp", timeout=T.SAFE_TIMEOUT)
    else:
        c = Client(shared_server.ipc, timeout=T.SAFE_TIMEOUT)
    try:
        errors = T._run(c, lambda f: f(c), shared_server, monkeypatch, victim=True)
        assert not errors, "\n".join(errors[:20])
        assert pipelined[0] > 0
        keys = [f"after-{i}".encode() for i in range(9)]
        c.put_batch(keys[::2], [b"x"] * 5)
        assert c.exists_batch(keys) == [i % 2 == 0 for i in range(9)]
    finally:
        monkeypatch.undo()
        c.close()


def test_pipelined_exists_stale_middle_part_goes_again(shared_server, monkeypatch):
    """(held) A middle part answered STALE_EPOCH (the session forgotten between two
    parts, injected on the replies): after a HELLO only that part goes again, and the
    answer is the one request's, in key order; lazily committed puts riding on the
    first part are stored (the first part was answered)."""
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.zmq_ctrl.protocol import Status

    monkeypatch.setattr(client_mod, "PIPELINE", True)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    monkeypatch.setattr(client_mod.localread, "fits", lambda keys, limits: False)
    monkeypatch.setattr(client_mod, "IDLE_FLUSH_S", 3600.0)
    real_many = chmod.Channel.request_many
    calls: list[int] = []

    def many(self, reqs, **kw):
        got = real_many(self, reqs, **kw)
        calls.append(len(reqs))
        if len(calls) == 1:
            got[2] = (got[2][0], Status.STALE_EPOCH, {"error": "forgot"}, [])
        return got

    monkeypatch.setattr(chmod.Channel, "request_many", many)
    with Client(shared_server.address, lazy_commit=True, timeout=10) as c:
        keys = [f"stale-mid-{i}".encode() for i in range(1000)]
        c.put_batch(keys[::7], [b"v"] * len(keys[::7]))
        c.flush()
        c.put(b"stale-mid-lazy", b"w" * 9000)          # its COMMIT rides on part 0
        assert c._session.commits
        got = c.exists_batch(keys)
        assert got == [i % 7 == 0 for i in range(1000)]
        assert calls == [10, 1]
        c.flush()
        with Client(shared_server.address, transport="tcp") as other:
            assert other.get(b"stale-mid-lazy") == b"w" * 9000


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pipelined_exists_server_killed_mid_pipeline(monkeypatch, transport):
    """(held) The server SIGKILLed once the first part's reply came (the others still to
    come): the call ends in ServerUnavailable (ServerGone on the same host) at its
    timeout, never a wrong answer; a new server on the same port then answers the
    client's next call; nothing left in /dev/shm."""
    import kvshm.zmq_ctrl.channel as chmod

    monkeypatch.setattr(client_mod, "PIPELINE", True)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    monkeypatch.setattr(client_mod.localread, "fits", lambda keys, limits: False)
    port = free_port()
    srv = ServerProcess(service_port=port)
    srv2 = None
    real_stray = chmod.Channel._stray
    armed = [False]

    def stray(self, rid, status, rbody, msg):
        if armed[0] and self._want is not None:
            armed[0] = False
            srv.kill()
            srv.proc.wait()
        return real_stray(self, rid, status, rbody, msg)

    monkeypatch.setattr(chmod.Channel, "_stray", stray)
    keys = [f"kill-{i}".encode() for i in range(5000)]
    try:
        with Client(srv.address, transport=transport, timeout=2.0) as c:
            c.put_batch(keys[:10], [b"v"] * 10)
            armed[0] = True
            try:
                got = c.exists_batch(keys)
            except ServerUnavailable:
                pass
            else:   # (every reply came before the kill took: then it is right)
                assert got == [True] * 10 + [False] * 4990
            assert not armed[0]
            srv.remove_segment()
            srv2 = ServerProcess(service_port=port)
            for _ in range(5):
                try:
                    got = c.exists_batch(keys)
                    break
                except ServerUnavailable:
                    continue
            assert got == [False] * 5000
    finally:
        srv.kill()
        srv.remove_segment()
        if srv2 is not None:
            srv2.stop()


def test_pipelined_exists_interrupted_while_packing_keeps_lazy_commits(shared_server,
                                                                         monkeypatch):
    """An exception while the parts are packed (a KeyboardInterrupt, a MemoryError),
    after the first part took the queued settles (lazy COMMITs) and before anything was
    sent: the settles must go again with the next request (before: dropped with the
    unsent first part, the lazily committed put was never stored and never reported)."""
    monkeypatch.setattr(client_mod, "PIPELINE", True)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    monkeypatch.setattr(client_mod.localread, "fits", lambda keys, limits: False)
    monkeypatch.setattr(client_mod, "IDLE_FLUSH_S", 3600.0)
    real_header = client_mod._KeysPart.header
    armed = [True]

    def header(self, op, rid, epoch):
        if armed[0] and self.start >= 200:
            armed[0] = False
            raise KeyboardInterrupt
        return real_header(self, op, rid, epoch)

    monkeypatch.setattr(client_mod._KeysPart, "header", header)
    with Client(shared_server.address, lazy_commit=True, timeout=10) as c:
        keys = [f"intr-{i}".encode() for i in range(1000)]
        c.put(b"intr-lazy", b"z" * 9000)
        assert c._session.commits
        sent = c._chan.sent
        with pytest.raises(KeyboardInterrupt):
            c.exists_batch(keys)
        assert c._chan.sent == sent          # nothing went out
        try:
            c.flush()
        except LeaseExpired:
            pytest.fail("reported lost, but nothing was sent: it can be committed")
        with Client(shared_server.address, transport="tcp") as other:
            assert other.get(b"intr-lazy") == b"z" * 9000
        assert c.exists_batch(keys) == [False] * 1000


def test_pack_keys_request_declines_what_it_cannot_pack_exactly(shared_server, monkeypatch):
    """(held) pack_keys_request declines (None) a part holding a bytes subclass or a str
    (msgpack's path then packs it, or raises), whatever start/stop clamp to; and a batch
    of bytes-subclass keys gets the same answer or error with pipelining on and off."""
    import msgpack

    from kvshm.zmq_ctrl import _batchq

    class B(bytes):
        pass

    keys = [b"a", B(b"b"), "c", b"d"]
    assert _batchq.pack_keys_request(3, 1, 2, 3, keys, 0, 1) == msgpack.packb(
        [3, 1, 2, 3, {"keys": [b"a"]}], use_bin_type=True)
    for a, b in [(0, 2), (1, 2), (2, 3), (0, -1), (-5, 100)]:
        assert _batchq.pack_keys_request(3, 1, 2, 3, keys, a, b) is None, (a, b)
    assert _batchq.pack_keys_request(3, 1, 2, 3, keys, 3, 100) is not None
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    with Client(shared_server.address, transport="tcp") as c:
        ks = [B(b"sub-%d" % i) for i in range(500)]
        out = []
        for on in (False, True):
            monkeypatch.setattr(client_mod, "PIPELINE", on)
            try:
                out.append(c.exists_batch(ks))
            except Exception as exc:  # noqa: BLE001 - compared
                out.append((type(exc), str(exc)))
        assert out[0] == out[1]


def test_pipelined_exists_with_write_behind_in_flight(shared_server, monkeypatch):
    """(held) A write-behind client's PLACE replies still to come (they reach
    late_reply as strays while a pipelined exists_batch waits for its parts): the batch
    answers every key written (own or the server's), no PLACE reply is taken for a part
    nor a part's for a PLACE, and flush() then passes with everything stored."""
    monkeypatch.setattr(client_mod, "PIPELINE", True)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 50)
    monkeypatch.setattr(client_mod.localread, "fits", lambda keys, limits: False)
    with Client(shared_server.address, write_behind=True, timeout=10) as c:
        assert c._session.wb is not None
        keys = [f"wbpipe-{i}".encode() for i in range(600)]
        for i, k in enumerate(keys[:300]):
            c.put(k, bytes([i % 251]) * (100 + i))
            if i % 50 == 49:
                assert c.exists_batch(keys) == [j <= i for j in range(600)]
        c.flush()
        assert c.exists_batch(keys) == [j < 300 for j in range(600)]
        with Client(shared_server.address, transport="tcp") as other:
            got = other.get_batch(keys[:300])
        assert got == [bytes([i % 251]) * (100 + i) for i in range(300)]


# ------------------------- the lead: an EXISTS reply's found list of the wrong length

def test_found_of_checks_the_length_and_type():
    """found_of takes exactly n answers, else ProtocolError (never shifted answers)."""
    from kvshm.client import found_of
    from kvshm.errors import ProtocolError

    assert found_of({"found": [True, False]}, 2) == [True, False]
    for body in ({"found": [True]}, {"found": [True, False, True]}, {"found": None},
                 {"found": (True, False)}, {}, None, [True, False]):
        with pytest.raises(ProtocolError):
            found_of(body, 2)


@pytest.mark.parametrize("pipeline", [False, True], ids=["one-request", "pipelined"])
def test_exists_batch_refuses_a_found_list_of_the_wrong_length(shared_server, monkeypatch,
                                                               pipeline):
    """A server whose EXISTS reply (or one pipelined part's) has one answer too few
    gives ProtocolError, not a list whose answers sit on other keys (break18's open
    item: the reply length was not checked)."""
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.errors import ProtocolError

    monkeypatch.setattr(client_mod, "PIPELINE", pipeline)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 64)
    keys = [f"fl-{i:04d}".encode() for i in range(300)]
    with Client(shared_server.address, transport="tcp", timeout=10) as c:
        c.put_batch(keys[::2], [b"v"] * 150)
        want = [i % 2 == 0 for i in range(300)]
        assert c.exists_batch(keys) == want
        orig1, orig_many = chmod.Channel.request, chmod.Channel.request_many

        def cut(r):
            if isinstance(r, tuple) and len(r) > 2 and isinstance(r[2], dict) \
                    and isinstance(r[2].get("found"), list) and len(r[2]["found"]) > 1:
                r[2]["found"] = r[2]["found"][1:]
            return r

        monkeypatch.setattr(chmod.Channel, "request",
                            lambda self, *a, **k: cut(orig1(self, *a, **k)))
        monkeypatch.setattr(chmod.Channel, "request_many",
                            lambda self, *a, **k: [cut(r) for r in orig_many(self, *a, **k)])
        with pytest.raises(ProtocolError):
            c.exists_batch(keys)
        monkeypatch.setattr(chmod.Channel, "request", orig1)
        monkeypatch.setattr(chmod.Channel, "request_many", orig_many)
        assert c.exists_batch(keys) == want
