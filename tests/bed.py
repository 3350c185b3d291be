"""Test helpers for the cluster: etcd members, and a test bed of many hosts on one machine.

:class:`Etcd` runs 1 or 3 etcd members (Debian ``etcd-server``) on loopback, or inside a
network namespace of the bed, each on free ports with a private data directory; it can
kill the leader and restart every member with the same data.

:class:`Bed` builds the recipe of DESIGN.md ("A test bed of many hosts"): a switch
namespace with a bridge, one namespace per host joined to it by a veth pair, each host
with its own mount namespace and a private tmpfs /dev/shm (so no client attaches another
"host's" pool). Addresses 10.77.<net>.x exist only on those veths; nothing routes out.
Host kill = switch port down + SIGKILL of the namespace's processes; partition = port
down/up; ``tc tbf`` rate limits. Everything is created and deleted by the test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Sequence

ETCD = shutil.which("etcd")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for(pred: Any, timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``pred()`` until truthy; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class Etcd:
    """``n`` etcd members; ``prefix``: a command prefix to run them in (nsenter ...)."""

    def __init__(self, n: int = 1, host: str = "127.0.0.1", prefix: Sequence[str] = (),
                 ports: Sequence[int] | None = None) -> None:
        if ETCD is None:
            raise RuntimeError("etcd is not installed (apt-get install etcd-server)")
        self.n = n
        self.host = host
        self.prefix = list(prefix)
        self.dir = tempfile.mkdtemp(prefix="kvshm-etcd-")
        ports = list(ports) if ports is not None else [free_port() for _ in range(2 * n)]
        self.client_ports = ports[:n]
        self.peer_ports = ports[n:]
        self.token = uuid.uuid4().hex[:8]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"{self.host}:{p}" for p in self.client_ports)

    def _argv(self, i: int) -> list[str]:
        h = self.host
        cluster = ",".join(f"e{j}=http://{h}:{self.peer_ports[j]}" for j in range(self.n))
        return [*self.prefix, ETCD, "--name", f"e{i}", "--data-dir", f"{self.dir}/e{i}",
                "--listen-client-urls", f"http://{h}:{self.client_ports[i]}",
                "--advertise-client-urls", f"http://{h}:{self.client_ports[i]}",
                "--listen-peer-urls", f"http://{h}:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://{h}:{self.peer_ports[i]}",
                "--initial-cluster", cluster, "--initial-cluster-token", self.token,
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--log-level", "error"]

    def start(self, i: int | None = None) -> "Etcd":
        for j in range(self.n) if i is None else [i]:
            log = open(f"{self.dir}/e{j}.log", "ab")
            self.procs[j] = subprocess.Popen(self._argv(j), stdout=log, stderr=log,
                                             start_new_session=True)
            log.close()
        self.wait_healthy()
        return self

    def _client(self) -> Any:
        """A pyetcd client of the running members (loopback members only)."""
        import pyetcd

        eps = [pyetcd.Endpoint(self.host, p, secure=False, time_retry=0.2)
               for j, p in enumerate(self.client_ports) if self.procs[j] is not None]
        return pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=1.0, failover=True)

    def _status(self) -> list[tuple[int, int, int]]:
        """(member index, its member id, the leader's id) of each member that answers;
        asked from inside the members' namespace when they run in one."""
        code = ("import json,sys,pyetcd\n"
                "out=[]\n"
                "for j,p in json.loads(sys.argv[1]):\n"
                "    c=pyetcd.Etcd3Client(sys.argv[2],p,timeout=0.5)\n"
                "    try:\n"
                "        r=c.maintenancestub.Status(pyetcd.etcdrpc.StatusRequest(),0.5)\n"
                "        out.append([j,int(r.header.member_id),int(r.leader)])\n"
                "    except Exception: pass\n"
                "    finally: c.close()\n"
                "print(json.dumps(out))\n")
        live = [[j, p] for j, p in enumerate(self.client_ports) if self.procs[j] is not None]
        r = subprocess.run([*self.prefix, sys.executable, "-c", code, json.dumps(live),
                            self.host], capture_output=True, text=True, timeout=30)
        return [tuple(x) for x in json.loads(r.stdout or "[]")]  # type: ignore[misc]

    def wait_healthy(self, timeout: float = 20.0) -> None:
        def ok() -> bool:
            st = self._status()
            live = sum(p is not None for p in self.procs)
            return len(st) == live and all(leader for _, _, leader in st)

        wait_for(ok, timeout, "etcd members to elect a leader", 0.1)

    def leader(self) -> int:
        """Index of the member that is the raft leader."""
        for j, mid, leader in self._status():
            if mid == leader:
                return j
        raise AssertionError("no etcd leader")

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
            self.procs[i] = None

    def stop(self) -> None:
        for i in range(self.n):
            p = self.procs[i]
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
                self.procs[i] = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=30)


def bed_refusal() -> str | None:
    """Why a bed cannot be built here (None: it can)."""
    if os.geteuid() != 0:
        return "the test bed needs root (ip netns, mounts)"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "the test bed needs iproute2 and util-linux (ip, nsenter)"
    name = f"kvp{os.getpid() % 100000}"
    r = _run(["ip", "netns", "add", name], check=False)
    if r.returncode:
        return f"`ip netns add` refused: {r.stderr.strip()}"
    _run(["ip", "netns", "del", name], check=False)
    return None


