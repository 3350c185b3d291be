"""break19: attacks on the batch lookups split over helper threads (kvshm/_shmindex.pyx,
``IndexReader.batch_threads``) and on TCP ``get_batch_into``'s receive straight into the
caller's buffers (kvshm/zmq_ctrl/_zmtp.pyx ``Conn.recv(into=)``). Findings first (each
failed before its fix), then attacks that held."""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from kvshm.zmq_ctrl.protocol import Op
from kvshm._shmindex import (BATCH_SEGMENT, FALLBACK, HEADER_SIZE, SLOT_SIZE, IndexReader,
                             batch_helper_stats)

sys.path.insert(0, os.path.dirname(__file__))
from test_localx_threads import EPOCH, PIECE, Tables  # noqa: E402

SUBPROCESS_TIMEOUT = 60


def _hold(m: mmap.mmap, reader: IndexReader, key: bytes):
    """Put ``key``'s slot in a write that never ends (odd version): (where, version)."""
    offs, sizes, toks = reader.locate([key])
    slot, version = toks[0]
    where = HEADER_SIZE + slot * SLOT_SIZE
    assert struct.unpack_from("<Q", m, where)[0] == version
    struct.pack_into("<Q", m, where, version + 1)
    return where, version


def test_a_slot_held_in_a_write_at_a_pieces_or_segments_last_key_is_no_miss(shm_name):
    """Finding: a key whose slot is held in a write (odd version) that is the LAST key of
    a piece (threads) or of a segment (any reader, one key at a time included) was
    answered False by exists_batch (all keys present): _probe_all returns the keys it
    looked up, the fallback key included, so a stop at a piece's/segment's last key read
    as no stop and the keys after it were looked up as if nothing had happened; only the
    batch's very last key was checked for a fallback. Must be None (ask the server)."""
    import posix_ipc

    t = Tables(shm_name, blocks=32768, initial=4096)
    try:
        keys = [b"held-%08d" % i for i in range(3 * BATCH_SEGMENT)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i, 1)]) >= 0
        shm = posix_ipc.SharedMemory(t.writer.name)
        m = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        wrong = []
        try:
            for at in range(PIECE - 1, len(keys), PIECE):   # every piece's last key
                where, version = _hold(m, t.readers["one"], keys[at])
                try:
                    for label, r in t.readers.items():
                        got = r.exists_batch(keys)
                        if got is not None and not all(got):
                            wrong.append((label, at, got.index(False)))
                        mp = r.match_prefix(keys)
                        if mp != FALLBACK:
                            wrong.append((label, at, "match_prefix", mp))
                finally:
                    struct.pack_into("<Q", m, where, version)
            for r in t.readers.values():
                assert r.exists_batch(keys) == [True] * len(keys)
        finally:
            m.close()
        assert wrong == []
    finally:
        t.close()


def test_close_from_another_thread_while_helpers_run_pieces(shm_name):
    """Held: another Python thread closing the reader while batches with 2, 3 and 8
    threads run gets BufferError until no batch runs; then the batches answer None
    (reader not usable) and nothing reads the unmapped table."""
    t = Tables(shm_name, blocks=32768, initial=4096)
    try:
        keys = [b"cl-%08d" % i for i in range(3 * BATCH_SEGMENT)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i, 1)]) >= 0
        for threads in (2, 3, 8):
            r = IndexReader(t.writer.name, t.writer.reads_name, t.pool, EPOCH)
            r.batch_threads = threads
            r.threads_min = 1
            bad = []
            go = threading.Event()

            def ask() -> None:
                go.set()
                for _ in range(200):
                    got = r.exists_batch(keys)
                    if got is not None and got != [True] * len(keys):
                        bad.append(threads)
                    mp = r.match_prefix(keys)
                    if mp not in (FALLBACK, len(keys)):
                        bad.append(threads)

            th = threading.Thread(target=ask)
            th.start()
            go.wait()
            refused = 0
            while True:
                try:
                    r.close()
                    break
                except BufferError:
                    refused += 1
            th.join()
            assert r.closed and bad == []
            assert r.exists_batch(keys) is None and r.match_prefix(keys) == FALLBACK
    finally:
        t.close()


