"""Issue 12, broken again (review "break3"): each test reproduces a way a hostile or
unlucky user got past the trust work on main, and pins the fix.

- a live client's liveness file deleted or replaced under it (``rm /dev/shm/kvshm-*``
  by an operator tidying up): the server took the client for dead, reclaimed the
  blocks it was still copying into, and handed them to other keys;
- a hard link to a file the server's user holds locked (the pool segment itself),
  under the proof name: the server took it for a live local client of its own user
  (operator ops, a session that never dies);
- a token file that is a FIFO: every client (and the server reading
  ``--door-token-file``) hung forever in ``open``;
- a ``/dev/shm/kvshm-run-<uid>`` directory made first by another user: the server
  of ``<uid>`` could not start at all.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import msgpack
import pytest
import zmq

from kvshm import Client, security, segments
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply
from servers import ServerProcess
from test_faults import wait_for, wait_line

IS_ROOT = os.geteuid() == 0
HAS_SETPRIV = shutil.which("setpriv") is not None


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HOME": "/tmp"}


def _reap(p: subprocess.Popen) -> None:
    """Kill ``p`` if it still runs, wait for it, close its pipes."""
    if p.poll() is None:
        p.kill()
    p.wait()
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            f.close()


def _proofs(shm_name: str) -> list[str]:
    return glob.glob(os.path.join(segments.SHM_DIR, shm_name.lstrip("/") + ".c-*"))


# ---------------------------------------------------------------- liveness file removed

WAITING_WRITER = """
    import sys, kvshm
    from kvshm.movers import ShmMover
    orig = ShmMover.write
    def write(self, *a):
        print("allocated", flush=True)
        sys.stdin.readline()                   # the test says when to copy
        return orig(self, *a)
    ShmMover.write = write
    c = kvshm.Client(sys.argv[1], transport="shm", timeout=30)
    c.put_batch([f"late{i}" for i in range(4)], [b"L" * 65536] * 4)
    print("written", flush=True)
    c.close()
"""


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_live_client_whose_liveness_file_goes_keeps_its_blocks(how, tmp_path):
    """The client's liveness file is removed (or replaced by an unlocked file of the same
    name) while the client lives, between its ALLOC and its copy. The server used to
    test the lock by the file's *name*: it found none, closed the session, freed the
    blocks; the pool was refilled and the client's late copy landed in other keys.
    The kernel's lock lives on the open file, not on its name: the server now keeps the
    file it verified open and tests the lock there."""
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WAITING_WRITER))
    with ServerProcess("--lease-timeout", "0.5", "--max-client-pending", "0",
                       prealloc_size=1 / 256) as srv, Client(srv.address) as other:
        cap = other.stats()["capacity_bytes"]
        before = set(_proofs(srv.shm_name))
        p = subprocess.Popen([sys.executable, str(script), srv.address],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env())
        try:
            wait_line(p, "allocated")
            mine = [f for f in _proofs(srv.shm_name) if f not in before]
            assert len(mine) == 1, mine
            os.unlink(mine[0])                    # "rm /dev/shm/kvshm-*", tidying up
            if how == "replaced":
                with open(mine[0], "wb"):
                    pass
            # the lease runs out: a live client's grant is held (the old server had
            # closed the session already, so this never came)
            wait_for(lambda: other.stats()["held_grants"] >= 1,
                     what="the live client's grant to be held past its lease")
            n = cap // 65536 - 6
            other.purge()
            other.put_batch([f"other{j}" for j in range(n)],
                            [bytes([j % 251]) * 65536 for j in range(n)])
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
            _reap(p)
            for f in set(_proofs(srv.shm_name)) - before:
                os.unlink(f)


def test_dead_client_whose_liveness_file_was_replaced_is_reclaimed(tmp_path):
    """The other side of the fix: a client killed after its file was replaced by an
    unlocked one is still found dead (its grants reclaimed, no held grant left)."""
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WAITING_WRITER))
    with ServerProcess("--lease-timeout", "60", prealloc_size=1 / 256) as srv, \
            Client(srv.address) as other:
        before = set(_proofs(srv.shm_name))
        p = subprocess.Popen([sys.executable, str(script), srv.address],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env())
        try:
            wait_line(p, "allocated")
            assert other.stats()["pending"] == 4
            mine = [f for f in _proofs(srv.shm_name) if f not in before]
            os.unlink(mine[0])
            with open(mine[0], "wb"):
                pass
            p.kill()
            p.wait()
            # reclaimed by the liveness check, long before the 60 s lease
            wait_for(lambda: other.stats()["pending"] == 0, what="the dead client's "
                     "grant to be reclaimed")
            st = other.stats(verify=True)
            assert st["accounting_ok"] and st["held_grants"] == 0
        finally:
            _reap(p)
            for f in set(_proofs(srv.shm_name)) - before:
                os.unlink(f)


# ---------------------------------------------------------------- forged proof: hard link

HARDLINKER = """
    import json, os, sys, msgpack, zmq
    from kvshm import segments
    from kvshm._pool import Pool
    from kvshm.security import read_token_file
    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, decode_reply
    address, shm, tok = sys.argv[1], sys.argv[2], sys.argv[3]
    pool = Pool.attach(shm, populate=False)       # the admin shared the segment
    nonce = os.urandom(16)
    link = os.path.join(segments.SHM_DIR, segments.proof_name(pool.name, pool.token, nonce))
    # the segment: a file of the server's user that the server itself holds locked
    os.link(os.path.join(segments.SHM_DIR, shm.lstrip("/")), link)
    print(link, flush=True)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect("tcp://" + address)
    def call(op, body, rid, epoch):
        s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, epoch, body], use_bin_type=True))
        assert s.poll(10000)
        st, _, b = decode_reply(s.recv_multipart()[0])
        return st, b
    st, h = call(Op.HELLO, {"nonce": nonce, "token": read_token_file(tok),
                            "proof": True}, 1, 0)
    out = {"hello": int(st), "local": h.get("local")}
    st, b = call(Op.PURGE, {}, 2, h["epoch"])
    out["purge"] = int(st)
    # a symlink under a proof name to the same locked file
    nonce2 = os.urandom(16)
    sym = os.path.join(segments.SHM_DIR, segments.proof_name(pool.name, pool.token, nonce2))
    os.symlink(os.path.join(segments.SHM_DIR, shm.lstrip("/")), sym)
    print(sym, flush=True)
    st, h = call(Op.HELLO, {"nonce": nonce2, "token": read_token_file(tok), "proof": True},
                 3, 0)
    out["symlink_local"] = h.get("local")
    # its own, true proof: local, as uid nobody, still no operator
    nonce3 = os.urandom(16)
    own = segments.ClientProof(pool.name, pool.token, nonce3)
    st, h = call(Op.HELLO, {"nonce": nonce3, "token": read_token_file(tok), "proof": True},
                 4, 0)
    out["own_local"] = h.get("local")
    st, b = call(Op.PURGE, {}, 5, h["epoch"])
    out["own_purge"] = int(st)
    own.close()
    print(json.dumps(out), flush=True)
