"""Issue 12: the server trusts only what the kernel or a key proves.

Each test reproduces a finding of the issue (it failed on the code before the fix):
hostile HELLO fields, clients in their own UTS or pid namespace stalled past the lease,
a pid-1 client killed, zero-byte ALLOCs, two connections of one principal, a peer that
never reads, user ``nobody`` at the doors, timeouts and cancellations that must not leak
grants.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import zmq

import kvshm
from kvshm import Client
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply
from servers import ServerProcess, bearer, raw_hello
from test_faults import run_py, wait_for, wait_line

IS_ROOT = os.geteuid() == 0


def _raw_socket(address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{address}")
    return s


def _call(s: zmq.Socket, op: int, body: dict, rid: int, epoch: int) -> tuple[int, dict]:
    s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, epoch, body], use_bin_type=True))
    assert s.poll(10_000), f"no reply to op {op}"
    st, _, rbody = decode_reply(s.recv_multipart()[0])
    return st, rbody


# ---------------------------------------------------------------- hostile HELLO

def test_hostile_hello_fields_cannot_crash_the_server():
    """HELLO with pid 2**40 and the server's own hostname, one ALLOC, then silence: at
    lease expiry the old server called os.kill(2**40, 0), which raised OverflowError out
    of its loop and ended the process (the whole cache lost)."""
    import socket as pysocket

    with ServerProcess("--lease-timeout", "0.3") as srv:
        s = _raw_socket(srv.address)
        try:
            from kvshm.security import find_token
            from kvshm.zmq_ctrl.channel import endpoint_of

            tok = find_token(endpoint_of(srv.address))
            hostile = {"nonce": os.urandom(16), "token": tok, "pid": 2 ** 40,
                       "host": pysocket.gethostname(), "client": "x" * 10_000,
                       "proof": True, "transport": ["shm"] * 100}
            st, h = _call(s, Op.HELLO, hostile, 1, 0)
            assert st == Status.OK and not h.get("local")    # no proof file: not local
            st, r = _call(s, Op.ALLOC, {"keys": [b"k"], "sizes": [10]}, 2, h["epoch"])
            assert st == Status.OK and r["st"] == [0]
            with Client(srv.address) as c:
                wait_for(lambda: c.stats()["pending"] == 0, what="the lease to expire")
                assert c.stats()["lease_expired_writes"] == 1
                c.put("alive", b"yes")
                assert c.get("alive") == b"yes"
        finally:
            s.close()
        assert srv.proc.poll() is None


# ---------------------------------------------------------------- namespaces

STALLING_WRITER = """
    import os, sys, time, kvshm
    from kvshm.movers import ShmMover
    orig = ShmMover.write
    def write(self, *a):
        # one line (two may arrive in one read, and wait_line selects on the pipe)
        print("allocated hostname", os.uname().nodename, "pid", os.getpid(), flush=True)
        sys.stdin.readline()                   # SIGSTOPped in here, past the lease
                                               # (then told to go on: no sleep to race)
        return orig(self, *a)
    ShmMover.write = write
    c = kvshm.Client(sys.argv[1], transport="shm", timeout=30)
    c.put_batch([f"late{i}" for i in range(4)], [b"L" * 65536] * 4)
    print("written", flush=True)
    c.close()
