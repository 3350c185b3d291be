"""break10: a hostile review of the write-behind put batching and the one-key C path.

Each test failed on main (5a53565) before its fix:

* two threads of one write-behind client that both find the reservation empty each sent
  a RESERVE with ``reset``: the second reset gave the first's fresh reservation back to
  the pool while the first was still copying into it, and the blocks it handed out
  again held the first thread's bytes under another key (other clients read wrong
  bytes);
* a forked child read its parent's writes behind through the parent's ``placed`` map
  (stale: the blocks had been reused) instead of raising as every other call does;
* a child forked while another thread held the channel's lock (the place-flush thread
  sending, a call in flight) hung forever in ``close()``;
* a put that raced ``close()`` was held after close's flush and never sent: it returned
  without error and the write was silently lost;
* ``_zmqc.send1/call1/encode1`` read a None key as a bytes object (an out-of-bounds
  read of the None object).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import kvshm
import kvshm.client as kclient
from kvshm import Client
from kvshm.errors import KvshmError, WriteRefused, WritesLost
from kvshm.movers import ShmMover
from kvshm.zmq_ctrl import _zmqc
from kvshm.zmq_ctrl.channel import Channel
from kvshm.zmq_ctrl.protocol import Op, Status
from servers import ServerProcess

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv():
    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


def _val(tag: bytes, n: int) -> bytes:
    return (tag * (n // len(tag) + 1))[:n]


# ---------------------------------------------------------------- reservation reset race


def test_two_threads_never_reset_a_reservation_another_copies_into(srv, monkeypatch):
    """Thread A and the main thread put at once into a write-behind client with no
    reservation yet. A's RESERVE (reset) is answered and A copies into its blocks;
    the main thread must not reset the reservation under it (it takes ALLOC/COMMIT or
    the blocks A's reservation still has). Before: the main thread's own reset freed
    A's blocks, got them back, stored its key there, and A's late copy overwrote it."""
    c = Client(srv.address, write_behind=True, timeout=10)
    other = Client(srv.address, timeout=10)
    assert c.session.wb is not None and not c.session.wb.gen    # nothing reserved yet
    a_in_reserve = threading.Event()
    b_entered = threading.Event()
    b_done = threading.Event()
    main = threading.main_thread()

    real_request = Channel.request

    def request(self, op, body, frames=(), **kw):
        if op == Op.RESERVE and threading.current_thread().name == "A":
            a_in_reserve.set()
            b_entered.wait(5)           # the main thread decided its own first request
        return real_request(self, op, body, frames, **kw)

    real_roundtrip = c._roundtrip

    def roundtrip(drive, req):
        if threading.current_thread() is main:
            b_entered.set()
        return real_roundtrip(drive, req)

    real_copying = ShmMover.copying

    def copying(self):
        if threading.current_thread().name == "A":
            b_done.wait(5)              # A's copy runs late (preempted)
        return real_copying(self)

    monkeypatch.setattr(Channel, "request", request)
    monkeypatch.setattr(c, "_roundtrip", roundtrip)
    monkeypatch.setattr(ShmMover, "copying", copying)
    va, vb = _val(b"A-bytes|", 20000), _val(b"B-bytes|", 20000)
    errors: list[BaseException] = []

    def put_a() -> None:
        try:
            c.put_batch([b"race-a"], [va])          # op_put_behind: RESERVE reset first
        except BaseException as exc:                # noqa: BLE001 - asserted below
            errors.append(exc)

    t = threading.Thread(target=put_a, name="A")
    try:
        t.start()
        assert a_in_reserve.wait(10)
        c.put_batch([b"race-b"], [vb])
        b_done.set()
        t.join(20)
        assert not t.is_alive()
        monkeypatch.undo()
        refused = None
        try:
            c.flush()
        except WriteRefused as exc:
            refused = exc
        assert other.get(b"race-b") == vb           # before: A's bytes
        assert refused is None, refused             # before: A's PLACE was STALE
        assert not errors, errors
        assert other.get(b"race-a") == va
        assert c.get(b"race-b") == vb
        c.delete([b"race-a", b"race-b"])
        s = other.stats(verify=True)
        assert s["accounting_ok"] and s["reservations"]["accounting_ok"], s
    finally:
        b_done.set()
        b_entered.set()
        t.join(10)
        c.close()
        other.close()


@pytest.mark.parametrize("ping", [False, True], ids=["plain", "with-ping"])
def test_threads_sharing_a_write_behind_client_read_only_their_keys_bytes(srv, ping):
    """Four threads put/get/delete/flush the same keys through one write-behind client;
    every value read (by it or another client) is one that was put under that key, and
    nothing is refused. With ``ping`` the threads also say HELLO again now and then
    (each resets the reservation): writes in flight then may be reported lost or stale
    (WritesLost, WriteRefused STALE_EPOCH: reported, never silent), never wrong."""
    c = Client(srv.address, write_behind=True, timeout=10)
    other = Client(srv.address, timeout=10)
    keys = [f"mix{i}" for i in range(24)]
    stop = threading.Event()
    bad: list[tuple[str, bytes]] = []
    unexpected: list[BaseException] = []

    def check(k: str, v: bytes | None) -> None:
        if v is not None and not v.startswith(f"{k}|".encode()[:len(v)]):
            bad.append((k, v[:40]))

    def worker(t: int) -> None:
        import random

        rng = random.Random(t)
        i = 0
        while not stop.is_set():
            i += 1
            k = rng.choice(keys)
            x = rng.random()
            try:
                if x < 0.55:
                    c.put(k, _val(f"{k}|{t}|{i}|".encode(), rng.choice([1, 3000, 9000, 70000])))
                elif x < 0.75:
                    try:
                        check(k, c.get(k))
                    except kvshm.KeyNotFound:
                        pass
                elif x < 0.8:
                    c.flush()
                elif x < 0.85:
                    c.delete(k)
                elif x < 0.86 and ping:
                    c.ping()                        # a HELLO: the reservation is reset
                else:
                    try:
                        check(k, other.get(k))
                    except kvshm.KeyNotFound:
                        pass
            except WritesLost as exc:
                if not ping:
                    unexpected.append(exc)
            except WriteRefused as exc:             # (before the fix: STALE_EPOCH)
                if not ping or set(exc.failed.values()) != {Status.STALE_EPOCH}:
                    unexpected.append(exc)
            except kvshm.ServerUnavailable as exc:
                # two other threads' pings (two HELLOs) during one put: that put is
                # refused, and says so (CI saw it once in a full run)
                if not ping or "reset twice during one put" not in str(exc):
                    unexpected.append(exc)
            except Exception as exc:                # noqa: BLE001 - asserted below
                unexpected.append(exc)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    try:
        for t in ts:
            t.start()
        time.sleep(4)
    finally:
        stop.set()
        for t in ts:
            t.join(30)
    assert not any(t.is_alive() for t in ts)
    try:
        assert not bad, bad[:5]
        assert not unexpected, unexpected[:5]
        try:
            c.flush()
        except (WritesLost, WriteRefused):
            if not ping:
                raise
        for k, v in zip(keys, other.get_batch(keys)):
            check(k, v)
        assert not bad, bad[:5]
        c.delete(keys)
        s = other.stats(verify=True)
        assert s["accounting_ok"] and s["reservations"]["accounting_ok"], s
    finally:
        c.close()
        other.close()


# ---------------------------------------------------------------- fork


def _fork(fn):
    """Run ``fn`` in a forked child; returns a function that waits for it and returns
    its exit code (-1: it hung and was killed) and what ``fn`` returned or raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # pragma: no cover - the child
        os.close(r)
        code = 0
        try:
            msg = fn()
        except BaseException as exc:                # noqa: BLE001 - reported
            msg, code = f"{type(exc).__name__}: {exc}", 3
        os.write(w, str(msg).encode()[:4000])
        os._exit(code)
    os.close(w)

    def wait(timeout: float = 20.0) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        while True:
            p, status = os.waitpid(pid, os.WNOHANG)
            if p:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(r)
                return -1, "hung"
            time.sleep(0.02)
        out = os.read(r, 8192).decode()
        os.close(r)
        return os.waitstatus_to_exitcode(status), out

    return wait


def test_a_forked_child_never_reads_its_parents_writes_behind(srv, monkeypatch):
    """A child forked while its parent's write was held must raise (the client is the
    parent's), not read the parent's ``placed`` map: by then the blocks hold another
    key's bytes."""
    monkeypatch.setattr(kclient, "PLACE_WINDOW", 0)         # every put held
    monkeypatch.setattr(kclient, "PLACE_HOLD_S", 30.0)      # ... until the next call
    with Client(srv.address, write_behind=True) as c, Client(srv.address) as other:
        c.put("fk-warm", b"w")
        c.flush()
        c.put("fk", b"A" * 5000)
        assert c.session.wb.held_rid
        r, w = os.pipe()

        def child() -> str:
            os.read(r, 1)                           # the parent reused the blocks
            out = []
            for fn in (lambda: c.get("fk"), lambda: c.get_into("fk", bytearray(8000)),
                       lambda: c.exists("fk"), lambda: c.get_batch(["fk"])):
                try:
                    v = fn()
                    out.append(f"returned {v!r:.40}")
                except KvshmError as exc:
                    out.append("raised" if "fork" in str(exc) else f"{exc}")
            return "; ".join(out)

        wait = _fork(child)
        c.flush()
        c.delete("fk")
        for i in range(40):
            other.put(f"fk-other{i}", b"B" * 5000)
        os.write(w, b"x")
        code, out = wait()
        os.close(r)
        os.close(w)
        assert code == 0 and out == "raised; raised; raised; raised", (code, out)
        other.delete([f"fk-other{i}" for i in range(40)] + ["fk-warm"])


def test_close_in_a_child_forked_mid_call_does_not_hang(srv, monkeypatch):
    """The place-flush thread holds the channel's lock while it sends; a fork at that
    moment gives the child a lock nobody will release. close() in the child must not
    wait for it (before: it hung forever)."""
    monkeypatch.setattr(kclient, "PLACE_WINDOW", 0)
    with Client(srv.address, write_behind=True) as c:
        c.put("fh-warm", b"w")
        c.flush()
        in_drain = threading.Event()
        forked = threading.Event()
        real_drain = c._chan.drain

        def drain() -> None:
            if threading.current_thread().name == "kvshm-place-flush":
                in_drain.set()
                forked.wait(10)                     # the flush thread, lock held
            real_drain()

        monkeypatch.setattr(c._chan, "drain", drain)
        c.put("fh", b"h" * 100)                     # held: the flush thread sends it
        assert in_drain.wait(10)
        assert c._chan.lock.locked()
        try:
            code, out = _fork(lambda: (c.close(), "closed")[1])(15)
        finally:
            forked.set()
        assert (code, out) == (0, "closed")
        monkeypatch.undo()
        c.flush()
        assert c.get("fh") == b"h" * 100
        c.delete(["fh", "fh-warm"])


# ---------------------------------------------------------------- close


@pytest.mark.parametrize("when", ["before-closed", "after-closed"])
def test_a_put_that_races_close_is_sent_or_refused(srv, monkeypatch, when):
    """A put whose copy is under way when another thread closes the client, and that
    takes the channel after close()'s flush (before or after close marks the client
    closed): either it raises (the client is closed) or its write reaches the server.
    Before: it was held, never sent, and returned as if stored."""
    monkeypatch.setattr(kclient, "PLACE_WINDOW", 0)         # every put held
    monkeypatch.setattr(kclient, "PLACE_HOLD_S", 30.0)
    c = Client(srv.address, write_behind=True)
    other = Client(srv.address)
    c.put("cr-warm", b"w")
    c.put("cr-warm", b"w")                          # held: makes the place-flush thread
    c.flush()
    assert c._flusher is not None
    copied = threading.Event()
    closing = threading.Event()
    real_end = ShmMover.end

    def end(self) -> None:
        real_end(self)
        if threading.current_thread().name == "putter":
            copied.set()
            closing.wait(10)                        # close() runs meanwhile

    monkeypatch.setattr(ShmMover, "end", end)
    result: list[object] = []

    def put() -> None:
        try:
            c.put("cr-late", b"L" * 5000)
            result.append("ok")
        except KvshmError as exc:
            result.append(exc)

    t = threading.Thread(target=put, name="putter")
    t.start()
    assert copied.wait(10)
    f = c._flusher
    real_stop = f.stop if f is not None else None

    def stop() -> None:                             # close() is past its flush
        if real_stop is not None:
            real_stop()
        closing.set()
        time.sleep(0.2)                             # the put takes the lock first

    real_raise = c._session.raise_wb_errors

    def after_flush() -> None:                      # close() is past its flush
        closing.set()
        t.join(10)                                  # the put is done (held)
        real_raise()

    if when == "before-closed":
        monkeypatch.setattr(c._session, "raise_wb_errors", after_flush)
    else:
        assert f is not None
        monkeypatch.setattr(f, "stop", stop)
    c.close()
    t.join(10)
    assert not t.is_alive()
    try:
        if result == ["ok"]:
            deadline = time.monotonic() + 5
            while not other.exists("cr-late") and time.monotonic() < deadline:
                time.sleep(0.02)
            assert other.get("cr-late") == b"L" * 5000, "put returned, write lost"
        else:
            assert isinstance(result[0], KvshmError), result
    finally:
        other.delete(["cr-late", "cr-warm"])
        other.close()


# ---------------------------------------------------------------- the one-key C calls


def test_one_key_calls_refuse_a_none_key():
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    try:
        with pytest.raises(TypeError):
            _zmqc.encode1(int(Op.GET), 1, 1, None)
        with pytest.raises(TypeError):
            _zmqc.send1(s, int(Op.GET), 1, 1, None)
        with pytest.raises(TypeError):
            _zmqc.call1(s, _zmqc.GET1, int(Op.GET), 1, 1, None, None, None, 10, None)
    finally:
        s.close(0)


# ---------------------------------------------------------------- restart


def test_flush_across_a_restart_names_the_held_writes_lost(monkeypatch):
    """Puts held when the server is replaced by a new one on the same port: flush()
    raises WritesLost naming them (before: ServerUnavailable "restarted during the
    operation", the names only from a later call), and the new server has none."""
    import socket

    monkeypatch.setattr(kclient, "PLACE_WINDOW", 0)
    monkeypatch.setattr(kclient, "PLACE_HOLD_S", 30.0)
    monkeypatch.setattr(kclient, "IDLE_FLUSH_S", 60.0)
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    srv = ServerProcess(service_port=port, prealloc_size=1 / 64)
    srv2 = None
    c = Client(srv.address, write_behind=True, timeout=5)
    try:
        c.put("rs-warm", b"w")
        c.flush()
        c.put("rs1", b"1" * 5000)
        c.put("rs2", b"2" * 5000)
        assert c.session.wb.held_keys == [b"rs1", b"rs2"]
        srv.stop()
        srv2 = ServerProcess(service_port=port, prealloc_size=1 / 64)
        with pytest.raises(WritesLost) as ei:
            c.flush()
        assert sorted(ei.value.keys) == [b"rs1", b"rs2"]
        c.flush()                                   # reported once
        with Client(srv2.address) as other:
            assert not other.exists("rs1") and not other.exists("rs2")
            c.put("rs3", b"3" * 5000)
            c.flush()
            assert other.get("rs3") == b"3" * 5000
    finally:
        c.close()
        srv.kill()
        if srv2 is not None:
            srv2.stop()