def test_the_default_starts_no_thread_and_exit_with_helpers_alive_does_not_hang(shm_name):
    """Held: with KVSHM_BATCH_READ_THREADS unset a large batch starts no helper (the
    process has the threads it had); with 4 a daemon thread mid-batch at interpreter
    exit (helpers alive, spinning or asleep) does not hang the exit."""
    code = textwrap.dedent("""
        import os, sys, threading
        from kvshm import Pool
        from kvshm._shmindex import IndexReader, batch_helper_stats
        pool = Pool.attach(sys.argv[1])
        r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
        keys = [b"dt-%08d" % i for i in range(40000)]
        before = len(os.listdir("/proc/self/task"))
        assert r.exists_batch(keys) == [True] * len(keys)
        print(r.batch_threads, batch_helper_stats()["threads"],
              len(os.listdir("/proc/self/task")) - before, flush=True)
        if r.batch_threads > 1:
            def spin():
                while True:
                    r.exists_batch(keys)
            threading.Thread(target=spin, daemon=True).start()
            while batch_helper_stats()["pieces"] == 0:
                pass
        os._exit(0) if sys.argv[3] == "hard" else sys.exit(0)
    """)
    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        for i in range(40000):
            assert t.writer.publish(b"dt-%08d" % i, 10, [(i % 65000, 1)]) >= 0
        for val, want in (("", "1 0 0"), ("4", "4 3 3")):
            env = dict(os.environ)
            env.pop("KVSHM_BATCH_READ_THREADS", None)
            if val:
                env["KVSHM_BATCH_READ_THREADS"] = val
            out = subprocess.run([sys.executable, "-c", code, shm_name, str(EPOCH), "soft"],
                                 env=env, capture_output=True, text=True,
                                 timeout=SUBPROCESS_TIMEOUT)
            assert out.returncode == 0, out.stderr
            assert out.stdout.split("\n")[0] == want
    finally:
        t.close()