"""


def _ns_cmd(kind: str) -> list[str]:
    if kind == "uts":
        return ["unshare", "--uts", "--fork", "sh", "-c",
                'hostname kvshm-container && exec "$0" "$@"']
    return ["unshare", "--pid", "--fork", "--mount-proc"]


def _ns_available(kind: str) -> bool:
    if not IS_ROOT or shutil.which("unshare") is None:
        return False
    return subprocess.run([*_ns_cmd(kind), "true"], capture_output=True,
                          timeout=30).returncode == 0


@pytest.mark.parametrize("kind", ["uts", "pid"])
def test_client_in_own_namespace_stalled_past_lease_corrupts_nothing(kind, tmp_path):
    """A same-host client in its own UTS namespace (another hostname) or pid namespace
    (sharing /dev/shm, as containers with --ipc=host) is stopped between ALLOC and its
    copy, past the lease; the pool is refilled; then it resumes. The old server took
    it for a remote client (hostname) or could not see its pid, reclaimed its blocks
    and handed them to other keys: its late bytes landed in them, silently."""
    if not _ns_available(kind):
        pytest.skip(f"unshare --{kind} is not available here")
    import textwrap

    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(STALLING_WRITER))
    with ServerProcess("--lease-timeout", "0.5", "--max-client-pending", "0",
                       prealloc_size=1 / 256) as srv, Client(srv.address) as other:
        cap = other.stats()["capacity_bytes"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        p = subprocess.Popen([*_ns_cmd(kind), sys.executable, str(script), srv.address,
                              "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        try:
            line = wait_line(p, "allocated")
            if kind == "uts":
                assert "kvshm-container" in line
            else:
                assert line.split()[-1] == "1"         # pid 1 of its namespace
            # the process inside: the unshare'd child (or its only descendant)
            victim = _leaf(p.pid)
            os.kill(victim, signal.SIGSTOP)
            wait_for(lambda: other.stats()["held_grants"] >= 1, what="the lease to run out")
            n = cap // 65536 - 6
            other.purge()
            other.put_batch([f"other{j}" for j in range(n)],
                            [bytes([j % 251]) * 65536 for j in range(n)])
            os.kill(victim, signal.SIGCONT)
            p.stdin.write("go\n")
            p.stdin.flush()
            wait_line(p, "written")
            assert p.wait(30) == 0, p.stderr.read()
            bad = [j for j in range(n) if other.get(f"other{j}") != bytes([j % 251]) * 65536]
            assert bad == [], f"{len(bad)} of {n} other keys corrupted"
            assert other.get("late0") == b"L" * 65536
            st = other.stats(verify=True)
            assert st["accounting_ok"] and st["pending"] == 0
        finally:
            _kill_tree(p)
            p.stdin.close()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _leaf(pid: int) -> int:
    """The deepest single descendant of ``pid`` (the python inside unshare/sh)."""
    while True:
        kids = _children(pid)
        if not kids:
            return pid
        pid = kids[0]


def _kill_tree(p: subprocess.Popen) -> None:
    pids = [p.pid]
    i = 0
    while i < len(pids):
        pids.extend(_children(pids[i]))
        i += 1
    for pid in reversed(pids):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(10)
    for f in (p.stdout, p.stderr):
        if f is not None:
            f.close()


HOLDER = """
    import sys, time, kvshm
    from kvshm.movers import ShmMover
    def stall(self, *a):
        print("allocated", flush=True)
        time.sleep(3600)
    ShmMover.write = stall
    c = kvshm.Client(sys.argv[1], transport="shm", timeout=30)
    c.put_batch([f"w{i}" for i in range(8)], [b"x" * 100_000] * 8)
