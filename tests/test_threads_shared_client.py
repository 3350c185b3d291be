"""One kvshm client shared by many threads, as vLLM's tier shares it (the scheduler thread
and the transfer pool's threads, kvshm/integrations/vllm.py): no reply is lost, and none
reaches the wrong caller.

The hunt for ``test_vllm_e2e.py::test_tp2_never_hits_tp1_chunks``'s flake (a load job's
request got "no reply ... within 5 s" while a fresh probe was answered at once). Each
worker thread reads and writes keys of its own with values that name the thread, the key
and the write, so a reply handed to another caller shows as wrong bytes or a wrong size;
the server is paused for short spells (SIGSTOP/SIGCONT) so replies come late and calls
pile up behind the client's lock; delays are injected inside the lock (before the send,
after the reply); a "victim" thread's calls get a 1 ms deadline, so they time out while
their replies are still to come and the other threads go on on the same client. Every
call of the other threads must succeed (their timeout is far above any pause: a failure
is a lost reply, not a slow one) and return its own data.

Over tcp (``transport="tcp"``: the one-key C paths, GET with frames) and ipc (the local
client: shm mover, LOOKUP/ALLOC/COMMIT with piggybacked RELEASE, lock-free reads off so
every read asks the server), each on the ZMTP transport and on libzmq (KVSHM_ZMTP=0's
path: ``channel.ZMTP`` patched before the client is made); and the same through the
integrations' ResilientClient.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import kvshm.zmq_ctrl.channel as chmod
from kvshm.client import Client
from kvshm.errors import KvshmError, ServerUnavailable
from kvshm.integrations._common import ResilientClient

sys.path.insert(0, os.path.dirname(__file__))
from servers import ServerProcess  # noqa: E402

#: per-call timeout of the threads that must never fail (s): far above any pause here
SAFE_TIMEOUT = 20.0
ROUNDS = 60             # operations per worker thread
WORKERS = 4
PAUSES = 12             # server pauses (SIGSTOP .. SIGCONT) during a run


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(prealloc_size=1 / 4)
    yield srv
    srv.stop()


def _value(tid: int, i: int, gen: int, n: int) -> bytes:
    head = f"T{tid}K{i}G{gen}|".encode()
    return (head * (n // len(head) + 1))[:n]


class _Chaos:
    """Pauses the server for short spells, until stopped."""

    def __init__(self, pid: int, spells: int) -> None:
        self.pid = pid
        self.spells = spells
        self.done = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = random.Random(1)
        for _ in range(self.spells):
            if self.done.wait(rng.uniform(0.02, 0.15)):
                break
            os.kill(self.pid, signal.SIGSTOP)
            try:
                self.done.wait(rng.uniform(0.005, 0.12))
            finally:
                os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> "_Chaos":
        self.t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.t.join()
        os.kill(self.pid, signal.SIGCONT)


def _inject(monkeypatch: pytest.MonkeyPatch, victims: set[int]) -> None:
    """Delays inside the channel lock around each request, and a 1 ms deadline for the
    victim threads' calls (their replies come after their wait ended)."""
    rng = random.Random(2)
    real_request, real_call1 = chmod.Channel.request, chmod.Channel.call1

    def around(real: Any) -> Any:
        def call(self: chmod.Channel, *a: Any, **kw: Any) -> Any:
            victim = threading.get_ident() in victims
            if rng.random() < 0.2:
                threading.Event().wait(rng.uniform(0, 0.004))
            old = self.timeout, self._slice_ms
            if victim:
                # (the caller holds the channel's lock): waits of 1 ms slices, 1 ms long
                self.timeout, self._slice_ms = 0.001, 1
                kw.pop("timeout", None)
            try:
                return real(self, *a, **kw)
            finally:
                self.timeout, self._slice_ms = old
                if rng.random() < 0.2:
                    threading.Event().wait(rng.uniform(0, 0.004))
        return call

    monkeypatch.setattr(chmod.Channel, "request", around(real_request))
    monkeypatch.setattr(chmod.Channel, "call1", around(real_call1))


