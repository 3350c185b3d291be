"""Issue 12, the rest: operator-only ops, BYE, dead servers' token files, sessions that a
routing id cannot be stolen from.

Each test reproduces what was wrong on main before (a ``nobody`` door-token holder could
PURGE, EVICT and DRAIN; a closed TCP client's session lingered; a SIGKILLed server's
token files stayed forever) or pins a property the design relies on (another connection
cannot take over a session by claiming its ZeroMQ routing id).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import msgpack
import pytest
import zmq

import kvshm
from kvshm import Client
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply
from servers import ServerProcess, bearer
from test_faults import wait_for

IS_ROOT = os.geteuid() == 0


def _dealer(address: str, ident: bytes | None = None) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if ident is not None:
        s.setsockopt(zmq.ROUTING_ID, ident)
    s.connect(f"tcp://{address}")
    return s


def _call(s: zmq.Socket, op: int, body: dict, rid: int, epoch: int) -> tuple[int, dict]:
    s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, epoch, body], use_bin_type=True))
    assert s.poll(10_000), f"no reply to op {op}"
    st, _, rbody = decode_reply(s.recv_multipart()[0])
    return st, rbody


def _tokens(address: str) -> tuple[bytes, bytes]:
    from kvshm.security import find_operator_token, find_token
    from kvshm.zmq_ctrl.channel import endpoint_of

    ep = endpoint_of(address)
    door, op = find_token(ep), find_operator_token(ep)
    assert door is not None and op is not None
    return door, op


# ---------------------------------------------------------------- operator ops

def test_door_token_alone_cannot_purge_evict_or_drain():
    """A HELLO with only the door token (what a user given ``--token-file`` holds) may
    read and write but not PURGE, EVICT or DRAIN; with the operator token it may."""
    with ServerProcess() as srv:
        door, op = _tokens(srv.address)
        with Client(srv.address) as c:
            c.put("keep", b"k" * 100)
        s = _dealer(srv.address)
        try:
            st, hello = _call(s, Op.HELLO, {"nonce": os.urandom(16), "token": door}, 1, 0)
            assert st == Status.OK
            ep = hello["epoch"]
            st, body = _call(s, Op.EXISTS, {"keys": [b"keep"]}, 2, ep)
            assert st == Status.OK and body["found"] == [True]
            for rid, (o, b) in enumerate(((Op.PURGE, {}), (Op.EVICT, {"ratio": 0.0}),
                                          (Op.DRAIN, {})), 3):
                st, body = _call(s, o, b, rid, ep)
                assert st == Status.UNAUTHORIZED, (o, st, body)
                assert "operator" in body["error"]
            st, body = _call(s, Op.EXISTS, {"keys": [b"keep"]}, 9, ep)
            assert body["found"] == [True]                  # nothing was purged
            st, _ = _call(s, Op.HELLO, {"nonce": os.urandom(16), "token": door,
                                        "operator_token": op}, 10, 0)
            assert st == Status.OK
            st, body = _call(s, Op.PURGE, {}, 11, ep)
            assert st == Status.OK and body["n"] == 1
            st, body = _call(s, Op.HELLO, {"nonce": os.urandom(16), "token": door,
                                           "operator_token": os.urandom(32)}, 12, 0)
            assert st == Status.OK                          # a wrong one: no operator
            st, body = _call(s, Op.PURGE, {}, 13, ep)
            assert st == Status.UNAUTHORIZED
        finally:
            s.close()


def test_same_user_tcp_client_and_ctl_find_the_operator_token():
    """``kvshm ctl purge`` (a TCP client, no liveness proof) finds the operator token of
    a server of its own user by itself."""
    with ServerProcess() as srv:
        with Client(srv.address, transport="tcp") as c:
            c.put_batch(["a", "b"], [b"1", b"2"])
            assert c.evict(1.0) == 0
        r = subprocess.run([sys.executable, "-m", "kvshm", "ctl", "--address", srv.address,
                            "purge"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr


NOBODY_OPS = """
    import json, sys, urllib.request, urllib.error, kvshm
    from kvshm.zmq_ctrl.protocol import Op
    address, manage, tok = sys.argv[1], sys.argv[2], sys.argv[3]
    out = {}
    c = kvshm.Client(address, transport="auto", timeout=10, token_file=tok)
    c.put("mine", b"n" * 100)
    out["read"] = c.get("theirs").decode()
    out["wrote"] = c.get("mine").decode()[:1]
    for name, call in (("purge", c.purge), ("evict", lambda: c.evict(0.0)),
                       ("drain", lambda: c.run_op(c.session.op_simple(Op.DRAIN, {}, "drain")))):
        try:
            call()
            out[name] = "done"
        except kvshm.AuthenticationFailed as e:
            out[name] = "refused" if "operator" in str(e) else str(e)
    door = open(tok).read().strip()
    try:
        urllib.request.urlopen(urllib.request.Request(
            manage + "/purge", method="POST",
            headers={"Authorization": "Bearer " + door}), timeout=10)
        out["/purge"] = 200
    except urllib.error.HTTPError as e:
        out["/purge"] = e.code
    print(json.dumps(out), flush=True)