def test_a_fork_while_helpers_run_pieces_of_another_threads_batch(shm_name):
    """Held: a thread forks while another thread's batches (4 threads) run pieces on
    the helpers; the child (none of those threads) makes a reader with 3 threads whose
    batches answer right and do not hang (new helpers, the pool's state reset)."""
    code = textwrap.dedent("""
        import os, sys, threading, time
        from kvshm import Pool
        from kvshm._shmindex import IndexReader, batch_helper_stats
        pool = Pool.attach(sys.argv[1])
        def reader(n):
            r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool,
                            int(sys.argv[2]))
            r.batch_threads = n
            r.threads_min = 1
            return r
        keys = [b"fk-%08d" % i for i in range(40000)]
        r = reader(4)
        stop = False
        bad = []
        def spin():
            while not stop:
                if r.exists_batch(keys) != [True] * len(keys):
                    bad.append(1)
        th = threading.Thread(target=spin)
        th.start()
        while batch_helper_stats()["pieces"] == 0:
            time.sleep(0.001)
        kids = []
        for _ in range(5):
            pid = os.fork()
            if pid == 0:
                ok = 0
                try:
                    c = reader(3)
                    ok = all(c.exists_batch(keys) == [True] * len(keys) for _ in range(3)) \\
                        and c.match_prefix(keys) == len(keys)
                finally:
                    os._exit(0 if ok else 1)
            kids.append(pid)
            time.sleep(0.005)
        codes = [os.waitpid(p, 0)[1] for p in kids]
        stop = True
        th.join()
        print(codes, bad, flush=True)
    """)
    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        for i in range(40000):
            assert t.writer.publish(b"fk-%08d" % i, 10, [(i % 65000, 1)]) >= 0
        out = subprocess.run([sys.executable, "-c", code, shm_name, str(EPOCH)],
                             capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[0, 0, 0, 0, 0] []"
    finally:
        t.close()


# ---- TCP get_batch_into: Conn.recv(into=) -------------------------------------------

def _conn_pair():
    import socket

    from kvshm.zmq_ctrl import _zmtp
    a, b = socket.socketpair()
    return _zmtp.Conn(a.detach()), b


def test_an_interrupt_while_the_destinations_are_taken_releases_them():
    """Finding: a KeyboardInterrupt (any BaseException) raised while Conn.recv's into
    took the buffers of a message (here from the view of an output without the buffer
    protocol, as byte_view runs a tensor's Python) left the buffers taken so far
    exported: a bytearray the caller got back could never be resized again
    (BufferError), end_into did not see it (the message was not marked), and the next
    plan's malloc lost them for good. Now released before the interrupt goes on."""
    import numpy as np
    from test_zmtp import _frames

    class NoBuffer:
        def __init__(self, n: int) -> None:
            self.arr = np.zeros(n, np.uint8)

    def interrupted(o):
        raise KeyboardInterrupt

    zt, peer = _conn_pair()
    try:
        out = bytearray(8)
        peer.sendall(_frames([b"hdr", b"abcd", b"efgh"]))
        with pytest.raises(KeyboardInterrupt):
            zt.recv(1000, lambda h: ([out, NoBuffer(8)], [4, 4], interrupted))
        out.extend(b"x")                    # released (BufferError before)
        assert not zt.end_into() and not zt.closed
        # the message goes on as usual (nothing placed), then the connection serves on
        assert zt.recv(1000) == [b"hdr", b"abcd", b"efgh"]
        peer.sendall(_frames([b"hdr", b"ijkl"]))
        out2 = bytearray(4)
        assert zt.recv(1000, lambda h: ([out2], [4])) == [b"hdr", 4]
        assert out2 == b"ijkl" and out == bytearray(8) + b"x"
        out2.extend(b"y")
        zt.close()
    finally:
        peer.close()


def test_a_call_given_up_mid_frame_then_the_same_channel_serves_the_next_call(monkeypatch):
    """Held: the first GET-into stalls mid-value past its timeout (ServerUnavailable,
    the connection closed); the same Channel's next GET-into (a new connection) gets
    its own value in its own buffer, and the rest of the first reply, sent afterwards on
    the old connection, lands in neither buffer."""
    import threading

    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.errors import ServerUnavailable
    from kvshm.zmq_ctrl import frames as F
    from kvshm.zmq_ctrl.protocol import decode_request, encode_reply
    from test_zmtp import FakeServer, _accept, _channel, _frames, _read_message

    monkeypatch.setattr(chmod, "INTO", True)
    v1, v2 = b"\x11" * (1 << 20), b"\x22" * 300_000
    gave_up = threading.Event()
    fake: Any = None

    def script(s) -> None:
        _accept(s)
        rid = decode_request(_read_message(s)[0])[2]
        d1 = _frames([encode_reply(0, rid, {"sizes": [len(v1)], "counts": [1]}), v1])
        s.sendall(d1[:400_000])
        gave_up.wait(30)
        s2, _ = fake.lst.accept()
        fake.conns.append(s2)
        _accept(s2)
        rid2 = decode_request(_read_message(s2)[0])[2]
        try:
            s.sendall(d1[400_000:])          # (the old connection: closed by the client)
        except OSError:
            pass
        s2.sendall(_frames([encode_reply(0, rid2, {"sizes": [len(v2)], "counts": [1]}), v2]))
        time.sleep(0.3)

    fake = FakeServer(script)
    ch = _channel(fake, timeout=0.5)
    ch.bound_replies(64 << 20)      # (as after a HELLO: the 1 MiB value is within it)
    try:
        out1 = bytearray(len(v1))
        with pytest.raises(ServerUnavailable):
            ch.request(Op.GET, {"keys": [b"a"]}, into=F.into([out1]))
        then = bytes(out1)
        gave_up.set()
        ch.timeout = 5
        out2 = bytearray(b"\xa5" * (len(v2) + 3))
        _, st, body, frames = ch.request(Op.GET, {"keys": [b"b"]}, into=F.into([out2]))
        assert st == 0 and frames == [len(v2)]
        assert F.placed(frames, body["counts"], body["sizes"])
        assert bytes(out2) == v2 + b"\xa5" * 3
        time.sleep(0.2)
        assert bytes(out1) == then and then.count(0x11) < len(v1)
        out1.extend(b"x")
        out2.extend(b"x")
    finally:
        gave_up.set()
        ch.close()
        fake.close()


@pytest.mark.parametrize("bound", [None, 1 << 41], ids=["default-bound", "2TiB-bound"])
def test_a_frame_claiming_a_huge_length_allocates_nothing_near_it(monkeypatch, bound):
    """Held: an OK reply whose sizes fit the buffer, then a payload frame whose ZMTP
    length claims 2**40 bytes. Within the channel's reply bound (a server of a 2 TiB
    pool): more than the room, not placed, received as usual, which allocates at most
    FIRST_ALLOC until bytes come, then the server closes: the call raises
    ServerUnavailable. Past it (the 1 MiB before HELLO; since session 28): a
    ProtocolError at the frame's header. Either way the buffer untouched and released."""
    import resource

    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.errors import ProtocolError, ServerUnavailable
    from kvshm.zmq_ctrl import frames as F
    from kvshm.zmq_ctrl.protocol import decode_request, encode_reply
    from test_zmtp import FakeServer, _accept, _channel, _read_message

    monkeypatch.setattr(chmod, "INTO", True)

    def script(s) -> None:
        _accept(s)
        rid = decode_request(_read_message(s)[0])[2]
        h = encode_reply(0, rid, {"sizes": [8], "counts": [1]})
        s.sendall(bytes([1, len(h)]) + h                      # the header, more to come
                  + bytes([2]) + struct.pack(">Q", 1 << 40) + b"x" * 100)
        time.sleep(0.2)
        s.close()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fake = FakeServer(script)
    ch = _channel(fake, timeout=2)
    if bound is not None:
        ch.bound_replies(bound)
    try:
        out = bytearray(8)
        with pytest.raises(ServerUnavailable if bound else ProtocolError):
            ch.request(Op.GET, {"keys": [b"a"]}, into=F.into([out]))
        assert out == bytearray(8)
        out.extend(b"x")
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB
    finally:
        ch.close()
        fake.close()


def test_a_bad_key_in_a_late_segment_is_seen_whatever_stops_the_lookup(shm_name):
    """Held: a key the table cannot hold (empty, an int, over max_key) in a late
    segment, at a piece's edge or not, after all hits or after a miss / a fallback in
    an earlier segment: every reader gives None / FALLBACK (the general path then
    raises for it), never an answer that hides it."""
    import posix_ipc

    t = Tables(shm_name, blocks=32768, initial=4096)
    try:
        keys = [b"bk-%08d" % i for i in range(3 * BATCH_SEGMENT)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i, 1)]) >= 0
        shm = posix_ipc.SharedMemory(t.writer.name)
        m = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        try:
            big = b"k" * (t.readers["one"].max_key + 1)
            for bad in (b"", 7, big):
                for at in (2 * BATCH_SEGMENT, 2 * BATCH_SEGMENT + PIECE - 1, len(keys) - 1):
                    ks = list(keys)
                    ks[at] = bad
                    for label, r in t.readers.items():
                        assert r.exists_batch(ks) is None, (label, at)
                        assert r.match_prefix(ks) == FALLBACK, (label, at)
                    ks[PIECE - 1] = b"bk-missing"                 # a miss first
                    for label, r in t.readers.items():
                        assert r.match_prefix(ks) == FALLBACK, (label, at)
                    ks[PIECE - 1] = keys[PIECE - 1]
                    where, version = _hold(m, t.readers["one"], keys[BATCH_SEGMENT - 1])
                    try:                                          # a fallback first
                        for label, r in t.readers.items():
                            assert r.exists_batch(ks) is None, (label, at)
                            assert r.match_prefix(ks) == FALLBACK, (label, at)
                    finally:
                        struct.pack_into("<Q", m, where, version)
        finally:
            m.close()
    finally:
        t.close()


