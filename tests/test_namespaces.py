"""A client in its own UTS and pid namespace that shares the host's /dev/shm (a container
run with ``--ipc=host``): ``unshare --uts --pid --fork --mount-proc`` with its own
hostname, pid 1 inside (as tests/test_trust.py's namespace tests; they use no user
namespace, nor does this).

Against the write-behind put path (its PLACEs gathered: every put held, a PLACE per
batch) and the one-key C path of a TCP client (``Client._fast1``, counted by
``Channel.fast``):

* its own puts work through both, and are stored as written;
* it cannot read another client's pending writes (a held PLACE of a host client: misses
  for it through its shared-index reads, its write-behind reads and the one-key path);
* it cannot write into another client's blocks through the protocol: a PLACE naming the
  blocks the host client's held write was copied into (with its own reservation's
  generation or with the other's) is refused and installs nothing, and the other's
  write then lands as written. (Its raw mapping of the pool is writable, as every
  same-user client's is: the trust model's door is the token, DESIGN.md "Trust".)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import kvshm.client as kclient
from kvshm import Client
from servers import ServerProcess
from test_faults import wait_for, wait_line

pytestmark = pytest.mark.timeout(180)

KiB = 1024

NS = ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh", "-c",
      'hostname kvshm-container && exec "$0" "$@"']

NS_CLIENT = """
    import json, os, sys
    import kvshm
    import kvshm.client as kclient
    from kvshm.client import _Req
    from kvshm.errors import KeyNotFound, KvshmError
    from kvshm.zmq_ctrl.protocol import Op

    # every write-behind put held, a PLACE sent per batch (PLACE_BATCH_KEYS keys or
    # batch_blocks blocks), not by age: the batching this test counts
    kclient.PLACE_WINDOW = 0
    kclient.PLACE_HOLD_S = 3600.0
    kclient.IDLE_FLUSH_S = 60.0
    kclient._PlaceFlusher.kick = lambda self: None

    addr = sys.argv[1]
    wb = kvshm.Client(addr, write_behind=True, timeout=30)
    tcp = kvshm.Client(addr, transport="tcp", timeout=30)
    wb.put("ns-warm", b"w")
    wb.flush()

    def val(tag, i, n):
        return (b"%s-%d|" % (tag.encode(), i) * n)[:n]

    def out(**kw):
        print("R " + json.dumps(kw), flush=True)

    def found(c, k):
        try:
            return c.get(k) is not None
        except KeyNotFound:
            return False

    def call(c, op, body):
        def gen():
            r = yield _Req(op, body, stateful=True)
            return r
        r = c.run_op(gen())
        return r.status, r.body

    out(host=os.uname().nodename, pid=os.getpid(), wb=wb.session.wb is not None,
        local=wb.session.hello.get("local") is True, gen=wb.session.wb.gen)
    for line in sys.stdin:
        cmd = json.loads(line)
        what = cmd["do"]
        try:
            if what == "puts":
                n, size = cmd["n"], cmd["size"]
                w = wb.session.wb
                p0 = w.puts
                r0 = wb.stats()["reservations"]
                for i in range(n):
                    wb.put(f"ns-wb{i}", val("ns-wb", i, size))
                own = [wb.get(f"ns-wb{i}") == val("ns-wb", i, size) for i in range(n)]
                wb.flush()
                r1 = wb.stats()["reservations"]
                f0 = tcp._chan.fast
                for i in range(cmd["fast"]):
                    tcp.put(f"ns-f{i}", val("ns-f", i, 100))
                fast_ok = all(tcp.get(f"ns-f{i}") == val("ns-f", i, 100) and
                              tcp.exists(f"ns-f{i}") for i in range(cmd["fast"]))
                out(behind=w.puts - p0, places=r1["places"] - r0["places"],
                    placed=r1["placed_keys"] - r0["placed_keys"], own=all(own),
                    fast=tcp._chan.fast - f0, fast_ok=fast_ok)
            elif what == "read":
                keys = cmd["keys"]
                f0 = tcp._chan.fast
                got = {
                    "exists_local": wb.exists_batch(keys),
                    "get_local": [found(wb, k) for k in keys],
                    "exists_fast": [tcp.exists(k) for k in keys],
                    "get_fast": [found(tcp, k) for k in keys],
                }
                out(fast=tcp._chan.fast - f0, **got)
            elif what == "place":
                w = wb.session.wb
                body = {"gen": w.gen if cmd["gen"] is None else cmd["gen"],
                        "keys": [k.encode() for k in cmd["keys"]], "sizes": cmd["sizes"],
                        "runs": cmd["runs"]}
                st, rbody = call(wb, Op.PLACE, body)
                out(status=st, st=rbody.get("st"))
            elif what == "bye":
                wb.close()
                tcp.close()
                out(bye=True)
                break
        except KvshmError as exc:
            out(error=f"{type(exc).__name__}: {exc}")
