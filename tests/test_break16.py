"""break16: a hostile review of what was merged on 2026-12-02 00:15-01:15 UTC (the flake
commits: a HELLO keeping the mapped pool, a put's own COMMIT, the last look at a wait's
deadline; Channel.drain's DRAIN_MAX; batchp2's C size compares).

No finding so far: these are the attacks that held on main (48a7b67), kept as
regression tests (a server replaced on the same port and segment name between HELLOs
and under reading threads; lazy and own COMMITs of threads sharing one client).
"""

from __future__ import annotations

import time

import pytest

from kvshm import Client
from servers import ServerProcess

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv():
    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


def _restarted_reads(transport: str) -> list:
    """A client that keeps its mapping across HELLOs to the same server; the server is
    replaced by another (same port, same segment name: a new pool) between two calls."""
    from servers import unique_shm_name
    name = unique_shm_name()
    s1 = ServerProcess(shm_name=name, prealloc_size=1 / 16)
    s1.__enter__()
    port = int(s1.address.rsplit(":", 1)[1])
    out = []
    try:
        c = Client(s1.address, timeout=10, transport=transport)
        try:
            c.put("b16-r", b"A" * 4096)
            out.append(c.get("b16-r"))
            c.ping()                        # a HELLO to the same server: mapping kept
            out.append(c.get("b16-r"))
            s1.__exit__(None, None, None)
            s1 = ServerProcess(shm_name=name, prealloc_size=1 / 16, service_port=port)
            s1.__enter__()
            with Client(s1.address, timeout=10) as w:
                w.put("b16-r", b"B" * 4096)
            for _ in range(3):
                try:
                    out.append(c.get("b16-r"))
                except Exception as exc:     # (a restart may be reported once)
                    out.append(type(exc).__name__)
        finally:
            c.close()
    finally:
        s1.__exit__(None, None, None)
    return out


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_a_server_replaced_on_the_same_segment_name_is_read_anew(transport):
    got = _restarted_reads(transport)
    assert got[:2] == [b"A" * 4096] * 2, got[:2]
    assert b"A" * 4096 not in got[2:], got[2:]
    assert got[-1] == b"B" * 4096, got[2:]


def test_threads_reading_across_a_server_replaced_never_read_the_old_pool():
    """Threads of one client get a key in a loop (pings of another thread make HELLOs
    to the same server meanwhile) while the server is replaced by another on the same
    port and segment name; a get begun after the new server stored the key's new value
    never returns the old one."""
    import threading
    from servers import unique_shm_name
    name = unique_shm_name()
    s1 = ServerProcess(shm_name=name, prealloc_size=1 / 16)
    s1.__enter__()
    port = int(s1.address.rsplit(":", 1)[1])
    new_stored = threading.Event()
    stop = threading.Event()
    bad: list = []
    reads = [0]
    c = Client(s1.address, timeout=10)
    try:
        c.put("b16-t", b"A" * 4096)

        def reader() -> None:
            while not stop.is_set():
                after = new_stored.is_set()
                try:
                    v = c.get("b16-t")
                except Exception:
                    continue
                reads[0] += 1
                if after and v == b"A" * 4096:
                    bad.append(v[:1])

        def pinger() -> None:
            while not stop.is_set():
                try:
                    c.ping()
                except Exception:
                    pass

        ts = [threading.Thread(target=reader) for _ in range(2)]
        ts.append(threading.Thread(target=pinger))
        for t in ts:
            t.start()
        try:
            s1.__exit__(None, None, None)
            s1 = ServerProcess(shm_name=name, prealloc_size=1 / 16, service_port=port)
            s1.__enter__()
            with Client(s1.address, timeout=10) as w:
                w.put("b16-t", b"B" * 4096)
            new_stored.set()
            n0 = reads[0]
            while reads[0] < n0 + 200:
                time.sleep(0.01)
        finally:
            stop.set()
            for t in ts:
                t.join(30)
        assert not bad, len(bad)
        assert c.get("b16-t") == b"B" * 4096
    finally:
        c.close()
        s1.__exit__(None, None, None)


