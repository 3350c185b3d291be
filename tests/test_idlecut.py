"""Connections that never say HELLO are shut down; legitimate clients never are
(kvshm/zmq_ctrl/admission.py; docs/RELIABILITY.md, "Limits").

Raw peers speak ZMTP 3.0 (NULL, as a DEALER) over a plain socket, so that each test
decides when, and whether, HELLO is said. A connection the server shut down is seen as
the end of its stream (``recv`` returns b"", or ECONNRESET). Waits are on what the server
did (a canary connection, opened after the connection under test, shut down), never a
sleep, except the one that is the thing tested (a client slow to say HELLO).
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import tempfile
import time
from typing import Any

import pytest
import zmq

from kvshm import Client
from kvshm.security import find_token
from kvshm.zmq_ctrl import admission
from kvshm.zmq_ctrl.channel import endpoint_of
from kvshm.zmq_ctrl.protocol import Op, Status, decode_reply, encode_request
from servers import ServerProcess

pytestmark = pytest.mark.timeout(120)

#: the longest a test waits for the server to shut a connection down (s); a fail
WAIT_S = 40.0


def _recvn(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        more = s.recv(n - len(got))
        if not more:
            raise EOFError("the server closed the connection")
        got += more
    return got


def peer(address: str, identity: bytes = b"") -> socket.socket:
    """A raw TCP connection that did ZMTP 3.0's NULL handshake as a DEALER (routing id
    ``identity``, or none: the server picks one), the server's READY read."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10.0)
    try:
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
                  + b"\0" * 32)
        _recvn(s, 64)
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        if identity:
            ready += b"\x08Identity" + struct.pack(">I", len(identity)) + identity
        s.sendall(bytes([0x04, len(ready)]) + ready)
        flags, _ = _frame(s)
        assert flags & 4, "no READY from the server"
    except BaseException:
        s.close()
        raise
    return s


def _frame(s: socket.socket) -> tuple[int, bytes]:
    flags = _recvn(s, 1)[0]
    size = struct.unpack(">Q", _recvn(s, 8))[0] if flags & 2 else _recvn(s, 1)[0]
    return flags, _recvn(s, size)