def test_signals_during_long_batches_leave_the_reader_and_helpers_usable(shm_name):
    """Held: a timer signal whose handler raises, firing through batches with 4
    threads: each batch either answers right or the exception comes after it; the
    helpers are given back (the next batches split again), the reader closes."""
    import signal

    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        keys = [b"sg-%08d" % i for i in range(40000)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i % 65000, 1)]) >= 0
        r = IndexReader(t.writer.name, t.writer.reads_name, t.pool, EPOCH)
        r.batch_threads = 4
        r.threads_min = 1

        class Tick(Exception):
            pass

        armed = [False]

        def tick(signum, frame):
            if armed[0]:             # (raised inside the try below only, once a call)
                armed[0] = False
                raise Tick

        old = signal.signal(signal.SIGALRM, tick)
        ticks = wrong = 0
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.0007, 0.0007)
            for _ in range(300):
                try:
                    armed[0] = True
                    got = r.exists_batch(keys)
                    if got != [True] * len(keys):
                        wrong += 1
                    if r.match_prefix(keys) != len(keys):
                        wrong += 1
                    armed[0] = False
                except Tick:
                    ticks += 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            signal.signal(signal.SIGALRM, old)
        assert wrong == 0 and ticks > 0
        before = batch_helper_stats()["pieces"]
        for _ in range(50):
            assert r.exists_batch(keys) == [True] * len(keys)
        assert batch_helper_stats()["pieces"] >= before
        r.close()
        assert r.closed
    finally:
        t.close()


def test_batch_fill_returns_a_frame_as_the_value_only_when_it_is_exactly_that_bytes():
    """Held (_batch.fill's frame-as-value): the frame is returned only when it is a
    bytes (immutable) holding exactly the one value; a longer frame is refused, a
    bytearray / memoryview / bytes subclass / packed frame is copied into a new bytes."""
    from kvshm import _batch

    a = b"x" * 300
    assert _batch.fill([a], [1], [300], None)[0] is a
    assert _batch.fill([a], [1], [299], None) is None
    for f in (bytearray(a), memoryview(a), type("B", (bytes,), {})(a)):
        v = _batch.fill([f], [1], [300], None)[0]
        assert type(v) is bytes and v == a and v is not f
    got = _batch.fill([a + b"yy"], [2], [300, 2], None)
    assert got == [a, b"yy"] and got[0] is not a