"""


def test_hard_link_to_a_locked_file_of_the_server_user_is_no_proof():
    """User nobody, given the door token file and the segment (an admin made it 0666 so
    that a container of another uid can attach), hard-links the segment under its
    proof name. The segment is the server user's file and the server holds its lock:
    the old check took the link for a live local client of the server's own user, an
    operator (PURGE), whose session never died. A liveness file has exactly one name.
    A symlink proves nothing either; nobody's own proof makes it local as uid nobody,
    still no operator."""
    if not IS_ROOT or not HAS_SETPRIV:
        pytest.skip("needs root and setpriv to run as nobody")
    shared = tempfile.mkdtemp(prefix="kvshm-test-token-")
    os.chmod(shared, 0o755)
    tok = os.path.join(shared, "kvshm.token")
    links: list[str] = []
    try:
        with ServerProcess("--token-file", tok) as srv, Client(srv.address) as c:
            c.put("theirs", b"t" * 100)
            os.chown(tok, 0, 65534)
            os.chmod(os.path.join(segments.SHM_DIR, srv.shm_name.lstrip("/")), 0o666)
            r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup",
                                "--clear-groups", sys.executable, "-c",
                                textwrap.dedent(HARDLINKER), srv.address, srv.shm_name, tok],
                               capture_output=True, text=True, timeout=120, env=_env())
            lines = r.stdout.split("\n")
            links = [ln for ln in lines[:2] if ln.startswith("/")]
            assert r.returncode == 0, r.stderr
            got = json.loads(lines[2])
            assert got == {"hello": Status.OK, "local": False, "purge": Status.UNAUTHORIZED,
                           "symlink_local": False, "own_local": True,
                           "own_purge": Status.UNAUTHORIZED}, got
            assert c.get("theirs") == b"t" * 100
    finally:
        for link in links:
            if os.path.lexists(link):
                os.unlink(link)
        shutil.rmtree(shared)


# ---------------------------------------------------------------- token files that hang

def test_token_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """``open()`` of a FIFO for reading waits for a writer: a token file replaced by a
    FIFO (``$KVSHM_TOKEN_FILE`` in a shared directory, the run directory) hung every
    client forever, and the server reading ``--door-token-file``."""
    fifo = tmp_path / "kvshm.token"
    os.mkfifo(fifo, 0o600)
    code = textwrap.dedent("""
        import sys
        from kvshm import security
        for call in (lambda: security.read_token_file(sys.argv[1]),
                     lambda: security.find_token("tcp://127.0.0.1:1", sys.argv[1])):
            try:
                call()
            except ValueError as exc:
                print("refused:", exc, flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True,
                       text=True, timeout=60, env=_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("refused:") == 2 and "not a kvshm token file" in r.stdout, r.stdout


# ---------------------------------------------------------------- squatted run directory

def test_run_directory_made_first_by_another_user_does_not_lock_the_server_out():
    """Any local user may make ``/dev/shm/kvshm-run-<uid>`` first (``/dev/shm`` is world
    writable). The server of ``<uid>`` refused to start; now it puts its token files in
    a directory of its own beside it, and its clients find them there."""
    if not IS_ROOT or not HAS_SETPRIV:
        pytest.skip("needs root and setpriv (the server runs as nobody, the squatter "
                    "as daemon)")
    uid = 65534
    squat = security.run_dir(uid)
    if os.path.lexists(squat):
        pytest.skip(f"{squat} exists (a server of nobody runs?)")
    os.mkdir(squat, 0o777)
    os.chown(squat, 1, 1)                       # daemon's
    with open(os.path.join(squat, "bait.token"), "w") as f:
        f.write("00" * 32)
    os.chown(os.path.join(squat, "bait.token"), 1, 1)
    launcher = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                sys.executable, "-m", "kvshm"]
    code = ("import sys, kvshm; c = kvshm.Client(sys.argv[1], transport='tcp'); "
            "c.put('k', b'v'); print(c.get('k').decode(), c.purge())")
    try:
        with ServerProcess(launcher=launcher, env={"HOME": "/tmp"}) as srv:
            r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup",
                                "--clear-groups", sys.executable, "-c", code, srv.address],
                               capture_output=True, text=True, timeout=60, env=_env())
            assert r.returncode == 0 and r.stdout.split() == ["v", "1"], r.stderr
        assert sorted(os.listdir(squat)) == ["bait.token"]     # not touched
        left = [d for d in os.listdir(segments.SHM_DIR)
                if d.startswith(f"kvshm-run-{uid}")]
        assert left == [f"kvshm-run-{uid}"], left                # its own one is gone
    finally:
        shutil.rmtree(squat)