def request(s: socket.socket, op: int, rid: int, epoch: int,
            body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Send one request (its header frame) and read its reply: (status, body)."""
    h = encode_request(op, rid, epoch, body)
    s.sendall((bytes([0, len(h)]) if len(h) < 256 else b"\x02" + struct.pack(">Q", len(h)))
              + h)
    while True:
        parts = []
        while True:
            flags, body_ = _frame(s)
            if flags & 4:
                continue                    # a command (PING...)
            parts.append(body_)
            if not flags & 1:
                break
        st, got, rbody = decode_reply(parts[0])
        if got == rid:
            return st, rbody


def hello(s: socket.socket, address: str) -> dict[str, Any]:
    tok = find_token(endpoint_of(address))
    assert tok is not None
    st, body = request(s, Op.HELLO, 1, 0, {"nonce": os.urandom(16), "token": tok})
    assert st == Status.OK, body
    return body


def is_shut(s: socket.socket) -> bool:
    """Whether the server ended this connection (nothing else is read: a peer under
    test sends nothing the server answers)."""
    s.setblocking(False)
    try:
        while True:
            try:
                b = s.recv(65536)
            except BlockingIOError:
                return False
            except (ConnectionResetError, BrokenPipeError):
                return True
            if not b:
                return True
    finally:
        s.setblocking(True)


def wait_shut(socks: list[socket.socket], n: int) -> list[bool]:
    """Wait until at least ``n`` of ``socks`` were shut down by the server (WAIT_S at
    most: then the test fails); returns which were."""
    deadline = time.monotonic() + WAIT_S
    while True:
        shut = [is_shut(s) for s in socks]
        if sum(shut) >= n:
            return shut
        assert time.monotonic() < deadline, f"only {sum(shut)} of {n} shut down"
        time.sleep(0.05)


def server_errors(address: str) -> dict[str, int]:
    with Client(address, transport="tcp", timeout=10) as c:
        return c.stats()["error_kinds"]


def test_a_slow_client_that_says_hello_late_is_served_and_never_cut_then():
    """A client that says HELLO late (1 s after its handshake; the server's limit is
    3 s) is served, and its connection is never shut down afterwards (it goes on being
    served on the same connection once a canary opened after its HELLO, which says
    nothing, was shut down). A client that goes on under its routing id on a new
    connection (as libzmq and the ZMTP client do after a drop) is told "say HELLO" by
    its first request there, through the C fast path (EXISTS of one key) and through
    the Python path (STATS): its session is bound to the connection its HELLO came on
    (tests/test_sessbind.py); the HELLO it then says admits the new connection."""
    with ServerProcess("--hello-timeout", "3") as srv:
        slow = peer(srv.address)
        rid_again = os.urandom(16)
        first = peer(srv.address, identity=rid_again)
        socks = [slow, first]
        try:
            time.sleep(1.0)                 # slow to say HELLO: what is tested
            epoch = hello(slow, srv.address)["epoch"]
            hello(first, srv.address)
            first.close()                   # dropped; made again under its routing id
            socks.remove(first)
            kept = None
            for op, body in ((Op.EXISTS, {"keys": [b"k"]}), (Op.STATS, {})):
                deadline = time.monotonic() + WAIT_S
                while True:
                    s = peer(srv.address, identity=rid_again)
                    socks.append(s)
                    try:
                        st, rbody = request(s, op, 2, epoch, body)
                        if st == Status.STALE_EPOCH:
                            # not the session's connection: HELLO on it, then served
                            assert "HELLO" in rbody["error"], rbody
                            hello(s, srv.address)
                            st, rbody = request(s, op, 3, epoch, body)
                    except (EOFError, OSError) as exc:
                        st, rbody = -1, {"error": repr(exc)}
                    if st == Status.OK:
                        break
                    # the old connection still held the routing id (its end not seen
                    # yet by libzmq), so libzmq refused this one (closed it, or gave it
                    # another id: no session): made again
                    socks.remove(s)
                    s.close()
                    assert time.monotonic() < deadline, rbody
                if op == Op.EXISTS:         # (the fast path's): its id freed for the next
                    socks.remove(s)
                    s.close()
                else:
                    kept = s
            assert kept is not None
            canary = peer(srv.address)
            socks.append(canary)
            wait_shut([canary], 1)
            assert not is_shut(slow)
            st, _ = request(slow, Op.EXISTS, 3, epoch, {"keys": [b"k"]})
            assert st == Status.OK
            assert not is_shut(kept)
            st, _ = request(kept, Op.STATS, 4, epoch, {})
            assert st == Status.OK
        finally:
            for s in socks:
                s.close()
        errs = server_errors(srv.address)
        assert errs.get("unadmitted_cut", 0) >= 1
        assert srv.alive(), srv.stderr_text


def test_every_kind_of_client_is_kept_while_a_peer_without_hello_is_cut(monkeypatch):
    """Clients of every kind, each idle after its HELLO for longer than the server's
    limit (2 s), are served on their connections afterwards: the ZMTP TCP client, a
    libzmq one (``KVSHM_ZMTP=0``'s path), the same-host shm client, the async client;
    only the canary, which never said HELLO, was shut down (``unadmitted_cut`` 1)."""
    import kvshm.zmq_ctrl.channel as channel
    from kvshm.aio import AsyncClient

    with ServerProcess("--hello-timeout", "2") as srv:
        zmtp = Client(srv.address, transport="tcp", timeout=10)
        monkeypatch.setattr(channel, "ZMTP", False)
        lib = Client(srv.address, transport="tcp", timeout=10)
        monkeypatch.setattr(channel, "ZMTP", True)
        local = Client(srv.address, timeout=10)
        loop = asyncio.new_event_loop()
        aio = loop.run_until_complete(_aio_open(AsyncClient, srv.address))
        try:
            assert zmtp._chan.zmtp and not lib._chan.zmtp
            for c in (zmtp, lib, local):
                c.put(b"k", b"v")
            canary = peer(srv.address)
            try:
                wait_shut([canary], 1)
            finally:
                canary.close()
            for c in (zmtp, lib, local):
                assert c.get(b"k") == b"v"
            assert loop.run_until_complete(aio.get(b"k")) == b"v"
            assert zmtp._chan.reconnects == 0
            errs = zmtp.stats()["error_kinds"]
            assert errs.get("unadmitted_cut", 0) == 1, errs
            assert errs.get("unadmitted_bound", 0) == 0, errs
        finally:
            loop.run_until_complete(aio.close())
            loop.close()
            for c in (zmtp, lib, local):
                c.close()


async def _aio_open(cls: Any, address: str) -> Any:
    c = cls(address, transport="tcp", timeout=10)
    await c.put(b"a", b"b")
    return c


def test_unadmitted_connections_are_bounded_oldest_cut_first():
    """With ``--max-unadmitted 4`` (and a timer far away), 10 peers that never say
    HELLO: the 6 oldest are shut down, the 4 newest kept, and a client is served (its
    connections, held until their HELLO, push out the oldest ones left)."""
    with ServerProcess("--hello-timeout", "600", "--max-unadmitted", "4") as srv:
        socks = []
        try:
            for _ in range(10):
                socks.append(peer(srv.address))
            shut = wait_shut(socks, 6)
            assert shut == [True] * 6 + [False] * 4
            with Client(srv.address, transport="tcp", timeout=10) as c:
                c.put(b"after", b"ok")
                assert c.get(b"after") == b"ok"
                errs = c.stats()["error_kinds"]
            # the client's own connections, held until their HELLO, pushed out more of
            # the oldest: still the oldest first
            shut = [is_shut(s) for s in socks]
            k = sum(shut)
            assert shut == [True] * k + [False] * (10 - k) and k < 10
            assert errs.get("unadmitted_bound", 0) >= k, errs
            assert errs.get("unadmitted_cut", 0) == 0, errs
        finally:
            for s in socks:
                s.close()
        assert srv.alive(), srv.stderr_text


def test_the_bound_follows_the_descriptor_limit_and_the_switch_turns_it_off():
    """At most a quarter of the soft RLIMIT_NOFILE (read at each accept) is held; with
    KVSHM_HELLO_CUT=0 nothing is held, nothing shut down."""
    import resource

    class L(admission.AdmissionMixin):
        max_unadmitted = 256

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    want = 256 if soft == resource.RLIM_INFINITY else max(1, min(256, soft // 4))
    assert L()._unadmitted_bound() == want
    with ServerProcess("--hello-timeout", "1", env={"KVSHM_HELLO_CUT": "0"}) as srv:
        first = peer(srv.address)
        try:
            with Client(srv.address, transport="tcp", timeout=10) as c:
                c.put(b"k", b"v")
                # the server serves on; no connection is held (none counted)
                errs = c.stats()["error_kinds"]
            assert "unadmitted_cut" not in errs and "unadmitted_bound" not in errs
            assert not is_shut(first)
        finally:
            first.close()


# --------------------------------------------------- the fd number reused (white box)


class _Mon:
    """A monitor socket's stand-in: the events queued, as libzmq's v1 messages."""

    def __init__(self) -> None:
        self.q: list[list[bytes]] = []

    def put(self, event: int, fd: int) -> None:
        self.q.append([struct.pack("=HI", event, fd), b"ipc://" + _listener()[1].encode()])

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.q:
            raise zmq.Again()
        return self.q.pop(0)


class _Loop(admission.AdmissionMixin):
    def __init__(self) -> None:
        self.errors: dict[str, int] = {}
        self._unadmitted = __import__("collections").OrderedDict()
        self._admitted = {}
        self._by_ident = {}
        self._monitor = _Mon()
        self._admitting = True
        self.hello_timeout = 5.0
        self.max_unadmitted = 256

    def _count_error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


class _Frame:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def get(self, k: Any) -> Any:
        assert k == zmq.SRCFD
        return self.fd


_LISTENER: list[Any] = []


def _listener() -> tuple[socket.socket, str]:
    """One listening AF_UNIX socket for the white-box tests (closed, its file and
    directory removed, at the end of the module: the fixture below)."""
    if not _LISTENER:
        d = tempfile.mkdtemp(prefix="kvshm-test-idlecut-")
        path = os.path.join(d, "s")
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(path)
        ls.listen(8)
        _LISTENER.extend([ls, path, d])
    return _LISTENER[0], _LISTENER[1]


@pytest.fixture(autouse=True, scope="module")
def _close_listener():
    yield
    if _LISTENER:
        ls, path, d = _LISTENER
        ls.close()
        os.unlink(path)
        os.rmdir(d)
        _LISTENER.clear()


def _pair() -> tuple[socket.socket, socket.socket]:
    """(a connection accepted on the listener, its peer)."""
    ls, path = _listener()
    b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    b.connect(path)
    a, _ = ls.accept()
    a.settimeout(5)
    b.settimeout(5)
    return a, b


def _reuse() -> tuple[int, tuple[int, int, int], socket.socket, socket.socket]:
    """A connection's fd closed and its number given to another socket: (fd, the old
    connection as conn_of named it, the new socket, its peer)."""
    old, old_peer = _pair()
    fd = old.fileno()
    st = os.fstat(fd)
    gone = (fd, st.st_dev, st.st_ino)
    old.close()
    old_peer.close()
    new, new_peer = _pair()
    if new.fileno() != fd:          # the kernel gives the lowest free number: another
        new.close()                 # thread took it; the case cannot be made here
        new_peer.close()
        pytest.skip("the fd number was not reused")
    return fd, gone, new, new_peer


def _alive(a: socket.socket, b: socket.socket) -> bool:
    try:
        a.sendall(b"x")
        return b.recv(1) == b"x"
    except OSError:
        return False


def test_a_reused_fd_number_is_never_cut_for_the_connection_that_had_it():
    """A connection held unadmitted whose fd number went to another socket (its end
    not read yet): the timer and the bound leave the other socket alone (its inode is
    another); a held entry that is still its socket is shut down."""
    loop = _Loop()
    fd, gone, new, new_peer = _reuse()
    try:
        loop._unadmitted[fd] = (gone[1], gone[2], 0.0)       # due long ago
        loop._cut_unadmitted(time.monotonic())
        assert not loop._unadmitted
        assert _alive(new, new_peer) and _alive(new_peer, new)
        st = os.fstat(fd)
        loop._unadmitted[fd] = (st.st_dev, st.st_ino, 0.0)   # this socket's: shut
        loop._cut_unadmitted(time.monotonic())
        assert new_peer.recv(1) == b""
        assert loop.errors["unadmitted_cut"] == 2
    finally:
        new.close()
        new_peer.close()


class _NoFreeDescriptor:
    """While entered, this process has no descriptor free: the soft RLIMIT_NOFILE just
    above the highest open fd, every number below it taken by /dev/null (dup(2) then
    fails with EMFILE). Restored on exit."""

    def __enter__(self) -> "_NoFreeDescriptor":
        import resource

        self.old = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.fill: list[int] = []
        top = max(int(x) for x in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 8, self.old[1]))
        try:
            while True:
                self.fill.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            pass
        return self

    def __exit__(self, *exc: Any) -> None:
        import resource

        for fd in self.fill:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, self.old)


def test_a_connection_due_while_no_descriptor_is_free_stays_held_and_is_cut_later():
    """A held connection whose time is up while the process has no descriptor free
    (shut_conn's dup fails with EMFILE: it cannot be told whether the fd is still that
    connection): not dropped, nothing shut down; held first in line, due a moment later;
    cut at the next timer once a descriptor is free (counted once). The bound's cut
    likewise leaves the oldest held for the timer."""
    from kvshm.zmq_ctrl import sends

    loop = _Loop()
    a, b = _pair()
    c, d = _pair()
    try:
        for s in (a, c):
            st = os.fstat(s.fileno())
            loop._unadmitted[s.fileno()] = (st.st_dev, st.st_ino, 0.0)   # due long ago
        with _NoFreeDescriptor():
            assert sends.shut_conn((a.fileno(), *loop._unadmitted[a.fileno()][:2])) \
                == sends.UNTOLD
            now = time.monotonic()
            loop._cut_unadmitted(now)
            assert list(loop._unadmitted) == [a.fileno(), c.fileno()]
            assert loop._unadmitted[a.fileno()][2] > now
            assert loop._admission_deadline() == loop._unadmitted[a.fileno()][2]
            loop._cut_unadmitted(now + 3600)        # still none free: held again
            assert list(loop._unadmitted) == [a.fileno(), c.fileno()]
        assert _alive(a, b) and _alive(c, d)
        assert "unadmitted_cut" not in loop.errors
        loop._cut_unadmitted(loop._admission_deadline())
        assert not loop._unadmitted
        assert b.recv(1) == b"" and d.recv(1) == b""
        assert loop.errors["unadmitted_cut"] == 2
        # over the bound with no descriptor free: the oldest held, for the timer
        loop.max_unadmitted = 1
        e, f = _pair()
        g, h = _pair()
        try:
            with _NoFreeDescriptor():
                for s in (e, g):
                    loop._monitor.put(zmq.EVENT_ACCEPTED, s.fileno())
                loop._on_monitor()
                assert list(loop._unadmitted) == [e.fileno(), g.fileno()]
            assert _alive(e, f)
            loop._cut_unadmitted(loop._admission_deadline())
            assert f.recv(1) == b""
            assert list(loop._unadmitted) == [g.fileno()] and _alive(g, h)
        finally:
            for s in (e, f, g, h):
                s.close()
    finally:
        for s in (a, b, c, d):
            s.close()


def test_events_read_late_never_hold_an_admitted_connection_on_a_reused_number():
    """The old connection's DISCONNECTED and the new one's ACCEPTED are read after the
    new one's HELLO was served (same fd number): the new one is not held (so never
    cut); a later connection on that number, never admitted, is held."""
    loop = _Loop()
    fd, gone, new, new_peer = _reuse()
    try:
        loop._admitted[fd] = gone[1:]               # the old connection, admitted
        loop._admit(_Frame(fd))                     # the new one's HELLO, served
        loop._monitor.put(zmq.EVENT_DISCONNECTED, fd)   # the old one's end
        loop._monitor.put(zmq.EVENT_ACCEPTED, fd)       # the new one, accepted
        loop._on_monitor()
        assert fd not in loop._unadmitted
        loop._cut_unadmitted(time.monotonic() + 3600)
        assert _alive(new, new_peer)
        # the new one ends; a third on the number, never admitted: held, then cut
        loop._monitor.put(zmq.EVENT_DISCONNECTED, fd)
        new.close()
        new_peer.close()
        third, third_peer = _pair()
        assert third.fileno() == fd
        new, new_peer = third, third_peer
        loop._monitor.put(zmq.EVENT_ACCEPTED, fd)
        loop._on_monitor()
        assert fd in loop._unadmitted and fd not in loop._admitted
        loop._cut_unadmitted(time.monotonic() + 3600)
        assert new_peer.recv(1) == b""
    finally:
        new.close()
        new_peer.close()


def test_the_monitor_adds_no_wake_up_per_request_nor_while_idle():
    """Single-key requests of an admitted client are still served in the loop's lean
    turns (C) with the monitor on, and an idle server does not wake for it: counted
    hand-backs (``lean_returns``), not timed. 2000 EXISTS make at most a few dozen
    hand-backs (timers), as many as with ``KVSHM_HELLO_CUT=0``'s server give or take."""
    for env in ({}, {"KVSHM_HELLO_CUT": "0"}):
        with ServerProcess(env=env) as srv:
            canary = peer(srv.address)              # a connection event, before
            canary.close()
            with Client(srv.address, transport="tcp", timeout=10) as c:
                c.put(b"k", b"v")
                f0 = c.stats()["fast_path"]
                for _ in range(2000):
                    assert c.exists(b"k")
                f1 = c.stats()["fast_path"]
                time.sleep(0.5)                      # idle: wake-ups counted over it
                f2 = c.stats()["fast_path"]
            assert f1["lean_turns"] - f0["lean_turns"] >= 1000, (env, f0, f1)
            assert f1["lean_returns"] - f0["lean_returns"] < 100, (env, f0, f1)
            assert f2["lean_returns"] - f1["lean_returns"] < 20, (env, f1, f2)