"""


def test_nobody_with_a_door_token_reads_and_writes_but_cannot_purge_evict_drain(tmp_path):
    """Before: a door-token holder of another user could PURGE, EVICT and DRAIN (and
    POST /purge with the door token)."""
    if not IS_ROOT or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as nobody")
    import tempfile

    shared = tempfile.mkdtemp(prefix="kvshm-test-token-")
    os.chmod(shared, 0o755)
    tok = os.path.join(shared, "kvshm.token")
    try:
        with ServerProcess("--token-file", tok) as srv, Client(srv.address) as c:
            c.put("theirs", b"t" * 100)
            os.chown(tok, 0, 65534)          # the group of nobody (nogroup) may read it
            r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup",
                                "--clear-groups", sys.executable, "-c",
                                textwrap.dedent(NOBODY_OPS), srv.address,
                                f"http://127.0.0.1:{srv.manage_port}", tok],
                               capture_output=True, text=True, timeout=120,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                                    "HOME": "/tmp"})
            assert r.returncode == 0, r.stderr
            got = json.loads(r.stdout)
            assert got == {"read": "t" * 100, "wrote": "n", "purge": "refused",
                           "evict": "refused", "drain": "refused", "/purge": 401}, got
            assert c.exists_batch(["theirs", "mine"]) == [True, True]
            assert c.purge() == 2            # a local client of the server's uid may
    finally:
        shutil.rmtree(shared)


# ---------------------------------------------------------------- dead servers' token files

HOLDER = """
    import sys, time
    from kvshm import security
    security._RUN_DIR = sys.argv[1]
    door = security.DoorToken([f"tcp://127.0.0.1:{sys.argv[2]}"])
    print("ready", flush=True)
    time.sleep(600)