"""


def _ns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run([*NS, "true"], capture_output=True, timeout=30).returncode == 0


class _NsClient:
    """The script above inside the namespaces: one JSON command a line, one ``R`` line
    of JSON back."""

    def __init__(self, address: str, tmp_path: Any) -> None:
        script = tmp_path / "ns_client.py"
        script.write_text(textwrap.dedent(NS_CLIENT))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.p = subprocess.Popen([*NS, sys.executable, str(script), address],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        self.hello = self._reply()

    def _reply(self) -> dict[str, Any]:
        r = json.loads(wait_line(self.p, "R ", timeout=60)[2:])
        assert "error" not in r, r["error"]
        return r

    def __call__(self, **cmd: Any) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._reply()

    def close(self) -> None:
        try:
            if self.p.poll() is None:
                self(do="bye")
                assert self.p.wait(30) == 0
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait(10)
            for f in (self.p.stdin, self.p.stdout, self.p.stderr):
                if f is not None:
                    f.close()


def _val(tag: str, i: int, n: int) -> bytes:
    return (b"%s-%d|" % (tag.encode(), i) * n)[:n]


@pytest.fixture(scope="module")
def srv():
    if not _ns_available():
        pytest.skip("unshare --uts --pid is not available here (needs root)")
    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


def test_namespaced_client_writes_behind_and_on_the_one_key_path(srv, tmp_path):
    with Client(srv.address) as other:
        other.put_batch([f"host{i}" for i in range(20)],
                        [_val("host", i, 5000) for i in range(20)])
        ns = _NsClient(srv.address, tmp_path)
        try:
            h = ns.hello
            assert h["host"] == "kvshm-container" and h["pid"] == 1, h
            assert h["wb"] and h["local"], "its liveness proof seen through /dev/shm"
            n = 200
            r = ns(do="puts", n=n, size=20 * KiB, fast=40)
            assert r["own"], "it reads its own writes behind"
            assert r["behind"] == n, "every put written behind"
            assert r["placed"] == n and 0 < r["places"] <= n // 8, r    # gathered
            assert r["fast"] == 3 * 40 and r["fast_ok"], r              # put, get, exists
            assert other.get_batch([f"ns-wb{i}" for i in range(n)]) == \
                [_val("ns-wb", i, 20 * KiB) for i in range(n)]
            assert other.get_batch([f"ns-f{i}" for i in range(40)]) == \
                [_val("ns-f", i, 100) for i in range(40)]
            assert other.get_batch([f"host{i}" for i in range(20)]) == \
                [_val("host", i, 5000) for i in range(20)]
            s = other.stats(verify=True)
            assert s["accounting_ok"] and s["reservations"]["accounting_ok"], s
        finally:
            ns.close()


def test_namespaced_client_cannot_read_or_take_a_held_write(srv, tmp_path, monkeypatch):
    """A host client's writes behind are held (copied into its reservation, PLACE not
    sent): the namespaced client sees none of them, and a PLACE of its own naming the
    blocks they were copied into is refused; then the held PLACE goes, as written."""
    monkeypatch.setattr(kclient, "PLACE_WINDOW", 0)
    monkeypatch.setattr(kclient, "PLACE_HOLD_S", 3600.0)
    monkeypatch.setattr(kclient, "IDLE_FLUSH_S", 60.0)
    monkeypatch.setattr(kclient._PlaceFlusher, "kick", lambda self: None)
    ns = _NsClient(srv.address, tmp_path)
    b = Client(srv.address, write_behind=True, timeout=30)
    try:
        b.put("b-warm", b"w")
        b.flush()
        keys = [f"b-held{i}" for i in range(4)]
        for i, k in enumerate(keys):
            b.put(k, _val("b-held", i, 30 * KiB))
        wb = b.session.wb
        assert wb is not None and wb.held_keys == [k.encode() for k in keys], \
            "held, not sent"
        runs, gen = wb.held_runs, wb.held_gen
        r = ns(do="read", keys=keys)
        assert r["exists_local"] == r["get_local"] == [False] * 4, r
        assert r["exists_fast"] == r["get_fast"] == [False] * 4, r
        assert r["fast"] == 8, "answered on the one-key C path"
        # its own reservation's generation, then the other's: refused, nothing installed
        for g in (None, gen):
            r = ns(do="place", gen=g, keys=["ns-steal0", "ns-steal1"],
                   sizes=[30 * KiB, 30 * KiB], runs=[runs[0], runs[1]])
            assert r["status"] == 0 and r["st"] and all(x != 0 for x in r["st"]), r
        assert wb.held_keys, "still held"
        b.flush()                                   # the held PLACE goes now
        with Client(srv.address) as other:
            assert other.get_batch(keys) == [_val("b-held", i, 30 * KiB)
                                             for i in range(4)]
            assert other.exists_batch(["ns-steal0", "ns-steal1"]) == [False, False]
            r = ns(do="read", keys=keys)
            assert r["exists_local"] == r["get_local"] == [True] * 4, r
            assert r["exists_fast"] == r["get_fast"] == [True] * 4, r
            b.delete(keys + ["b-warm"])
            s = other.stats(verify=True)
            assert s["accounting_ok"] and s["reservations"]["accounting_ok"], s
    finally:
        b.close()
        ns.close()


def test_killed_namespaced_client_gives_its_reservation_back(tmp_path):
    """pid 1 of its namespace, SIGKILLed while it holds a reservation and a held write:
    its liveness proof goes with it, so the reservation goes back to the pool (a pid
    check from the server's namespace would have kept it for good, or taken it while
    the client still copied)."""
    if not _ns_available():
        pytest.skip("unshare --uts --pid is not available here (needs root)")
    with ServerProcess("--lease-timeout", "1", prealloc_size=1 / 32) as s, \
            Client(s.address) as other:
        ns = _NsClient(s.address, tmp_path)
        try:
            ns(do="puts", n=20, size=20 * KiB, fast=0)
            assert other.stats()["reservations"]["blocks"] > 0
            leaf = ns.p.pid
            while True:                 # the python inside unshare and sh
                try:
                    with open(f"/proc/{leaf}/task/{leaf}/children") as f:
                        kids = [int(x) for x in f.read().split()]
                except OSError:
                    kids = []
                if not kids:
                    break
                leaf = kids[0]
            os.kill(leaf, 9)
            ns.p.wait(30)
            wait_for(lambda: other.stats()["reservations"]["blocks"] == 0,
                     what="the killed client's reservation to be reclaimed")
            st = other.stats(verify=True)
            assert st["accounting_ok"] and st["reservations"]["accounting_ok"], st
            assert other.get_batch([f"ns-wb{i}" for i in range(20)]) == \
                [_val("ns-wb", i, 20 * KiB) for i in range(20)]
        finally:
            ns.close()