def test_wait_in_polls_a_monitor_by_its_descriptor():
    """``_zmqc.wait_in`` with a monitor's ``ZMQ_FD`` (an int): 4 once an event is queued,
    nothing once the monitor was read until EAGAIN (the lean turns' wait)."""
    _zmqc = pytest.importorskip("kvshm.zmq_ctrl._zmqc")
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    try:
        r.bind("tcp://127.0.0.1:0")
        mon = r.get_monitor_socket(zmq.EVENT_ACCEPTED)
        try:
            def drain() -> int:
                n = 0
                while True:
                    try:
                        mon.recv_multipart(zmq.NOBLOCK)
                        n += 1
                    except zmq.Again:
                        return n
            drain()
            fd = mon.getsockopt(zmq.FD)
            assert _zmqc.wait_in(r, -1, fd, 0) == 0
            port = int(r.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            try:
                assert _zmqc.wait_in(r, -1, fd, 10_000) & 4
                assert drain() == 1
                assert _zmqc.wait_in(r, -1, fd, 0) == 0
            finally:
                s.close()
        finally:
            r.disable_monitor()
            mon.close(0)
    finally:
        r.close(0)
        ctx.term()


def test_bad_hello_timeout_or_bound_is_a_clear_error():
    """ServerConfig and ServiceLoop refuse a negative, non-number or infinite
    ``hello_timeout`` and a ``max_unadmitted`` below 1, naming the option; the CLI too."""
    from kvshm.cli import main
    from kvshm.server import ConfigError, ServerConfig

    ServerConfig(hello_timeout=0, max_unadmitted=1).validate()
    for kw, opt in (({"hello_timeout": -1}, "hello_timeout"),
                    ({"hello_timeout": float("nan")}, "hello_timeout"),
                    ({"hello_timeout": float("inf")}, "hello_timeout"),
                    ({"hello_timeout": "5"}, "hello_timeout"),
                    ({"max_unadmitted": 0}, "max_unadmitted"),
                    ({"max_unadmitted": 2.5}, "max_unadmitted")):
        with pytest.raises(ConfigError) as ei:
            ServerConfig(**kw).validate()
        assert ei.value.option == opt
    loop = _Loop()
    loop.door_token = b"t"
    for a, b in ((-1.0, 4), (1.0, 0), (True, 4)):
        with pytest.raises(ValueError):
            loop._init_admission(a, b, False)
    for flag in (["--hello-timeout", "-1"], ["--max-unadmitted", "0"]):
        with pytest.raises(SystemExit) as ei:
            main(["serve", *flag])
        assert ei.value.code == 2


def test_an_accepted_event_read_after_its_number_went_to_another_socket_holds_nothing():
    """ACCEPTED read late, its fd number given meanwhile to a socket that was not
    accepted on that endpoint (another thread's: a socketpair here, a TCP socket):
    nothing is held, so nothing of it is ever shut down."""
    loop = _Loop()
    a, b = socket.socketpair()
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        for s in (a, t):
            loop._monitor.put(zmq.EVENT_ACCEPTED, s.fileno())
        loop._on_monitor()
        assert not loop._unadmitted
        x, y = _pair()
        try:
            loop._monitor.put(zmq.EVENT_ACCEPTED, x.fileno())    # one of ours: held
            loop._on_monitor()
            assert list(loop._unadmitted) == [x.fileno()]
        finally:
            x.close()
            y.close()
    finally:
        for s in (a, b, t):
            s.close()