"""


def test_token_files_of_a_sigkilled_server_are_removed_never_a_live_ones(tmp_path,
                                                                          monkeypatch):
    """Before: a server killed with SIGKILL left <port>.token in kvshm-run-<uid> for
    ever. Now each server flocks its token files; cleanup removes the unlocked ones."""
    from kvshm import security

    monkeypatch.setattr(security, "_RUN_DIR", str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(tmp_path),
                          "40101"], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    live = None
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        d = security.run_dir()
        dead = [os.path.join(d, n) for n in ("40101.operator", "40101.token")]
        assert sorted(os.listdir(d)) == ["40101.operator", "40101.token"]
        live = security.DoorToken(["tcp://127.0.0.1:40102"])
        assert security.cleanup_tokens() == []          # both alive: nothing goes
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        assert sorted(os.listdir(d)) == ["40101.operator", "40101.token",
                                         "40102.operator", "40102.token"]   # left behind
        assert sorted(security.cleanup_tokens(dry_run=True)) == dead
        assert sorted(security.cleanup_tokens()) == dead
        assert sorted(os.listdir(d)) == ["40102.operator", "40102.token"]
        assert security.find_token("tcp://127.0.0.1:40102") == live.token
        live.close()
        live = None
        assert not os.path.exists(d)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        if p.stdout is not None:
            p.stdout.close()
        if live is not None:
            live.close()


def test_ctl_cleanup_removes_a_sigkilled_servers_token_files():
    from kvshm.security import operator_token_path, token_path

    with ServerProcess() as alive:
        srv = ServerProcess()
        files = [f(f"tcp://127.0.0.1:{srv.port}") for f in (token_path, operator_token_path)]
        keep = [f(f"tcp://127.0.0.1:{alive.port}") for f in (token_path, operator_token_path)]
        assert all(os.path.exists(f) for f in files + keep)
        srv.kill()
        try:
            r = subprocess.run([sys.executable, "-m", "kvshm", "ctl", "cleanup"],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            # (a server started meanwhile by another test may have removed them first)
            assert not any(os.path.exists(f) for f in files), r.stdout
            assert all(os.path.exists(f) for f in keep)
            with Client(alive.address, transport="tcp") as c:   # its door still opens
                c.put("k", b"v")
        finally:
            srv.remove_segment()


# ---------------------------------------------------------------- pool creation in steps

def test_pool_create_looks_at_stop_between_steps_and_leaves_nothing():
    """Before: Pool.create reserved and populated the whole pool in one call (seconds,
    holding the inode lock an unlink waits for); a stop request waited for all of it."""
    from kvshm._pool import CREATE_STEP, CreateStopped, Pool
    from servers import segment_exists, unique_shm_name

    size = 4 * CREATE_STEP
    if shutil.disk_usage("/dev/shm").free < size + (256 << 20):
        pytest.skip("needs 4 steps of free space in /dev/shm")
    name = unique_shm_name("step-")
    calls = []

    def stop() -> bool:
        calls.append(segment_exists(name))
        return len(calls) == 3              # in the middle of the reservation

    with pytest.raises(CreateStopped):
        Pool.create(name, size, 65536, stop=stop)
    assert calls == [True, True, True]      # asked once per step, the segment there
    assert not segment_exists(name)
    calls.clear()
    with pytest.raises(CreateStopped):       # in the middle of pre-faulting
        Pool.create(name, size, 65536, stop=lambda: calls.append(1) or len(calls) == 6)
    assert not segment_exists(name)
    calls.clear()
    with Pool.create(name, size, 65536, stop=lambda: calls.append(1) or False) as pool:
        assert len(calls) >= 5              # every step of both phases asked
        pool.write(size - 5, b"tail!")
        assert pool.read_bytes(size - 5, 5) == b"tail!"
    assert not segment_exists(name)


def test_unlink_during_a_large_create_does_not_wait_for_all_of_it():
    """The server's stop path unlinks the segment by name while the helper thread is
    still creating it; the helper then gives up at its next step and unmaps."""
    import threading

    from kvshm import segments
    from kvshm._pool import CREATE_STEP, CreateStopped, Pool
    from servers import segment_exists, unique_shm_name

    size = 8 * CREATE_STEP
    if shutil.disk_usage("/dev/shm").free < size + (256 << 20):
        pytest.skip("needs 8 steps of free space in /dev/shm")
    name = unique_shm_name("unl-")
    flag = threading.Event()
    steps = []
    box = {}

    def stop() -> bool:
        steps.append(1)
        if len(steps) == 2:
            flag.set()
        return box.get("stop", False)

    def make() -> None:
        try:
            box["pool"] = Pool.create(name, size, 65536, stop=stop)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=make)
    t.start()
    assert flag.wait(60)
    box["stop"] = True
    os.unlink(os.path.join(segments.SHM_DIR, name))
    t.join(60)
    assert not t.is_alive()
    assert isinstance(box.get("error"), CreateStopped), box
    assert len(steps) < 16                   # it did not make the whole pool first
    assert not segment_exists(name)


# ---------------------------------------------------------------- BYE and idle sessions

def _sessions(admin: Client) -> int:
    return admin.stats()["sessions"]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_closed_tcp_client_ends_its_session_at_once(kind):
    """Before: a closed remote (TCP) client's grant-less session stayed until a cap of
    65,536 sessions trimmed it; now close() says BYE and the server ends it."""
    import asyncio

    with ServerProcess() as srv, Client(srv.address, transport="tcp") as admin:
        before = _sessions(admin)
        if kind == "sync":
            c = Client(srv.address, transport="tcp")
            c.put("k", b"v" * 100)
            assert _sessions(admin) == before + 1
            c.close()
        else:
            async def run() -> None:
                c = kvshm.AsyncClient(srv.address, transport="tcp")
                await c.connect()
                await c.put("k", b"v" * 100)
                assert _sessions(admin) == before + 1
                await c.close()
            asyncio.run(run())
        wait_for(lambda: _sessions(admin) == before, timeout=20,
                 what="the closed client's session to end")
        assert admin.get("k") == b"v" * 100


def test_bye_settles_every_grant_of_the_session():
    with ServerProcess() as srv, Client(srv.address, transport="tcp") as admin:
        door, _ = _tokens(srv.address)
        s = _dealer(srv.address)
        try:
            st, hello = _call(s, Op.HELLO, {"nonce": os.urandom(16), "token": door}, 1, 0)
            ep = hello["epoch"]
            st, body = _call(s, Op.ALLOC, {"keys": [b"a", b"b"], "sizes": [1000, 70000]},
                             2, ep)
            assert st == Status.OK, body
            assert admin.stats()["pending"] == 2
            before = _sessions(admin)
            st, body = _call(s, Op.BYE, {}, 3, ep)
            assert st == Status.OK and body["settled"] == 1
            st_ = admin.stats(verify=True)
            assert st_["pending"] == 0 and st_["grants"] == 0 and st_["accounting_ok"]
            assert st_["sessions"] == before - 1
            st, body = _call(s, Op.EXISTS, {"keys": [b"a"]}, 4, ep)
            assert st == Status.STALE_EPOCH and "HELLO" in body["error"]   # it is gone
        finally:
            s.close()


def test_idle_remote_session_is_closed_and_its_client_comes_back():
    """A remote client that vanished without BYE (killed, unplugged) leaves a grant-less
    session: closed after --session-idle-timeout; a client that was merely quiet says
    HELLO again by itself."""
    with ServerProcess("--session-idle-timeout", "0.5") as srv, \
            Client(srv.address, transport="tcp") as quiet:
        quiet.put("q", b"1" * 100)
        door, _ = _tokens(srv.address)
        s = _dealer(srv.address)
        try:
            _call(s, Op.HELLO, {"nonce": os.urandom(16), "token": door}, 1, 0)
        finally:
            s.close()                       # gone without BYE
        with Client(srv.address, transport="tcp", connect=False) as probe:
            # every open session but the probe's own is idle soon: all of them end
            wait_for(lambda: _sessions(probe) == 1, timeout=30,
                     what="the idle sessions to be closed")
        assert quiet.get("q") == b"1" * 100     # HELLO again, transparently


# ---------------------------------------------------------------- routing ids

def test_another_connection_cannot_act_on_a_session_by_claiming_its_routing_id():
    """Before: ROUTER_HANDOVER was on, so a second connection that claimed a connected
    client's routing id took its connection over and acted as its session (no token
    needed) and got the replies meant for it. Now the claimant is not served while the
    owner is connected, and once the owner said BYE the id names no session."""
    with ServerProcess() as srv, Client(srv.address, transport="tcp") as admin:
        door, _ = _tokens(srv.address)
        ident = os.urandom(16)
        owner = _dealer(srv.address, ident)
        thief = None
        try:
            st, hello = _call(owner, Op.HELLO, {"nonce": os.urandom(16), "token": door},
                              1, 0)
            ep = hello["epoch"]
            admin.put("k", b"v" * 100)
            thief = _dealer(srv.address, ident)
            thief.send(msgpack.packb([PROTOCOL_VERSION, Op.DELETE, 7, ep,
                                      {"keys": [b"k"]}], use_bin_type=True))
            # the owner is still served on its connection, and the key is still there
            for rid in range(2, 6):
                st, body = _call(owner, Op.EXISTS, {"keys": [b"k"]}, rid, ep)
                assert st == Status.OK and body["found"] == [True]
            assert admin.exists("k")
            assert not thief.poll(0)
            st, body = _call(owner, Op.BYE, {}, 9, ep)
            assert st == Status.OK
            # with the session ended its routing id names nothing: a request on it is
            # told to say HELLO
            st, body = _call(owner, Op.DELETE, {"keys": [b"k"]}, 10, ep)
            assert st == Status.STALE_EPOCH and "HELLO" in body["error"], (st, body)
            assert admin.get("k") == b"v" * 100
        finally:
            for s in (owner, thief):
                if s is not None:
                    s.close()


def test_an_operator_of_another_user_purges_with_the_operator_token_file():
    """`kvshm ctl --operator-token-file`: the operator token given to another user
    (here nobody) lets it run operator ops; the door token alone does not."""
    if not IS_ROOT or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as nobody")
    import tempfile

    from kvshm.security import operator_token_path

    shared = tempfile.mkdtemp(prefix="kvshm-test-token-")
    os.chmod(shared, 0o755)
    tok = os.path.join(shared, "kvshm.token")
    op = os.path.join(shared, "kvshm.operator")
    try:
        with ServerProcess("--token-file", tok) as srv, Client(srv.address) as c:
            shutil.copyfile(operator_token_path(f"tcp://{srv.address}"), op)
            for f in (tok, op):
                os.chown(f, 0, 65534)
                os.chmod(f, 0o640)
            c.put_batch(["a", "b"], [b"1", b"2"])

            def ctl(*extra: str) -> subprocess.CompletedProcess:
                return subprocess.run(
                    ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                     sys.executable, "-m", "kvshm", "ctl", "--address", srv.address,
                     "--token-file", tok, *extra, "purge"],
                    capture_output=True, text=True, timeout=60,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                         "HOME": "/tmp"})

            r = ctl()
            assert r.returncode == 1 and "operator" in r.stderr, (r.stdout, r.stderr)
            assert c.exists_batch(["a", "b"]) == [True, True]
            r = ctl("--operator-token-file", op)
            assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr
            r = ctl("--operator-token-file", os.path.join(shared, "missing"))
            assert r.returncode == 2 and "--operator-token-file" in r.stderr
    finally:
        shutil.rmtree(shared)