# ---------------------------------------------------------------- quotas by another path

def test_handoff_pins_count_against_the_principals_pinned_quota():
    """PIN (the handoff pins of P/D) was capped only server-wide (half the pool), not
    per principal: a principal held handoff pins far past its ``--max-client-pinned``
    (on top of its LOOKUP pins), so one user given the door token could pin what the
    others need. Handoff pins are pins of their principal now: counted in blocks
    against the same quota, freed when the pin goes."""
    from kvshm.errors import QuotaExceeded

    blk = 65536
    with ServerProcess("--max-client-pinned", str(4 * blk), prealloc_size=1 / 64) as srv, \
            Client(srv.address, transport="tcp") as c:
        keys = [f"h{i}" for i in range(8)]
        c.put_batch(keys, [b"x" * blk] * 8)
        with pytest.raises(QuotaExceeded):
            c.pin(keys, ttl=600)                  # 8 blocks, over its 4
        small = c.pin(keys[:3], ttl=600)           # 3 of its 4 blocks
        with pytest.raises(QuotaExceeded):
            c.pin(keys[3:5], ttl=600)              # 3 + 2 > 4 (another pin, same principal)
        with Client(srv.address, transport="tcp") as c2:   # another connection of it
            with pytest.raises(QuotaExceeded):
                c2.pin(keys[3:5], ttl=600)
        assert c.unpin(small)
        h = c.pin(keys[3:7], ttl=600)              # its blocks came back
        assert c.unpin(h)


# ---------------------------------------------------------------- kills during start-up