"""


def test_kill9_of_pid1_client_is_reclaimed(tmp_path):
    """A client that is pid 1 of its namespace, killed with SIGKILL after ALLOC: the old
    server checked os.kill(1, 0) in its own namespace (its init: always alive) and kept
    the pending blocks forever."""
    if not _ns_available("pid"):
        pytest.skip("unshare --pid is not available here")
    import textwrap

    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(HOLDER))
    with ServerProcess("--lease-timeout", "1") as srv, Client(srv.address) as c:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        p = subprocess.Popen([*_ns_cmd("pid"), sys.executable, str(script), srv.address],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
        try:
            wait_line(p, "allocated")
            assert c.stats()["pending"] == 8
            os.kill(_leaf(p.pid), signal.SIGKILL)
            # within the lease (1 s) plus one liveness sweep; the bound is generous
            wait_for(lambda: c.stats()["pending"] == 0, timeout=10, what="reclaim")
            st = c.stats(verify=True)
            assert st["accounting_ok"] and st["lease_expired_writes"] == 1
            assert st["held_grants"] == 0
        finally:
            _kill_tree(p)
        # its liveness file went with it
        pool = c.server_info["pool"]["name"]
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(pool + ".c-")
                    and n != c.session.proof.name]


# ---------------------------------------------------------------- limits

def test_zero_byte_allocs_cannot_take_the_pool():
    """4,096 zero-byte values each hold a block: the old server counted 0 bytes against
    the quota, granted all of them, evicted every live key and starved other clients."""
    with ServerProcess("--block-size", "4", prealloc_size=16 / 1024) as srv, \
            Client(srv.address, transport="shm") as other:
        nblocks = other.stats()["num_blocks"]
        assert nblocks == 4096
        other.put_batch([f"live{i}" for i in range(64)], [b"v" * 4096] * 64)
        s = _raw_socket(srv.address)        # another principal: the token holder
        try:
            h = raw_hello(s, srv.address)
            keys = [b"z%d" % i for i in range(4096)]
            st, r = _call(s, Op.ALLOC, {"keys": keys, "sizes": [0] * 4096}, 2, h["epoch"])
            assert st == Status.OK
            granted = sum(1 for x in r["st"] if x == Status.OK)
            refused = sum(1 for x in r["st"] if x == Status.QUOTA_EXCEEDED)
            assert granted == nblocks * 3 // 4 and refused == 4096 - granted
            # the other client still writes and reads
            other.put_batch([f"more{i}" for i in range(64)], [b"m" * 4096] * 64)
            assert other.get("more63") == b"m" * 4096
            assert other.stats()["pending"] == granted
        finally:
            s.close()


def test_two_connections_of_one_principal_share_one_quota():
    """Limits were per routing id: each new connection got the whole limit again."""
    with ServerProcess("--max-client-pending", str(1 << 20), prealloc_size=1 / 64) as srv:
        a, b = _raw_socket(srv.address), _raw_socket(srv.address)
        try:
            ha = raw_hello(a, srv.address)
            raw_hello(b, srv.address)
            st, r = _call(a, Op.ALLOC, {"keys": [b"a"], "sizes": [1 << 20]}, 2, ha["epoch"])
            assert r["st"] == [Status.OK]
            st, r = _call(b, Op.ALLOC, {"keys": [b"b"], "sizes": [1]}, 2, ha["epoch"])
            assert r["st"] == [Status.QUOTA_EXCEEDED]
            _call(a, Op.COMMIT, {"abort": [2]}, 3, ha["epoch"])
            st, r = _call(b, Op.ALLOC, {"keys": [b"b"], "sizes": [1]}, 4, ha["epoch"])
            assert r["st"] == [Status.OK]
        finally:
            a.close()
            b.close()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_peer_that_never_reads_loses_its_pins_and_connection():
    """GETs whose replies are never read: the old server kept their zero-copy pins with
    no lease (forever) and, past a quarter of the pool, copied further replies into
    memory (gigabytes with large values)."""
    with ServerProcess("--lease-timeout", "1", prealloc_size=1 / 16) as srv, \
            Client(srv.address) as c:
        n = 16
        for i in range(n):
            c.put(f"v{i}", b"%c" % (65 + i) * (1 << 20))
        rss0 = _rss(srv.proc.pid)
        s = _raw_socket(srv.address)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        try:
            h = raw_hello(s, srv.address)
            for r in range(6):          # GETs whose replies are never read
                s.send(msgpack.packb([PROTOCOL_VERSION, Op.GET, r + 1, h["epoch"],
                                      {"keys": [f"v{i}".encode() for i in range(n)]}]))
                wait_for(lambda: c.stats()["gets"] >= (r + 1) * n, what="a GET")
                wait_for(lambda: c.stats()["sending"] <= 1, what="its reply queued")
            wait_for(lambda: c.stats()["pins"] == 0, what="the unread replies dropped")
            st = c.stats()
            assert st["error_kinds"].get("unread_replies", 0) >= 1
            # bounded: the replies it would not read were refused, not copied
            assert _rss(srv.proc.pid) - rss0 < st["capacity_bytes"] // 2
        finally:
            s.close()


# ---------------------------------------------------------------- settling

def test_sync_request_that_times_out_settles_its_grant(monkeypatch):
    """A sync LOOKUP whose reply came too late was dropped with its pins never released
    (held forever: the client is alive and local)."""
    from kvshm import localread

    monkeypatch.setenv(localread.ENV_DISABLE, "1")      # reads that ask the server
    with ServerProcess("--lease-timeout", "0.5") as srv, \
            Client(srv.address, transport="shm", timeout=0.5) as c, \
            Client(srv.address, transport="tcp") as probe:
        c.put("k", b"x" * 100_000)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(kvshm.ServerUnavailable):
                c.get("k")                     # sent, then the wait times out
            with pytest.raises(kvshm.ServerUnavailable):
                c.put("w", b"y" * 100_000)     # HELLO times out: nothing sent
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        wait_for(lambda: probe.stats()["pins"] >= 0, what="the server")
        c.exists("k")                          # carries the RELEASE of the lost LOOKUP
        wait_for(lambda: probe.stats()["pins"] == 0 and probe.stats()["pending"] == 0,
                 what="the lost grant settled")
        time.sleep(0.6)                        # past the lease: nothing came back
        st = probe.stats(verify=True)
        assert st["pins"] == 0 and st["held_grants"] == 0 and st["accounting_ok"]
        assert c.get("k") == b"x" * 100_000


def test_new_hello_replaces_the_old_session_and_close_frees_everything():
    with ServerProcess() as srv, Client(srv.address, transport="tcp") as probe:
        c = Client(srv.address, transport="shm", lazy_commit=True)
        c.put("lazy", b"l" * 1000)           # pending until the next request
        n0 = probe.stats()["sessions"]
        c.ping()                             # a new HELLO: same nonce, grants move over
        assert probe.stats()["sessions"] == n0
        c.flush()
        assert probe.get("lazy") == b"l" * 1000
        c.close()
        wait_for(lambda: probe.stats()["sessions"] == n0 - 1, what="the session closed")


def test_client_used_after_fork_fails_at_once():
    with ServerProcess() as srv, Client(srv.address, timeout=30) as c:
        c.put("f", b"1")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                         # pragma: no cover (child)
            os.close(r)
            try:
                t = time.monotonic()
                c.get("f")
                msg = b"no error"
            except kvshm.KvshmError as exc:
                msg = b"%.3f %s" % (time.monotonic() - t, str(exc).encode())
            os.write(w, msg)
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            out = f.read().decode()
        os.waitpid(pid, 0)
        took, _, why = out.partition(" ")
        assert "fork" in why, out
        assert float(took) < 1.0                # at once, not after the 30 s timeout
        assert c.get("f") == b"1"               # the parent's client is untouched


# ---------------------------------------------------------------- doors

NOBODY = """
    import json, sys, urllib.request, urllib.error, kvshm
    address, manage = sys.argv[1], sys.argv[2]
    out = {}
    try:
        kvshm.Client(address, transport="tcp", timeout=5).get("secret")
        out["tcp"] = "read"
    except kvshm.AuthenticationFailed as e:
        out["tcp"] = "refused"
    try:
        kvshm.Client(address, transport="auto", timeout=5).purge()
        out["purge"] = "purged"
    except kvshm.AuthenticationFailed as e:
        out["purge"] = "refused"
    for path, method in (("/purge", "POST"), ("/selftest", "GET")):
        try:
            urllib.request.urlopen(urllib.request.Request(manage + path, method=method),
                                   timeout=10)
            out[path] = 200
        except urllib.error.HTTPError as e:
            out[path] = e.code
    print(json.dumps(out), flush=True)