def _worker(c: Any, call: Any, tid: int, errors: list[str], sizes: tuple[int, ...],
            tag: str) -> None:
    """Mixed single and batch ops on keys of this thread; every answer checked."""
    rng = random.Random(100 + tid)
    gens: dict[int, int] = {}
    nkeys = 24

    def k(i: int) -> bytes:
        return f"{tag}-{tid}-{i}".encode()

    def want(i: int) -> bytes | None:
        g = gens.get(i)
        return None if g is None else _value(tid, i, g, sizes[i % len(sizes)])

    for r in range(ROUNDS):
        op = rng.randrange(7)
        ids = rng.sample(range(nkeys), rng.randrange(1, 9))
        try:
            if op == 0:
                for i in ids[:2]:
                    gens[i] = r
                    call(lambda c: c.put(k(i), want(i)))
            elif op == 1:
                for i in ids:
                    gens[i] = r
                vals = [want(i) for i in ids]
                call(lambda c: c.put_batch([k(i) for i in ids], vals))
            elif op == 2:
                i = ids[0]
                got = call(lambda c: c.exists(k(i)))
                if got != (i in gens):
                    errors.append(f"T{tid} exists({i}) = {got}, want {i in gens}")
                if i in gens:
                    v = call(lambda c: c.get(k(i)))
                    if v != want(i):
                        errors.append(f"T{tid} get({i}): {v[:24]!r}.. want {want(i)[:24]!r}")
            elif op == 3:
                got = call(lambda c: c.exists_batch([k(i) for i in ids]))
                exp = [i in gens for i in ids]
                if got != exp:
                    errors.append(f"T{tid} exists_batch {got} want {exp}")
            elif op == 4:
                vals = call(lambda c: c.get_batch([k(i) for i in ids]))
                exp = [want(i) for i in ids]
                if vals != exp:
                    errors.append(f"T{tid} get_batch: wrong values for {ids}")
            elif op == 5:
                outs = [bytearray(max(sizes) + 16) for _ in ids]
                got = call(lambda c: c.get_batch_into([k(i) for i in ids], outs))
                for i, n, o in zip(ids, got, outs):
                    w = want(i)
                    if (w is None and n != -1) or (w is not None and bytes(o[:n]) != w):
                        errors.append(f"T{tid} get_batch_into({i}): size {n}, "
                                      f"{bytes(o[:24])!r}.. want {None if w is None else w[:24]!r}")
            else:
                i = ids[0]
                if i in gens:
                    out = bytearray(max(sizes) + 16)
                    n = call(lambda c: c.get_into(k(i), out))
                    if bytes(out[:n]) != want(i):
                        errors.append(f"T{tid} get_into({i}): size {n}, {bytes(out[:24])!r}")
                    if rng.random() < 0.3:
                        call(lambda c: c.delete([k(i)]))
                        del gens[i]
        except KvshmError as exc:
            errors.append(f"T{tid} round {r} op {op}: {type(exc).__name__}: {exc}")
            return


def _victim(c: Client, stop: threading.Event, seen: list[int]) -> None:
    """Calls that time out (1 ms) while the others go on; their outcome is free."""
    rng = random.Random(7)
    i = 0
    while not stop.is_set():
        i += 1
        key = f"victim-{i % 16}".encode()
        try:
            if rng.random() < 0.5:
                c.put_batch([key, key + b"b"], [b"v" * 3000, b"w" * 70000])
            else:
                c.get_batch([key, key + b"b"])
        except ServerUnavailable:
            seen[0] += 1
        except KvshmError:
            pass