def test_segment_of_a_server_killed_while_making_its_pool_is_cleaned_up():
    """SIGKILL while a large pool is reserved and pre-faulted (before the server is
    ready): the segment, already gigabytes of /dev/shm, had no header yet (the magic was
    written last), so ``kvshm ctl cleanup`` and every later server start took it for
    somebody else's file and left it for ever. A segment is marked as a kvshm pool
    being made from its first byte on (a mark ``attach`` refuses)."""
    import uuid

    from kvshm._pool import Pool

    prefix = f"break3-{os.getpid()}-"
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    path = os.path.join(segments.SHM_DIR, name)
    p = subprocess.Popen([sys.executable, "-m", "kvshm", "serve", "--service-port", "0",
                          "--manage-port", "0", "--prealloc-size", "2", "--shm-name", name,
                          "--log-level", "WARNING"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: os.path.exists(path) or p.poll() is not None, timeout=60,
                 what="the segment to be made")
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        if not os.path.exists(path):
            pytest.skip("the server died before it made its segment")
        with open(path, "rb") as f:
            head = f.read(8)
        if head == b"KVSHMPL1":
            pytest.skip("the pool was made before the kill (too fast to catch)")
        with pytest.raises(ValueError):
            Pool.attach(name, populate=False)          # half made: never used
        r = subprocess.run([sys.executable, "-m", "kvshm", "ctl", "cleanup", "--prefix",
                            prefix], capture_output=True, text=True, timeout=60, env=_env())
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(path), f"{name} left behind: {r.stdout}"
        assert f"removed {name}" in r.stdout
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if os.path.exists(path):
            os.unlink(path)


# ---------------------------------------------------------------- a dead server's port

FAKE_SERVER = """
    import sys, msgpack, zmq
    s = zmq.Context.instance().socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.bind("tcp://127.0.0.1:" + sys.argv[1])
    print("bound", flush=True)
    got = set()
    while s.poll(int(float(sys.argv[2]) * 1000)):
        msg = s.recv_multipart()
        try:
            body = msgpack.unpackb(msg[1], raw=False)[4]
        except Exception:
            continue
        for name in ("token", "operator_token"):
            if isinstance(body, dict) and isinstance(body.get(name), bytes):
                got.add(body[name].hex())
    print("got", *sorted(got), flush=True)
"""


def test_a_dead_servers_token_files_are_not_sent_to_whoever_took_its_port():
    """A server SIGKILLed leaves its token files until the next start or ``kvshm ctl
    cleanup``. Another user then binds the free port: the same user's clients found
    the dead server's door and operator tokens by themselves and sent them, in HELLO,
    to that user's process. A live server holds a lock on each of its token files;
    clients now use a token they found by themselves only while it is held."""
    if not IS_ROOT or not HAS_SETPRIV:
        pytest.skip("needs root and setpriv (the port is taken by nobody)")
    srv = ServerProcess()
    try:
        door, op = (security.find_token(f"tcp://{srv.address}"),
                    security.find_operator_token(f"tcp://{srv.address}"))
        assert door is not None and op is not None
        srv.kill()
        tok_files = [security.token_path(f"tcp://{srv.address}"),
                     security.operator_token_path(f"tcp://{srv.address}")]
        # left behind, as said (unless a server start or cleanup of another test on this
        # machine took them meanwhile: then put them back as the dead server left them)
        for f, secret in zip(tok_files, (door, op)):
            if f and not os.path.exists(f):
                fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, secret.hex().encode() + b"\n")
                os.close(fd)
        fake = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup",
                                 "--clear-groups", sys.executable, "-c",
                                 textwrap.dedent(FAKE_SERVER),
                                 str(srv.port), "3"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env())
        try:
            wait_line(fake, "bound")
            with pytest.raises(Exception):
                with Client(srv.address, transport="tcp", timeout=2) as c:
                    c.get("x")
            line = wait_line(fake, "got", timeout=60)
            leaked = set(line.split()[1:]) & {door.hex(), op.hex()}
            assert not leaked, "the dead server's tokens went to another user's process"
        finally:
            _reap(fake)
            for f in tok_files:
                if f and os.path.exists(f):
                    os.unlink(f)
    finally:
        srv.kill()
        srv.remove_segment()


# ---------------------------------------------------------------- held: kept as tests