"""


def test_nobody_can_neither_read_nor_purge():
    """As user nobody, a TCP client on 127.0.0.1 could read, list, overwrite and purge
    every key, and POST /purge worked; the 0600 segment protected only the shm path."""
    if not IS_ROOT or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as nobody")
    import textwrap

    with ServerProcess() as srv, Client(srv.address) as c:
        c.put("secret", b"s" * 1000)
        code = textwrap.dedent(NOBODY)
        r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                            sys.executable, "-c", code, srv.address,
                            f"http://127.0.0.1:{srv.manage_port}"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                                "HOME": "/tmp"})
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got == {"tcp": "refused", "purge": "refused", "/purge": 401,
                       "/selftest": 401}, got
        assert c.get("secret") == b"s" * 1000
        # the token holder may (the same user finds the token by itself)
        req = urllib.request.Request(f"http://127.0.0.1:{srv.manage_port}/selftest",
                                     headers=bearer(srv.address))
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["ok"] is True


def test_token_file_gives_another_user_access():
    if not IS_ROOT or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as nobody")
    import pathlib
    import tempfile

    shared = pathlib.Path(tempfile.mkdtemp(prefix="kvshm-test-token-"))
    os.chmod(shared, 0o755)
    tok = shared / "kvshm.token"
    try:
        _token_file_case(tok)
    finally:
        shutil.rmtree(shared)


def _token_file_case(tok) -> None:
    with ServerProcess("--token-file", str(tok)) as srv, Client(srv.address) as c:
        c.put("k", b"v")
        os.chown(tok, 0, 65534)               # the group of nobody (nogroup) may read it
        code = ("import sys, kvshm; c = kvshm.Client(sys.argv[1], transport='tcp', "
                "token_file=sys.argv[2]); print(c.get('k').decode())")
        r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                            sys.executable, "-c", code, srv.address, str(tok)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert r.returncode == 0 and r.stdout.strip() == "v", r.stderr
    assert not tok.exists()                   # removed at exit


def test_hello_without_token_is_refused_and_nothing_else_is_served():
    with ServerProcess() as srv:
        s = _raw_socket(srv.address)
        try:
            st, body = _call(s, Op.HELLO, {"nonce": os.urandom(16)}, 1, 0)
            assert st == Status.UNAUTHORIZED
            st, body = _call(s, Op.EXISTS, {"keys": [b"k"]}, 2, 0)
            assert st == Status.STALE_EPOCH and "HELLO" in body["error"]
            st, body = _call(s, Op.HELLO, {"nonce": os.urandom(16),
                                           "token": b"\0" * 32}, 3, 0)
            assert st == Status.UNAUTHORIZED
        finally:
            s.close()
        with pytest.raises(kvshm.AuthenticationFailed):
            Client(srv.address, transport="tcp", token=b"wrong")


# ---------------------------------------------------------------- fuzzing

@pytest.fixture(scope="module")
def door_fuzz_server():
    from fuzzing import FuzzServer

    # a lease of 1 ms: every grant a hostile request makes expires at once, so lease
    # expiry and liveness checks run on every turn of the loop
    srv = FuzzServer(lease_timeout=0.001, door_token=os.urandom(32))
    yield srv
    srv.close()


def _hostile_hellos():
    from hypothesis import strategies as st

    from fuzzing import absurd_ints, field_values

    return st.fixed_dictionaries({}, optional={
        "nonce": st.one_of(st.binary(min_size=0, max_size=80), field_values),
        "token": st.one_of(st.binary(max_size=40), field_values),
        "operator_token": st.one_of(st.binary(max_size=40), st.just(b"o" * 32),
                                    field_values),
        "proof": st.one_of(st.booleans(), field_values),
        "pid": st.one_of(absurd_ints, field_values),
        "host": st.one_of(st.text(max_size=30), field_values),
        "transport": field_values,
        "rdma": field_values,
        "version": field_values,
        "release": field_values,
        "commit": field_values,
    })


def test_fuzz_hello_and_every_op_never_stop_the_loop(door_fuzz_server):
    """Hypothesis: hostile HELLOs (absurd pids, wrong types, huge lists) and hostile
    bodies for every op, on a server with a door token and a 1 ms lease. Each request
    gets an answer, the loop thread lives, accounting stays exact."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from fuzzing import _pack, bodies

    srv = door_fuzz_server

    @given(hello=_hostile_hellos(), op=st.sampled_from(list(Op)), body=bodies,
           with_token=st.booleans())
    @settings(max_examples=300, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    def run(hello, op, body, with_token):
        if with_token:
            hello = {**hello, "token": srv.door_token}
        srv.send([_pack([PROTOCOL_VERSION, Op.HELLO, 1, 0, hello])])
        srv.send([_pack([PROTOCOL_VERSION, op, 2, srv.epoch, body])])
        srv.check_healthy()

    run()
    assert srv.loop.errors.get("internal", 0) == 0, srv.loop.errors


def test_fuzz_every_body_field_of_every_op(door_fuzz_server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from fuzzing import FIELDS, _pack, field_values

    srv = door_fuzz_server
    srv.hello()

    @given(op=st.sampled_from([o for o in Op if o != Op.HELLO]),
           name=st.sampled_from(FIELDS), value=field_values,
           rid=st.sampled_from([1, 2**63 - 1, -(2**63), 2**64 - 1]))
    @settings(max_examples=400, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    def run(op, name, value, rid):
        base = {"keys": [b"k1", b"k2"], "sizes": [1, 0]}
        srv.send([_pack([PROTOCOL_VERSION, op, rid, srv.epoch, {**base, name: value}])])
        srv.check_healthy()

    run()
    assert srv.loop.errors.get("internal", 0) == 0, srv.loop.errors


# ---------------------------------------------------------------- smaller items

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_startup_of_a_large_pool_exits_leaving_no_segment(sig):
    """SIGTERM/SIGINT while a 3 GiB pool was fallocated and populated was lost: the
    server logged "stopping", then served until SIGKILL and left its segment."""
    from servers import unique_shm_name

    free = shutil.disk_usage("/dev/shm").free
    if free < 4 << 30:
        pytest.skip("needs 4 GiB free in /dev/shm")
    name = unique_shm_name("big-")
    p = subprocess.Popen([sys.executable, "-m", "kvshm", "serve", "--service-port", "0",
                          "--manage-port", "0", "--prealloc-size", "3", "--shm-name", name],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        # start-up is under way once the segment exists (being reserved and populated)
        wait_for(lambda: os.path.exists(f"/dev/shm/{name}") or p.poll() is not None,
                 timeout=60, what="the segment to appear")
        assert p.poll() is None, p.stderr.read()
        p.send_signal(sig)
        # the old server never exited (it served until SIGKILL). Pool creation now
        # looks at the stop request between steps of kvshm._pool.CREATE_STEP, so the
        # exit takes one step and the teardown (0.4-1.6 s idle; the figures under load
        # are in the issue note); the wait below only guards against a hang
        rc = p.wait(30)
        out = p.stdout.read().decode()
        assert rc == 0, p.stderr.read()
        assert "kvshm ready" not in out          # it never started serving
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        p.stdout.close()
        p.stderr.close()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_peer_closing_during_curve_handshake_is_server_unavailable(kind):
    """A server that dies during the CURVE handshake was reported as AuthenticationFailed
    (which the integrations treat as permanent)."""
    import asyncio
    import socket
    import threading

    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)
    port = ls.getsockname()[1]

    def dying_server():
        c, _ = ls.accept()
        c.send(b"\xff" + b"\0" * 8 + b"\x7f\x03")    # a ZMTP greeting, cut short
        c.close()
        ls.close()                                  # and the server is gone

    t = threading.Thread(target=dying_server, daemon=True)
    t.start()
    key = zmq.curve_keypair()[0]
    with pytest.raises(kvshm.ServerUnavailable) as ei:
        if kind == "sync":
            Client(f"127.0.0.1:{port}", transport="tcp", timeout=2, curve_server_key=key)
        else:
            async def main():
                c = kvshm.AsyncClient(f"127.0.0.1:{port}", transport="tcp", timeout=2,
                                      curve_server_key=key)
                try:
                    await c.connect()
                finally:
                    await c.close()
            asyncio.run(main())
    assert not isinstance(ei.value, kvshm.AuthenticationFailed)
    t.join(5)


def test_async_get_cancelled_while_its_lookup_is_parked_leaves_no_pin(tmp_path,
                                                                        monkeypatch):
    """With an SSD tier, an async get cancelled while its LOOKUP was parked (waiting
    for a promotion) sent RELEASE before the grant existed; the grant made later was
    never released (held for ever: the client is alive and local)."""
    import asyncio
    import threading

    import numpy as np

    from kvshm.tiers.ssd import workers as ssd_io
    from servers import unique_shm_name

    srv = kvshm.Server(service_port=0, manage_port=None, ipc=False, prealloc_size=1 / 16,
                       shm_name=unique_shm_name("park-"), ssd_path=str(tmp_path / "ssd"),
                       ssd_size=0.25, ssd_wait=60.0, lease_timeout=1.0).start()
    try:
        with Client(srv.address, transport="tcp", timeout=30) as probe:
            for i in range(100):            # 100 MiB through a 64 MiB pool: spilled
                probe.put(f"e{i}", np.full(1 << 20, i % 251, np.uint8))
            deadline = time.monotonic() + 30
            while probe.exists_batch(["e0"]) != [True] or \
                    probe.stats()["tiers"]["pool"]["entries"] >= 100:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            reading, gate = threading.Event(), threading.Event()
            real = ssd_io.preadv_all

            def stalled(*a):
                reading.set()
                gate.wait(60)
                return real(*a)

            monkeypatch.setattr(ssd_io, "preadv_all", stalled)

            async def main():
                async with kvshm.AsyncClient(srv.address, transport="shm",
                                             timeout=30) as c:
                    task = asyncio.ensure_future(c.get("e0"))
                    loop = asyncio.get_running_loop()
                    assert await loop.run_in_executor(None, reading.wait, 30)
                    task.cancel()                   # its LOOKUP waits for the disk
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    await c.flush()                 # the RELEASE reaches the server
                    gate.set()                      # now the promotion completes
                    t = time.monotonic()
                    while probe.stats()["tiers"]["pool"]["promoting"]:
                        assert time.monotonic() - t < 30
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(1.2)        # past the lease
                    st = probe.stats(verify=True)
                    assert st["pins"] == 0 and st["held_grants"] == 0, st
                    assert st["accounting_ok"]
                    assert await c.get("e0") == bytes([0]) * (1 << 20)

            asyncio.run(main())
    finally:
        gate.set()
        srv.stop()


def test_a_local_token_is_never_offered_to_another_host():
    from kvshm.security import find_token

    with ServerProcess() as srv:
        port = srv.address.rsplit(":", 1)[1]
        assert find_token(f"tcp://127.0.0.1:{port}") is not None
        # the same port on another host: the local server's token stays here
        assert find_token(f"tcp://192.0.2.1:{port}") is None


def test_shared_door_token_file(tmp_path):
    """--door-token-file: a server takes its door token from the file (the members of a
    cluster without CURVE share one); a short or missing file is refused."""
    from kvshm.security import DoorToken, find_token

    path = tmp_path / "door.token"
    secret = os.urandom(32)
    path.write_text(secret.hex() + "\n")
    path.chmod(0o600)
    door = DoorToken([], shared_file=str(path))
    try:
        assert door.token == secret and door.check(secret)
        assert find_token("tcp://10.0.0.9:7400", str(path)) == secret
        assert not door.check(os.urandom(32))
    finally:
        door.close()
    assert path.exists()            # the shared file is not the server's to remove
    short = tmp_path / "short.token"
    short.write_text("abcd\n")
    with pytest.raises(ValueError):
        DoorToken([], shared_file=str(short))
    with pytest.raises(ValueError):
        DoorToken([], shared_file=str(tmp_path / "missing"))


def test_the_last_door_token_leaves_no_directory(tmp_path, monkeypatch):
    """The per-user token directory goes with the last server's token; while another
    server's token is there, it stays."""
    from kvshm import security

    monkeypatch.setattr(security, "_RUN_DIR", str(tmp_path))
    a = security.DoorToken(["tcp://127.0.0.1:40001"])
    b = security.DoorToken(["tcp://127.0.0.1:40002"])
    d = security.run_dir()
    assert sorted(os.listdir(d)) == ["40001.operator", "40001.token", "40002.operator",
                                     "40002.token"]
    a.close()
    assert sorted(os.listdir(d)) == ["40002.operator", "40002.token"]
    b.close()
    assert not os.path.exists(d)