class Bed:
    """``hosts`` hosts (``h0``..) on a bridge; host i has address 10.77.<net>.(i+1).

    The switch namespace's bridge has 10.77.<net>.254 (where etcd runs, so a host's
    partition also cuts it from etcd).
    """

    def __init__(self, hosts: int = 3) -> None:
        self.tag = f"k{os.getpid() % 10000}{uuid.uuid4().hex[:3]}"
        self.net = 77
        self.sub = 100 + (os.getpid() % 150)
        self.n = hosts
        self.sw = f"{self.tag}sw"
        self.mntdir = f"/run/kvmnt-{self.tag}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []

    def addr(self, i: int) -> str:
        return f"10.{self.net}.{self.sub}.{i + 1}"

    @property
    def switch_addr(self) -> str:
        return f"10.{self.net}.{self.sub}.254"

    def ns(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def create(self) -> "Bed":
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def _create(self) -> None:
        sw = self.sw
        _run(["ip", "netns", "add", sw])
        self._made.append(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "addr", "add", f"{self.switch_addr}/24", "dev", "br0"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        os.makedirs(self.mntdir, exist_ok=True)
        _run(["mount", "--bind", self.mntdir, self.mntdir])
        _run(["mount", "--make-private", self.mntdir])
        for i in range(self.n):
            h = self.ns(i)
            _run(["ip", "netns", "add", h])
            self._made.append(h)
            _run(["ip", "link", "add", "eth0", "netns", h, "type", "veth", "peer", "name",
                  f"sw{i}", "netns", sw])
            _run(["ip", "-n", h, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", h, "link", "set", "lo", "up"])
            _run(["ip", "-n", h, "link", "set", "eth0", "up"])
            _run(["ip", "-n", sw, "link", "set", f"sw{i}", "master", "br0", "up"])
            mnt = f"{self.mntdir}/{h}"
            open(mnt, "w").close()
            _run(["unshare", f"--mount={mnt}", "--propagation", "private", "mount", "-t",
                  "tmpfs", "-o", "size=1g,mode=1777", f"kvshm-{h}", "/dev/shm"])

    def prefix(self, i: int | None) -> list[str]:
        """Command prefix that runs a command on host i (None: in the switch namespace)."""
        if i is None:
            return ["ip", "netns", "exec", self.sw]
        return ["nsenter", f"--mount={self.mntdir}/{self.ns(i)}",
                f"--net=/run/netns/{self.ns(i)}"]

    def spawn(self, i: int | None, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([*self.prefix(i), *argv], start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def port_down(self, i: int) -> None:
        _run(["ip", "-n", self.sw, "link", "set", f"sw{i}", "down"])

    def port_up(self, i: int) -> None:
        _run(["ip", "-n", self.sw, "link", "set", f"sw{i}", "up"])

    def kill_host(self, i: int) -> None:
        """Switch port down, then SIGKILL of every process in the host's namespace."""
        self.port_down(i)
        r = _run(["ip", "netns", "pids", self.ns(i)], check=False)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def rate_limit(self, i: int, rate: str = "1gbit") -> None:
        _run(["ip", "netns", "exec", self.ns(i), "tc", "qdisc", "add", "dev", "eth0", "root",
              "tbf", "rate", rate, "burst", "4mb", "latency", "5ms"])

    def port_rx(self, i: int) -> int:
        """Bytes host i sent into the switch (its port's rx counter)."""
        r = _run(["ip", "netns", "exec", self.sw, "cat",
                  f"/sys/class/net/sw{i}/statistics/rx_bytes"])
        return int(r.stdout)

    def port_tx(self, i: int) -> int:
        """Bytes the switch sent to host i."""
        r = _run(["ip", "netns", "exec", self.sw, "cat",
                  f"/sys/class/net/sw{i}/statistics/tx_bytes"])
        return int(r.stdout)

    def destroy(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    try:
                        f.close()
                    except OSError:     # (stdin with bytes its dead child never read:
                        pass            # BrokenPipeError; the rest must still go)
        for i in range(self.n):
            r = _run(["ip", "netns", "pids", self.ns(i)], check=False)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name in reversed(self._made):
            _run(["ip", "netns", "del", name], check=False)
        self._made.clear()
        if os.path.isdir(self.mntdir):
            for i in range(self.n):
                _run(["umount", f"{self.mntdir}/{self.ns(i)}"], check=False)
            _run(["umount", self.mntdir], check=False)
            shutil.rmtree(self.mntdir, ignore_errors=True)

    def __enter__(self) -> "Bed":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


class Agent:
    """A Python process on a bed host running ``tests/bed_agent.py``: JSON lines in, JSON
    lines out (one command, one answer)."""

    def __init__(self, bed: Bed, host: int, timeout: float = 60.0,
                 env: dict[str, str] | None = None) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, **(env or {}), PYTHONPATH=os.path.dirname(here))
        self.proc = bed.spawn(host, [sys.executable, "-u", os.path.join(here, "bed_agent.py")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.timeout = timeout

    def __call__(self, cmd: str, **args: Any) -> Any:
        import select

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self.proc.stdin.flush()
        r, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not r:
            raise AssertionError(f"bed agent did not answer {cmd} in {self.timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"bed agent exited during {cmd}")
        out = json.loads(line)
        if "error" in out:
            raise AssertionError(f"bed agent {cmd}: {out['error']}")
        return out["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self("exit")
            except AssertionError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