def _run(c: Any, call: Any, server: ServerProcess, monkeypatch: pytest.MonkeyPatch,
         victim: bool) -> list[str]:
    with Client(server.address) as admin:
        admin.purge()           # (no eviction of this run's keys by earlier tests' data)
    victims: set[int] = set()
    _inject(monkeypatch, victims)
    errors: list[str] = []
    sizes = (10, 200, 4096, 70000, 300_000)
    tag = uuid.uuid4().hex[:8]
    ts = [threading.Thread(target=_worker, args=(c, call, t, errors, sizes, tag))
          for t in range(WORKERS)]
    stop = threading.Event()
    timed_out = [0]
    vt = None
    if victim:
        vt = threading.Thread(target=_victim, args=(c, stop, timed_out))
    with _Chaos(server.pid, PAUSES):
        if vt is not None:
            vt.start()
            assert vt.ident is not None
            victims.add(vt.ident)
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        stop.set()
        if vt is not None:
            vt.join()
    ch = getattr(c, "_chan", None)
    print(f"\nvictim timeouts {timed_out[0]}, channel sent {getattr(ch, 'sent', '?')} "
          f"timeouts {getattr(ch, 'timeouts', '?')} fast {getattr(ch, 'fast', '?')}")
    return errors


@pytest.fixture(params=["zmtp", "libzmq"])
def transport_impl(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "zmtp" and not chmod.ZMTP:
        pytest.skip("KVSHM_ZMTP=0 or _zmtp not built")
    monkeypatch.setattr(chmod, "ZMTP", request.param == "zmtp")
    return str(request.param)


@pytest.mark.parametrize("where", ["tcp", "ipc"])
def test_threads_share_one_client(server: ServerProcess, transport_impl: str, where: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")     # every read asks the server
    if where == "tcp":
        c = Client(server.address, transport="tcp", timeout=SAFE_TIMEOUT)
    else:
        assert server.ipc
        c = Client(server.ipc, timeout=SAFE_TIMEOUT)
    try:
        assert c._chan.zmtp == (transport_impl == "zmtp")
        assert c._chan.endpoint.startswith(f"{where}://")
        errors = _run(c, lambda f: f(c), server, monkeypatch, victim=True)
        assert not errors, "\n".join(errors[:20] + [str(c.stats().get("evictions"))])
        # and the client still works for everyone after it all
        c.put(b"after", b"x")
        assert c.get(b"after") == b"x"
    finally:
        monkeypatch.undo()
        c.close()


@pytest.mark.parametrize("where", ["tcp", "ipc"])
def test_threads_share_one_resilient_client(server: ServerProcess, transport_impl: str,
                                            where: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The integrations' wrapper, as KvshmTier uses it (``_kv.call(lambda c: ...)``)."""
    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    addr = server.address if where == "tcp" else server.ipc
    assert addr
    rc = ResilientClient(addr, transport="tcp" if where == "tcp" else "auto",
                         timeout=SAFE_TIMEOUT, retry_interval=0.05)
    try:
        errors = _run(rc.client(), rc.call, server, monkeypatch, victim=False)
        assert not errors, "\n".join(errors[:20])
        assert rc.up
    finally:
        monkeypatch.undo()
        rc.close()


# ------------------------------------------------------------------------------------
# A HELLO of one thread (after its call timed out, or a ping) in the middle of another
# thread's operation on a local client: that operation goes on (same server, same pool,
# its grants carried over with the nonce); before, the HELLO attached the pool again
# and made a new mover, and the operation, seeing another mover, took it for a server
# restart: a get raised _Restarted ("the server restarted during a get"), a put
# "the session was reset twice during one put" once it happened twice.


def _hello_between_steps(c: Client, monkeypatch: pytest.MonkeyPatch, op: int,
                         times: int) -> list[int]:
    """After each of the first ``times`` replies to ``op`` of this thread, another
    thread says HELLO on the same client (the channel lock is free then, as when a
    transfer thread's call timed out meanwhile)."""
    real = Client._roundtrip
    done: list[int] = []

    def roundtrip(self: Client, drive: Any, req: Any) -> Any:
        r = real(self, drive, req)
        if self is c and req.op == op and len(done) < times:
            t = threading.Thread(target=c.ping)
            t.start()
            t.join()
            done.append(r.req_id)
        return r

    monkeypatch.setattr(Client, "_roundtrip", roundtrip)
    return done


@pytest.mark.parametrize("times", [1, 2])
def test_hello_of_another_thread_mid_get(server: ServerProcess, transport_impl: str,
                                         times: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshm.zmq_ctrl.protocol import Op

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    assert server.ipc
    with Client(server.ipc, timeout=SAFE_TIMEOUT) as c:
        assert c.transport == "shm"
        keys = [f"mid-get-{uuid.uuid4().hex[:8]}-{i}".encode() for i in range(3)]
        vals = [bytes([i]) * (1000 + i) for i in range(3)]
        c.put_batch(keys, vals)
        mover = c.session.mover
        done = _hello_between_steps(c, monkeypatch, Op.LOOKUP, times)
        assert c.get_batch(keys) == vals
        outs = [bytearray(2000) for _ in keys]
        assert c.get_batch_into(keys, outs) == [len(v) for v in vals]
        assert [bytes(o[:len(v)]) for o, v in zip(outs, vals)] == vals
        assert len(done) == times
        assert c.session.mover is mover     # the same server's pool: the same mover


@pytest.mark.parametrize("times", [1, 2])
def test_hello_of_another_thread_mid_put(server: ServerProcess, transport_impl: str,
                                         times: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshm.zmq_ctrl.protocol import Op

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    assert server.ipc
    with Client(server.ipc, timeout=SAFE_TIMEOUT) as c:
        keys = [f"mid-put-{uuid.uuid4().hex[:8]}-{i}".encode() for i in range(3)]
        vals = [bytes([i + 7]) * (5000 + i) for i in range(3)]
        c.put(b"first", b"x")               # (the mover is made)
        mover = c.session.mover
        done = _hello_between_steps(c, monkeypatch, Op.ALLOC, times)
        for _ in range(times):
            c.put_batch(keys, vals)
        assert len(done) == times
        assert c.session.mover is mover
        monkeypatch.undo()
        assert c.get_batch(keys) == vals
        st = c.stats(verify=True)
        assert st.get("accounting_ok", True), st


# ------------------------------------------------------------------------------------
# A caller kept from running (the GIL held by an engine's scheduler thread, the CPU by
# its workers) from the end of a slice of its wait until past its deadline, while its
# reply came: the wait looks at what is queued before it ends in a timeout. Before, it
# raised "no reply from kvshm server ... within N s" with the reply unread, and lost it
# with the socket, the server answering a fresh probe at once.


def _kept_off_past_deadline(monkeypatch: pytest.MonkeyPatch, server: ServerProcess,
                            c: Client) -> list[float]:
    """The first slice of the next wait ends with no reply (the server is stopped);
    then, before the wait looks at its deadline, the server goes on and its reply is
    queued, and the caller does not run until its deadline passed."""
    name = "_zwaited" if c._chan.zmtp else "_waited"
    real = getattr(chmod.Channel, name)
    kept: list[float] = []

    def waited(self: chmod.Channel, *a: Any, **kw: Any) -> Any:
        if not kept and self is c._chan:
            deadline = a[2] if name == "_waited" else a[1]
            os.kill(server.pid, signal.SIGCONT)
            if self.zmtp:
                assert self._sock.poll(30_000)          # the reply is here
            else:
                assert self._sock.poll(30_000, 1)
            while time.monotonic() <= deadline:          # kept off the CPU
                time.sleep(max(0.0, deadline - time.monotonic()) + 0.001)
            kept.append(deadline)
        return real(self, *a, **kw)

    monkeypatch.setattr(chmod.Channel, name, waited)
    return kept


@pytest.mark.parametrize("path", ["request", "call1"])
def test_reply_there_at_the_deadline_is_taken(server: ServerProcess, transport_impl: str,
                                              path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(server.address, transport="tcp", timeout=0.5) as c:
        key = f"late-{uuid.uuid4().hex[:8]}".encode()
        c.put(key, b"v")
        assert c.exists(key)
        if path == "call1" and not chmod.CALL1:
            pytest.skip("_zmqc not built: no call1")
        kept = _kept_off_past_deadline(monkeypatch, server, c)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            if path == "request":
                assert c.exists_batch([key, key + b"-no"]) == [True, False]
            else:
                assert c.exists(key)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert kept, "the wait never had a slice without its reply"
        assert c._chan.timeouts == 0
        assert c._chan.late == 1
        monkeypatch.undo()
        assert c.get(key) == b"v"


# ------------------------------------------------------------------------------------
# A put's COMMIT queued for the next request, taken by another thread's request that is
# then lost (it timed out, or libzmq dropped it unsent when the socket was reset with
# linger 0): the put's own COMMIT went without it, the put reported success, and the
# write was never committed (a miss, then the pending entry reclaimed at its lease).


def test_commit_not_lost_on_another_threads_failed_request(
        server: ServerProcess, transport_impl: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshm.zmq_ctrl.protocol import Op

    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    assert server.ipc
    with Client(server.ipc, timeout=SAFE_TIMEOUT) as c:
        assert c.transport == "shm"
        key = f"commit-{uuid.uuid4().hex[:8]}".encode()
        real_rt, real_req = Client._roundtrip, chmod.Channel.request
        lost: list[Any] = []
        other: list[int] = []

        def request(self: chmod.Channel, op: int, body: dict[str, Any], *a: Any,
                    **kw: Any) -> Any:
            if threading.get_ident() in other:      # sent, then lost with its socket
                lost.append(dict(body))
                self.reset()
                raise ServerUnavailable("injected: this request and its reply are lost")
            return real_req(self, op, body, *a, **kw)

        def roundtrip(self: Client, drive: Any, req: Any) -> Any:
            # before the put's COMMIT goes (its ALLOC answered, the value copied)
            if self is c and req.op == Op.COMMIT and not lost and \
                    threading.get_ident() not in other:
                def call() -> None:
                    assert threading.current_thread().ident is not None
                    other.append(threading.current_thread().ident)
                    with pytest.raises(ServerUnavailable):
                        c.exists_batch([b"whatever"])
                t = threading.Thread(target=call)
                t.start()
                t.join()
            return real_rt(self, drive, req)

        monkeypatch.setattr(chmod.Channel, "request", request)
        monkeypatch.setattr(Client, "_roundtrip", roundtrip)
        c.put_batch([key], [b"v" * 5000])
        assert lost                                 # the other thread's request went
        monkeypatch.undo()
        assert c.exists(key)
        assert c.get(key) == b"v" * 5000


def test_timeout_says_the_caller_was_kept_from_running(
        server: ServerProcess, transport_impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No reply at all (the server stopped) and the caller kept off past its deadline:
    the timeout says the caller did not run (the next flake tells which it was)."""
    with Client(server.address, transport="tcp", timeout=0.5) as c:
        key = f"kept-{uuid.uuid4().hex[:8]}".encode()
        c.put(key, b"v")
        name = "_zwaited" if c._chan.zmtp else "_waited"
        real = getattr(chmod.Channel, name)
        kept: list[float] = []

        def waited(self: chmod.Channel, *a: Any, **kw: Any) -> Any:
            if not kept and self is c._chan:
                deadline = a[2] if name == "_waited" else a[1]
                while time.monotonic() <= deadline:
                    time.sleep(max(0.0, deadline - time.monotonic()) + 0.001)
                kept.append(deadline)
            return real(self, *a, **kw)

        monkeypatch.setattr(chmod.Channel, name, waited)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ServerUnavailable, match="did not run for"):
                c.exists_batch([key, key + b"-no"])
        finally:
            os.kill(server.pid, signal.SIGCONT)
        monkeypatch.undo()
        assert c.get(key) == b"v"