def test_lazy_and_own_commits_of_threads_sharing_a_client_all_land():
    """Threads of one local client put batches, lazily committed and not (a put's own
    COMMIT, fb38708), with pings (HELLOs) between; after flush every key is stored with
    its bytes and the server's accounting holds (no commit lost nor doubled)."""
    import threading
    with ServerProcess(prealloc_size=1 / 16) as srv:
        c = Client(srv.address, timeout=20)
        errors: list = []

        def work(t: int) -> None:
            try:
                for i in range(60):
                    keys = [f"b16-c{t}-{i}-{j}" for j in range(4)]
                    vals = [bytes([t * 16 + j]) * (500 + 300 * j) for j in range(4)]
                    c.run_op(c.session.op_put_batch(keys, vals, False,
                                                    lazy=bool((i + t) & 1)))
                    if i % 7 == 0:
                        c.ping()
            except Exception as exc:        # pragma: no cover (reported below)
                errors.append(repr(exc))

        ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        c.flush()
        assert not errors, errors[:3]
        with Client(srv.address, timeout=20) as r:
            for t in range(4):
                for i in range(60):
                    keys = [f"b16-c{t}-{i}-{j}" for j in range(4)]
                    got = r.get_batch(keys)
                    want = [bytes([t * 16 + j]) * (500 + 300 * j) for j in range(4)]
                    assert [bytes(g) if g is not None else None for g in got] == want, \
                        (t, i)
            st = r.stats(verify=True)
            assert st["accounting_ok"], st
        c.close()


from test_threads_shared_client import (  # noqa: E402  (fixtures and the helper)
    _kept_off_past_deadline, server, transport_impl)


@pytest.mark.parametrize("path", ["get", "get_into", "put"])
def test_one_key_reply_found_by_the_last_look_is_read_whole(server, transport_impl,
                                                           path, monkeypatch):
    """call1's last look at the deadline (ee0dacc) hands the caller a general reply
    (status, body, frames): a GET's value in its frame, get_into's copy into the
    caller's buffer and a PUT's statuses read from it as from the C reply."""
    import os
    import signal
    import uuid
    import kvshm.zmq_ctrl.channel as chmod
    if not chmod.CALL1:
        pytest.skip("_zmqc not built: no call1")
    with Client(server.address, transport="tcp", timeout=0.5) as c:
        key = f"b16-late-{uuid.uuid4().hex[:8]}".encode()
        val = bytes(range(256)) * 9
        c.put(key, val)
        assert c.get(key) == val
        kept = _kept_off_past_deadline(monkeypatch, server, c)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            if path == "get":
                assert c.get(key) == val
            elif path == "get_into":
                out = bytearray(len(val) + 10)
                got = c.get_into(key, out)
                assert bytes(out[:len(val)]) == val, got
            else:
                c.put(key, val[::-1])
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert kept, "the wait never had a slice without its reply"
        assert c._chan.timeouts == 0
        assert c._chan.late == 1
        monkeypatch.undo()
        assert c.get(key) == (val[::-1] if path == "put" else val)
        c.delete([key])


@pytest.mark.parametrize("sent", [False, True], ids=["unsent", "reply_lost"])
def test_a_puts_own_commit_that_times_out_leaves_the_accounting_whole(sent, monkeypatch):
    """A non-lazy put's own COMMIT (fb38708) fails with a timeout, sent or not: the put
    raises ServerUnavailable; the grant is then either committed (the server got it) or
    aborted by the next request, never left pending nor committed twice, and the
    server's accounting holds."""
    import kvshm.zmq_ctrl.channel as chmod
    from kvshm.errors import ServerUnavailable
    from kvshm.zmq_ctrl.protocol import Op
    with ServerProcess(prealloc_size=1 / 16) as srv:
        c = Client(srv.address, timeout=10)
        try:
            c.put("b16-w", b"w")
            real = chmod.Channel.request
            hit = []

            def request(self, op, body, *a, **kw):
                if op == Op.COMMIT and not hit and self is c._chan:
                    hit.append(list(body.get("commit", ())))
                    if sent:
                        real(self, op, body, *a, **kw)
                    self.reset()
                    raise ServerUnavailable("test: the COMMIT's reply never came")
                return real(self, op, body, *a, **kw)

            monkeypatch.setattr(chmod.Channel, "request", request)
            with pytest.raises(ServerUnavailable):
                c.put("b16-x", b"x" * 5000)
            monkeypatch.undo()
            assert hit and len(hit[0]) == 1, hit
            c.put("b16-y", b"y" * 300)      # the abort rides on it (after a HELLO)
            c.flush()
            with Client(srv.address, timeout=10) as r:
                assert r.exists("b16-x") == sent
                if sent:
                    assert r.get("b16-x") == b"x" * 5000
                assert r.get("b16-y") == b"y" * 300
                st = r.stats(verify=True)
                assert st["accounting_ok"], st
        finally:
            c.close()