def test_numpy_views_with_offsets_strides_and_aliases_as_off(monkeypatch):
    """Held: get_batch_into over TCP into numpy views at odd offsets of one array (the
    values placed), two keys into one buffer (the last one wins, as with the switch
    off), a strided view (refused alike), read-only: the same sizes, bytes and errors
    with KVSHM_ZMTP_INTO on and off."""
    import numpy as np

    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.client import Client
    from servers import ServerProcess

    rng = np.random.default_rng(19)
    vals = {b"nv%d" % n: rng.integers(0, 255, n, dtype=np.uint8).tobytes()
            for n in (1, 300, 70_000, 300_000, (1 << 20) + 3)}
    keys = list(vals)
    srv = ServerProcess(prealloc_size=1 / 8)
    try:
        results = {}
        for on in (True, False):
            monkeypatch.setattr(chmod, "ZMTP", True)
            monkeypatch.setattr(chmod, "INTO", on)
            with Client(srv.address, transport="tcp", timeout=10) as c:
                assert c._chan.zmtp
                c.put_batch(keys, list(vals.values()))
                big = np.full(sum(len(v) for v in vals.values()) + 64, 0xA5, np.uint8)
                outs, off = [], 3
                for k in keys:
                    outs.append(big[off:off + len(vals[k])])
                    off += len(vals[k]) + 7
                sizes = c.get_batch_into(keys, outs)
                one = np.zeros(1 << 21, np.uint8)
                alias = c.get_batch_into([keys[3], keys[2]], [one, one])
                errs = []
                for bad in (np.zeros(2 << 21, np.uint8)[::2], np.zeros(1 << 21, np.uint8)):
                    if bad.flags.writeable and bad.flags.c_contiguous:
                        bad.flags.writeable = False
                    try:
                        c.get_batch_into([keys[4]], [bad])
                        errs.append(None)
                    except Exception as exc:
                        errs.append(type(exc).__name__)
                results[on] = (sizes, big.tobytes(), alias, one.tobytes(), errs)
        assert results[True] == results[False]
        sizes, raw = results[True][0], results[True][1]
        assert sizes == [len(vals[k]) for k in keys]
        off = 3
        for k in keys:
            assert raw[off:off + len(vals[k])] == vals[k]
            off += len(vals[k]) + 7
        assert None not in results[True][4]
    finally:
        srv.stop()


def test_a_batch_uses_no_more_helpers_than_its_batch_threads(shm_name):
    """Finding: every helper the process had made looked up pieces of any batch that
    took the helpers, so after one reader with batch_threads = 8 (7 helpers made) a
    reader with batch_threads = 2 ran its batches on 8 threads (its documented count:
    2, this one included; the CPU of 8). Now a batch's helpers are the first
    batch_threads - 1 made; the others stay asleep."""
    code = textwrap.dedent("""
        import sys
        from kvshm import Pool
        from kvshm._shmindex import IndexReader, batch_helper_stats
        pool = Pool.attach(sys.argv[1])
        def reader(n):
            r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool,
                            int(sys.argv[2]))
            r.batch_threads = n
            r.threads_min = 1
            return r
        keys = [b"hl-%08d" % i for i in range(40000)]
        r8, r2, r3 = reader(8), reader(2), reader(3)
        for _ in range(3):
            assert r8.exists_batch(keys) == [True] * len(keys)
        assert batch_helper_stats()["threads"] == 7
        out = []
        for r in (r2, r3):
            assert r.exists_batch(keys) == [True] * len(keys)   # (from a known state)
            before = batch_helper_stats()["by_helper"]
            for _ in range(40):
                assert r.exists_batch(keys) == [True] * len(keys)
                assert r.match_prefix(keys) == len(keys)
            after = batch_helper_stats()["by_helper"]
            out.append([a - b for a, b in zip(after, before)])
        print(*[sum(d[r.batch_threads - 1:]) for d, r in zip(out, (r2, r3))], flush=True)
    """)
    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        for i in range(40000):
            assert t.writer.publish(b"hl-%08d" % i, 10, [(i % 65000, 1)]) >= 0
        out = subprocess.run([sys.executable, "-c", code, shm_name, str(EPOCH)],
                             capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "0 0"      # pieces run by helpers beyond the count
    finally:
        t.close()
