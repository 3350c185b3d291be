"""break16: a hostile review of what was merged on 2026-12-02 00:15-01:15 UTC (the flake
commits: a HELLO keeping the mapped pool, a put's own COMMIT, the last look at a wait's
deadline; Channel.drain's DRAIN_MAX; batchp2's C size compares).

Finding (failed on main 48a7b67 before its fix):

* a HELLO to the same server keeps the mover in use as the one its next HELLO proves
  (5786ce2); when that next HELLO's reply was another server's (a restart between the
  two: a new epoch) or said the proof was not seen (not local), apply_hello closed that
  mover with ``unproven.close()``: with a view of its pool still alive (the caller
  reading pool memory) Pool.close raised BufferError out of the HELLO. Before 5786ce2
  the unproven mover was always a fresh one nobody held views of. Fix: such a mover is
  retired as _retire_mover does (kept in _retired until its views go).
  test_hello_after_a_kept_mover_with_pool_views_alive_does_not_raise.
* the same kept mover, closed by Client.close() before its proving HELLO (which timed
  out, say): Session.close retired it (views alive: kept) and then closed it again as
  the unproven one, BufferError out of close() (its liveness file left in /dev/shm).
  Fix: the unproven mover already retired is not closed again.
  test_close_between_a_kept_mover_and_its_proof_with_pool_views_alive.

The rest are attacks that held, kept as regression tests (a server replaced on the
same port and segment name between HELLOs and under reading threads; lazy and own
COMMITs of threads sharing one client; an own COMMIT that times out, sent or not;
one-key get/get_into/put replies found by the last look at the deadline).
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


@pytest.mark.parametrize("why", ["new_epoch", "not_local"])
def test_hello_after_a_kept_mover_with_pool_views_alive_does_not_raise(why):
    """A HELLO to the same server keeps the mover in use as the one to prove (5786ce2);
    the next HELLO's reply comes from another server (a restart between the two: a new
    epoch) or says the proof was not seen (not local). That mover was closed there with
    views of its pool still held by the caller: BufferError out of the HELLO (and out
    of every call that says it), where a retired mover is kept until the views go.
    Staged with the server's own HELLO reply, its epoch or ``local`` changed."""
    import kvshm.client as kc
    with ServerProcess(prealloc_size=1 / 16) as srv:
        c = Client(srv.address, timeout=10)
        try:
            s = c.session
            rec = []
            real = kc._Session.apply_hello

            def apply_hello(self, r, address):
                rec.append((r, address))
                return real(self, r, address)

            kc._Session.apply_hello = apply_hello
            try:
                c.put("b16-v", b"v" * 100)
                c.ping()
            finally:
                kc._Session.apply_hello = real
            r, addr = rec[-1]
            m = s.mover
            assert isinstance(m, kc.ShmMover) and r.body.get("local") is True
            view = m.pool.view(0, 16)       # the caller's view of pool memory
            s.apply_hello(r, addr)          # the same server: the mover kept, unproven
            assert s._unproven is m
            if why == "new_epoch":
                r2 = r._replace(body=dict(r.body, epoch=int(r.body["epoch"]) + 2))
            else:
                r2 = r._replace(body=dict(r.body, local=False))
            s.apply_hello(r2, addr)         # before the fix: BufferError
            assert s.mover is not m
            assert len(bytes(view)) == 16   # still mapped (the mover retired, not closed)
            del view
        finally:
            c.close()


def test_close_between_a_kept_mover_and_its_proof_with_pool_views_alive():
    """Client.close() after a HELLO to the same server kept the mover as the one to
    prove (its proving HELLO not made yet: it timed out, say) while the caller holds a
    view of the pool: before the fix the session retired the mover (views alive) and
    then closed it again as the unproven one, BufferError out of close()."""
    import kvshm.client as kc
    with ServerProcess(prealloc_size=1 / 16) as srv:
        c = Client(srv.address, timeout=10)
        s = c.session
        rec = []
        real = kc._Session.apply_hello

        def apply_hello(self, r, address):
            rec.append((r, address))
            return real(self, r, address)

        kc._Session.apply_hello = apply_hello
        try:
            c.put("b16-u", b"u" * 100)
            c.ping()
        finally:
            kc._Session.apply_hello = real
        r, addr = rec[-1]
        m = s.mover
        view = m.pool.view(0, 16)
        s.apply_hello(r, addr)
        assert s._unproven is m
        try:
            c.close()                       # before the fix: BufferError
        finally:
            del view
            s._unproven = None
            c.close()
            if s.proof is not None:         # (close raised before it: main)
                s.proof.close()
                s.proof = None
            for x in s._retired:
                x.close()
            m.close()                       # (its views gone now: unmapped)