def _dealer(address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{address}")
    return s


def _call(s: zmq.Socket, op: int, body: dict, rid: int, epoch: int,
          raw: bytes | None = None) -> tuple[int, dict]:
    s.send(raw if raw is not None else
           msgpack.packb([PROTOCOL_VERSION, op, rid, epoch, body], use_bin_type=True))
    assert s.poll(30_000), f"no reply to op {op}"
    st, _, rbody = decode_reply(s.recv_multipart()[0])
    return st, rbody


def test_bye_games_and_deep_nesting_touch_nothing_of_another_session():
    """BYE before HELLO, BYE twice, a BYE whose settle lists name another session's
    request ids, a 100,000-deep nested header: answered, and the other session's
    pending write is still its own (held before this review too; kept as a test)."""
    with ServerProcess(prealloc_size=1 / 64) as srv, Client(srv.address) as admin:
        door = security.find_token(f"tcp://{srv.address}")
        victim, s = _dealer(srv.address), _dealer(srv.address)
        try:
            st, h = _call(victim, Op.HELLO, {"nonce": os.urandom(16), "token": door}, 1, 0)
            ep = h["epoch"]
            st, b = _call(victim, Op.ALLOC, {"keys": [b"v"], "sizes": [100]}, 7, ep)
            assert st == Status.OK and admin.stats()["pending"] == 1
            st, _ = _call(s, Op.BYE, {}, 1, 0)
            assert st == Status.STALE_EPOCH                      # no session yet
            st, _ = _call(s, Op.HELLO, {"nonce": os.urandom(16), "token": door}, 2, 0)
            assert st == Status.OK
            st, b = _call(s, Op.BYE, {"abort": [7], "release": [7], "commit": [7]}, 3, ep)
            assert st == Status.OK and b["settled"] == 0
            st, _ = _call(s, Op.BYE, {}, 4, ep)
            assert st == Status.STALE_EPOCH                      # ended already
            raw = msgpack.packb([PROTOCOL_VERSION, Op.EXISTS, 5, ep], use_bin_type=True)
            st, _ = _call(s, 0, {}, 5, ep, raw=b"\x95" + raw[1:] + b"\x91" * 100_000 + b"\xc0")
            assert st == Status.MALFORMED
            assert admin.stats()["pending"] == 1                 # still the victim's
            st, b = _call(victim, Op.COMMIT, {"commit": [7]}, 8, ep)
            assert st == Status.OK and not b.get("commit_failed")
            assert admin.exists("v")
        finally:
            victim.close()
            s.close()


# ---------------------------------------------------------------- ctl cleanup leftovers

SHM_HOLDER = """
    import sys, time, kvshm
    c = kvshm.Client(sys.argv[1], transport="shm", timeout=30)
    c.put("k", b"v" * 1000)
    print("ready", flush=True)
    time.sleep(600)
"""


def test_ctl_cleanup_removes_everything_a_killed_server_and_client_left():
    """Server and a same-host client both SIGKILLed: the pool, its index and reads
    segments, the client's liveness file. ``kvshm ctl cleanup`` removed the segments
    but never the liveness file (only a later server start did, and only under the
    default ``kvshm-`` prefix)."""
    import uuid

    prefix = f"break3c-{os.getpid()}-"
    srv = ServerProcess(shm_name=f"{prefix}{uuid.uuid4().hex[:8]}")
    c = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SHM_HOLDER), srv.address],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env())
    try:
        wait_line(c, "ready")
        assert _proofs(srv.shm_name)                 # the client's liveness file
        srv.kill()
        c.kill()
        c.wait()
        left = [n for n in os.listdir(segments.SHM_DIR) if n.startswith(prefix)]
        assert len(left) >= 2, left
        r = subprocess.run([sys.executable, "-m", "kvshm", "ctl", "cleanup", "--prefix",
                            prefix], capture_output=True, text=True, timeout=60, env=_env())
        assert r.returncode == 0, r.stderr
        left = [n for n in os.listdir(segments.SHM_DIR) if n.startswith(prefix)]
        assert left == [], (left, r.stdout)
    finally:
        _reap(c)
        srv.kill()
        for n in os.listdir(segments.SHM_DIR):
            if n.startswith(prefix):
                os.unlink(os.path.join(segments.SHM_DIR, n))


def test_liveness_proofs_kept_open_are_capped(monkeypatch):
    """The server keeps each verified liveness file open (see above): a program that
    leaks clients (each with its own proof) must not take the file descriptors the
    server's sockets need. Past ``Liveness.MAX_OPEN`` a proof is not taken (the
    client is served as a remote one); a proof that goes frees its place."""
    import uuid

    monkeypatch.setattr(segments.Liveness, "MAX_OPEN", segments.Liveness._open + 2)
    pool, token = f"kvshm-test-{uuid.uuid4().hex[:8]}", os.urandom(16)
    nonces = [os.urandom(16) for _ in range(3)]
    clients = [segments.ClientProof(pool, token, n) for n in nonces]
    try:
        a, b = (segments.Liveness.verify(pool, token, n) for n in nonces[:2])
        assert a is not None and b is not None and a.alive() and b.alive()
        assert segments.Liveness.verify(pool, token, nonces[2]) is None
        a.close()
        c = segments.Liveness.verify(pool, token, nonces[2])
        assert c is not None and c.alive()
        clients[2].close()
        assert not c.alive()
        c.remove()
        b.close()
    finally:
        for cp in clients:
            cp.close()
