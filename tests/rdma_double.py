"""A verbs test double: what runs here in place of an RDMA NIC. Tests only, never shipped.

:class:`FakeVerbs` implements the backend interface of :mod:`kvshm.rdma.verbs` (device
contexts, protection domains, memory regions, completion queues, RC queue pairs) in
Python, so the whole RDMA client/server flow of kvshm, handshake included, runs on a host
without RDMA. What it emulates:

* **The fabric**: a directory shared by the processes of a test. A QP publishes its state
  and connection attributes there, and an MR over shared memory (the server's pool)
  publishes its rkey, address, length, access and the POSIX shm segment holding it
  (found in ``/proc/self/maps``). The client side reaches the server's pool by attaching
  that segment by name (``kvshm.Pool.attach``), so RDMA WRITE and READ copy into and out
  of the real pool of the server process.
* **QP state transitions** RESET -> INIT -> RTR -> RTS with the checks a driver makes
  (attribute masks, an address vector with a GRH and a valid ``sgid_index`` on RoCE, a
  DLID on InfiniBand, path MTU within the port's), and at transfer time the checks the
  remote NIC makes: the destination QP exists, is at least RTR and connected back to this
  QP, the GID/LID routes to it, the PSNs and path MTUs agree, the READ depth fits its
  responder resources, the rkey is one of its PD's MRs with the access asked for and the
  range lies inside it. Local SGEs must lie in this process's registered MRs (and allow
  LOCAL_WRITE for a READ).
* **Send queue and completion queue**: ``post_send`` refuses more outstanding work
  requests than ``max_send_wr`` (ENOMEM, as ibv_post_send) or more SGEs than
  ``max_send_sge``; work requests execute when the CQ is polled (``rate`` per poll, so
  work stays outstanding as on a NIC); a signalled success gives a completion and
  retires every earlier work request; an error completes the failing work request with
  its status, moves the QP to the error state, and every later one completes with
  ``IBV_WC_WR_FLUSH_ERR``.
* **Injected errors** (:meth:`FakeVerbs.inject`): ``"retry_exceeded"`` (the peer does not
  answer), ``"remote_access"`` (a bad rkey), ``"flush"`` (the QP is already in error).

``python tests/rdma_double.py serve --fabric DIR <kvshm serve flags>`` runs a kvshm server
whose RDMA side uses this double (a tests-only launcher; ``kvshm serve`` never can).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvshm import Pool
from kvshm._pool import HEADER_SIZE
from kvshm.rdma import constants as C
from kvshm.rdma.device import DeviceCaps, GidEntry, PortInfo
from kvshm.rdma.errors import DeviceError, PostError, RdmaError
from kvshm.rdma.qp import INIT_MASK, RTR_MASK, RTS_MASK, QpAttrs
from kvshm.rdma.verbs import Completion, QpCaps
from kvshm.rdma.wr import WorkRequest

__all__ = ["FakeVerbs", "FakeDevice", "Fabric", "roce_gids", "ib_gids"]


def _v4_gid(ip: str) -> bytes:
    return bytes(10) + b"\xff\xff" + bytes(int(x) for x in ip.split("."))


def _ll_gid(n: int) -> bytes:
    return b"\xfe\x80" + bytes(6) + n.to_bytes(8, "big")


def roce_gids(ip: str = "192.0.2.1", host: int = 1) -> list[GidEntry]:
    """A mlx5-like RoCE GID table: link-local v1/v2, then the IPv4 address v1/v2."""
    return [GidEntry(0, _ll_gid(host), "RoCEv1", 5, "eth1"),
            GidEntry(1, _ll_gid(host), "RoCEv2", 5, "eth1"),
            GidEntry(2, _v4_gid(ip), "RoCEv1", 5, "eth1"),
            GidEntry(3, _v4_gid(ip), "RoCEv2", 5, "eth1")]


def ib_gids(host: int = 1) -> list[GidEntry]:
    return [GidEntry(0, _ll_gid(host), "IB")]


@dataclass
class FakeDevice:
    """One emulated device with one port."""

    name: str = "fake0"
    link_layer: str = "Ethernet"
    lid: int = 0
    mtu: int = 4096
    state: int = C.PORT_ACTIVE
    gids: list[GidEntry] = field(default_factory=roce_gids)
    max_qp_wr: int = 1024
    max_sge: int = 8
    max_sge_rd: int = 8
    max_msg_sz: int = 1 << 30
    max_qp_rd_atom: int = 16
    max_mr_size: int = 1 << 40


class Fabric:
    """The shared 'network': one JSON file per published QP and MR in ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)

    def _file(self, kind: str, ident: int) -> str:
        return os.path.join(self.path, f"{kind}-{ident}.json")

    def claim(self, kind: str, bits: int) -> int:
        """A number unique over the fabric (its file is created empty)."""
        while True:
            ident = int.from_bytes(os.urandom(4), "little") & ((1 << bits) - 1)
            if ident == 0:
                continue
            try:
                fd = os.open(self._file(kind, ident), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.close(fd)
            return ident

    def publish(self, kind: str, ident: int, record: dict[str, Any]) -> None:
        tmp = self._file(kind, ident) + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self._file(kind, ident))

    def read(self, kind: str, ident: int) -> dict[str, Any] | None:
        try:
            with open(self._file(kind, ident)) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        return json.loads(text) if text else None

    def remove(self, kind: str, ident: int) -> None:
        try:
            os.unlink(self._file(kind, ident))
        except FileNotFoundError:
            pass


def _shm_of(addr: int, length: int) -> tuple[str, int] | None:
    """(shm name, file offset of ``addr``) when [addr, addr+length) is a /dev/shm mapping."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr and addr + length <= hi and len(parts) == 6:
                path = parts[5].strip()
                if path.startswith("/dev/shm/"):
                    return path[len("/dev/shm/"):], int(parts[2], 16) + (addr - lo)
    return None


class FakeMR:
    def __init__(self, pd: "FakePD", addr: int, length: int, access: int) -> None:
        self.pd = pd
        self.addr = addr
        self.length = length
        self.access = access
        v = pd.ctx.verbs
        self.lkey = self.rkey = v.fabric.claim("mr", 32)
        self.shm = _shm_of(addr, length)
        v.local_mrs[self.lkey] = self
        v.fabric.publish("mr", self.rkey, {
            "pd": pd.ident, "addr": addr, "length": length, "access": access,
            "shm": self.shm[0] if self.shm else None,
            "file_offset": self.shm[1] if self.shm else None})
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            v = self.pd.ctx.verbs
            v.local_mrs.pop(self.lkey, None)
            v.fabric.remove("mr", self.rkey)


class FakeCQ:
    def __init__(self, ctx: "FakeContext", cqe: int) -> None:
        self.ctx = ctx
        self.cqe = cqe
        self.entries: list[Completion] = []
        self.qps: list[FakeQP] = []
        self.closed = False

    def poll(self, n: int) -> list[Completion]:
        if self.closed:
            raise RdmaError("poll of a destroyed CQ")
        for qp in self.qps:
            qp.progress(self.ctx.verbs.rate)
        out, self.entries = self.entries[:n], self.entries[n:]
        for c in out:
            for qp in self.qps:
                qp.retire(c.wr_id)
        return out

    def close(self) -> None:
        if any(not q.closed for q in self.qps):
            raise RdmaError("destroying a CQ that QPs still use (EBUSY)")
        self.closed = True


class FakeQP:
    def __init__(self, pd: "FakePD", cq: FakeCQ, caps: QpCaps) -> None:
        dev = pd.ctx.device
        if caps.max_send_wr > dev.max_qp_wr or caps.max_send_sge > dev.max_sge:
            raise RdmaError(f"QP caps {caps} exceed the device's")
        self.pd = pd
        self.cq = cq
        self.caps = caps
        self.verbs = pd.ctx.verbs
        self.qpn = self.verbs.fabric.claim("qp", 24)
        self.state = C.QPS_RESET
        self.attrs: dict[str, Any] = {}
        self.queue: list[WorkRequest] = []      # posted, not executed
        self.outstanding: list[int] = []        # posted, not retired (wr_ids in order)
        cq.qps.append(self)
        self.closed = False
        self._publish()

    # ------------------------------------------------------------ state

    def _publish(self) -> None:
        dev = self.pd.ctx.device
        gid = None
        if "sgid_index" in self.attrs:
            for g in dev.gids:
                if g.index == self.attrs["sgid_index"]:
                    gid = g.gid.hex()
        self.verbs.fabric.publish("qp", self.qpn, {
            "state": self.state, "pd": self.pd.ident, "access": self.attrs.get("access", 0),
            "dest_qpn": self.attrs.get("dest_qpn"), "rq_psn": self.attrs.get("rq_psn"),
            "sq_psn": self.attrs.get("sq_psn"), "mtu": self.attrs.get("mtu"),
            "resp_depth": self.attrs.get("resp_depth", 0), "gid": gid, "lid": dev.lid,
            "gids": [g.gid.hex() for g in dev.gids], "link": dev.link_layer})

    def modify(self, a: QpAttrs, mask: int) -> None:
        if self.closed:
            raise RdmaError("modify of a destroyed QP")
        dev = self.pd.ctx.device
        want = {C.QPS_INIT: (C.QPS_RESET, INIT_MASK), C.QPS_RTR: (C.QPS_INIT, RTR_MASK),
                C.QPS_RTS: (C.QPS_RTR, RTS_MASK)}
        if a.qp_state not in want:
            raise RdmaError(f"the double only knows INIT/RTR/RTS transitions, got "
                            f"{a.qp_state}")
        prev, need = want[a.qp_state]
        if self.state != prev:
            raise RdmaError(f"QP {self.qpn}: invalid transition {self.state} -> "
                            f"{a.qp_state} (EINVAL)")
        if mask & need != need:
            raise RdmaError(f"QP {self.qpn}: attribute mask 0x{mask:x} lacks 0x"
                            f"{need & ~mask:x} for state {a.qp_state} (EINVAL)")
        if a.qp_state == C.QPS_INIT:
            if a.port_num != 1:
                raise RdmaError(f"no port {a.port_num} (EINVAL)")
            self.attrs["access"] = a.qp_access_flags
        elif a.qp_state == C.QPS_RTR:
            if not 1 <= a.path_mtu <= C.mtu_enum(dev.mtu):
                raise RdmaError(f"path MTU {a.path_mtu} above the port's (EINVAL)")
            if not a.dest_qp_num:
                raise RdmaError("RTR without a destination QP number (EINVAL)")
            if dev.link_layer == "Ethernet":
                if not a.ah_is_global:
                    raise RdmaError("RoCE needs a GRH: is_global=0 (EINVAL)")
                if a.ah_sgid_index not in [g.index for g in dev.gids]:
                    raise RdmaError(f"sgid_index {a.ah_sgid_index} not in the GID table")
                if not any(a.ah_dgid) or a.ah_hop_limit < 1:
                    raise RdmaError("RoCE GRH needs a dgid and a hop limit (EINVAL)")
            elif not a.ah_dlid and not a.ah_is_global:
                raise RdmaError("InfiniBand RTR without a DLID (EINVAL)")
            self.attrs.update(dest_qpn=a.dest_qp_num, rq_psn=a.rq_psn,
                              mtu=C.mtu_bytes(a.path_mtu), resp_depth=a.max_dest_rd_atomic,
                              dgid=bytes(a.ah_dgid).hex(), dlid=a.ah_dlid,
                              sgid_index=a.ah_sgid_index if a.ah_is_global else 0)
        else:
            if not 1 <= a.retry_cnt <= 7 or not 0 < a.timeout < 32:
                raise RdmaError("RTS needs a timeout and a retry count (EINVAL)")
            self.attrs.update(sq_psn=a.sq_psn, init_depth=a.max_rd_atomic)
        self.state = a.qp_state
        self._publish()

    # ------------------------------------------------------------ send queue

    def post_send(self, wrs: Sequence[WorkRequest]) -> None:
        if self.closed:
            raise PostError("post_send on a destroyed QP")
        if self.state not in (C.QPS_RTS, C.QPS_ERR):
            raise PostError(f"post_send on QP {self.qpn} in state {self.state} (EINVAL)")
        if len(self.outstanding) + len(wrs) > self.caps.max_send_wr:
            raise PostError(f"send queue full: {len(self.outstanding)} outstanding + "
                            f"{len(wrs)} > max_send_wr {self.caps.max_send_wr} (ENOMEM)")
        for w in wrs:
            if not 1 <= len(w.sges) <= self.caps.max_send_sge:
                raise PostError(f"{len(w.sges)} SGEs > max_send_sge (EINVAL)")
        self.verbs.posted += len(wrs)
        self.verbs.max_outstanding_seen = max(self.verbs.max_outstanding_seen,
                                              len(self.outstanding) + len(wrs))
        self.queue.extend(wrs)
        self.outstanding.extend(w.wr_id for w in wrs)

    def retire(self, wr_id: int) -> None:
        if wr_id in self.outstanding:
            del self.outstanding[:self.outstanding.index(wr_id) + 1]

    def progress(self, rate: int | None) -> None:
        n = len(self.queue) if rate is None else min(rate, len(self.queue))
        for _ in range(n):
            w = self.queue.pop(0)
            status = self._execute(w) if self.state != C.QPS_ERR else C.WC_WR_FLUSH_ERR
            if status != C.WC_SUCCESS:
                if self.state != C.QPS_ERR:
                    self.state = C.QPS_ERR
                    self._publish()
                self.cq.entries.append(Completion(w.wr_id, status, _wc_opcode(w.opcode)))
            elif w.signaled:
                self.cq.entries.append(Completion(w.wr_id, status, _wc_opcode(w.opcode)))
            self.verbs.executed += 1

    # ------------------------------------------------------------ the NICs' checks

    def _execute(self, w: WorkRequest) -> int:
        v = self.verbs
        inj = v.take_injection()
        if inj == "flush":
            return C.WC_WR_FLUSH_ERR
        dev = self.pd.ctx.device
        if w.length > dev.max_msg_sz:
            return 1   # IBV_WC_LOC_LEN_ERR
        # local side: every SGE inside a registered MR of this PD
        for s in w.sges:
            mr = v.local_mrs.get(s.lkey)
            if (mr is None or mr.pd is not self.pd or s.addr < mr.addr
                    or s.addr + s.length > mr.addr + mr.length):
                return 4   # IBV_WC_LOC_PROT_ERR
            if w.opcode == C.WR_RDMA_READ and not mr.access & C.ACCESS_LOCAL_WRITE:
                return 8   # IBV_WC_LOC_ACCESS_ERR
        # the wire: the peer exists, is connected back to us, and the route is right
        peer = v.fabric.read("qp", self.attrs["dest_qpn"])
        if inj == "retry_exceeded" or peer is None or peer["state"] not in (C.QPS_RTR,
                                                                           C.QPS_RTS):
            return C.WC_RETRY_EXC_ERR
        if peer["dest_qpn"] != self.qpn or peer["rq_psn"] != self.attrs["sq_psn"]:
            return C.WC_RETRY_EXC_ERR
        if dev.link_layer == "Ethernet":
            if self.attrs["dgid"] not in peer["gids"] or peer["link"] != "Ethernet":
                return C.WC_RETRY_EXC_ERR
        elif self.attrs["dlid"] != peer["lid"] and self.attrs["dgid"] not in peer["gids"]:
            return C.WC_RETRY_EXC_ERR
        if peer["mtu"] != self.attrs["mtu"]:
            return C.WC_RETRY_EXC_ERR
        if w.opcode == C.WR_RDMA_READ and self.attrs["init_depth"] > peer["resp_depth"]:
            return 9   # IBV_WC_REM_INV_REQ_ERR
        # remote memory: rkey of the peer's PD, access, range
        rkey = w.rkey ^ 0x5A5A5A5A if inj == "remote_access" else w.rkey
        need = C.ACCESS_REMOTE_WRITE if w.opcode == C.WR_RDMA_WRITE else C.ACCESS_REMOTE_READ
        mr = v.fabric.read("mr", rkey)
        if (mr is None or mr["pd"] != peer["pd"] or not mr["access"] & need
                or not peer["access"] & need or w.remote_addr < mr["addr"]
                or w.remote_addr + w.length > mr["addr"] + mr["length"] or not mr["shm"]):
            return C.WC_REM_ACCESS_ERR
        base = v.remote_base(mr["shm"]) + mr["file_offset"] - HEADER_SIZE
        raddr = base + (w.remote_addr - mr["addr"])
        for s in w.sges:
            if w.opcode == C.WR_RDMA_WRITE:
                ctypes.memmove(raddr, s.addr, s.length)
            else:
                ctypes.memmove(s.addr, raddr, s.length)
            raddr += s.length
        v.bytes_moved += w.length
        return C.WC_SUCCESS

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.clear()
            self.verbs.fabric.remove("qp", self.qpn)


def _wc_opcode(opcode: int) -> int:
    return 1 if opcode == C.WR_RDMA_WRITE else 2   # IBV_WC_RDMA_WRITE / _READ


class FakePD:
    def __init__(self, ctx: "FakeContext") -> None:
        self.ctx = ctx
        self.ident = uuid.uuid4().hex
        self.mrs: list[FakeMR] = []
        self.qps: list[FakeQP] = []
        self.closed = False

    def reg_mr(self, addr: int, length: int, access: int) -> FakeMR:
        if self.closed:
            raise RdmaError("reg_mr on a closed PD")
        v = self.ctx.verbs
        if v.fail_reg:
            raise RdmaError(f"registering {length} bytes failed: {v.fail_reg}")
        mr = FakeMR(self, addr, length, access)
        self.mrs.append(mr)
        v.registrations += 1
        return mr

    def create_qp(self, cq: Any, caps: QpCaps) -> FakeQP:
        qp = FakeQP(self, cq, caps)
        self.qps.append(qp)
        return qp

    def close(self) -> None:
        if any(not q.closed for q in self.qps) or any(not m.closed for m in self.mrs):
            raise RdmaError("deallocating a PD that QPs or MRs still use (EBUSY)")
        self.closed = True


class FakeContext:
    def __init__(self, verbs: "FakeVerbs", device: FakeDevice) -> None:
        self.verbs = verbs
        self.device = device
        self.name = device.name
        self.pds: list[FakePD] = []
        self.cqs: list[FakeCQ] = []
        self.closed = False

    def caps(self) -> DeviceCaps:
        d = self.device
        return DeviceCaps(max_qp_wr=d.max_qp_wr, max_sge=d.max_sge, max_sge_rd=d.max_sge_rd,
                          max_qp_rd_atom=d.max_qp_rd_atom,
                          max_qp_init_rd_atom=d.max_qp_rd_atom, max_cqe=1 << 16,
                          max_mr_size=d.max_mr_size, phys_port_cnt=1)

    def port(self, port_num: int) -> PortInfo:
        if port_num != 1:
            raise DeviceError(self.name, f"ibv_query_port({port_num}) failed")
        d = self.device
        return PortInfo(state=d.state, lid=d.lid, link_layer=d.link_layer,
                        active_mtu=d.mtu, max_msg_sz=d.max_msg_sz, gid_tbl_len=16)

    def gid_table(self, port_num: int) -> list[GidEntry]:
        return list(self.device.gids)

    def alloc_pd(self) -> FakePD:
        pd = FakePD(self)
        self.pds.append(pd)
        return pd

    def create_cq(self, cqe: int) -> FakeCQ:
        cq = FakeCQ(self, cqe)
        self.cqs.append(cq)
        return cq

    def close(self) -> None:
        """Like ibv_close_device after pyverbs' Context.close: everything made from it
        goes."""
        if self.closed:
            return
        self.closed = True
        for pd in self.pds:
            for q in pd.qps:
                q.close()
            for m in pd.mrs:
                m.close()
            pd.closed = True
        self.verbs.contexts.discard(self)


class FakeVerbs:
    """The verbs double (see the module docstring).

    Parameters
    ----------
    fabric : str
        Directory shared by every FakeVerbs of one test (client and server side).
    devices : list of FakeDevice, optional
        Default: one RoCE device ``fake0``.
    rate : int, optional
        Work requests a QP executes per CQ poll (None: all queued).
    pins_memory : bool
        Pretend registrations pin memory (the server then checks RLIMIT_MEMLOCK).
    list_error : str, optional
        ``device_names`` raises DeviceError with this cause (a host without RDMA).
    """

    name = "fake"

    def __init__(self, fabric: str, devices: list[FakeDevice] | None = None, *,
                 rate: int | None = 4, pins_memory: bool = False,
                 list_error: str | None = None) -> None:
        self.fabric = Fabric(fabric)
        self.devices = {d.name: d for d in (devices or [FakeDevice()])}
        self.rate = rate
        self.pins_memory = pins_memory
        self.list_error = list_error
        self.local_mrs: dict[int, FakeMR] = {}
        self.contexts: set[FakeContext] = set()
        self._pools: dict[str, Pool] = {}
        self._inject: list[str] = []
        self._lock = threading.Lock()
        self.fail_reg: str | None = None
        self.posted = self.executed = self.registrations = self.bytes_moved = 0
        self.max_outstanding_seen = 0

    def device_names(self) -> list[str]:
        if self.list_error is not None:
            raise DeviceError(None, self.list_error)
        return list(self.devices)

    def open(self, name: str) -> FakeContext:
        ctx = FakeContext(self, self.devices[name])
        self.contexts.add(ctx)
        return ctx

    # ------------------------------------------------------------ injection

    def inject(self, kind: str, count: int = 1) -> None:
        """Make the next ``count`` work requests executed fail with ``kind``:
        ``"retry_exceeded"``, ``"remote_access"`` or ``"flush"``."""
        if kind not in ("retry_exceeded", "remote_access", "flush"):
            raise ValueError(kind)
        with self._lock:
            self._inject.extend([kind] * count)

    def take_injection(self) -> str | None:
        with self._lock:
            return self._inject.pop(0) if self._inject else None

    # ------------------------------------------------------------ remote memory

    def remote_base(self, shm: str) -> int:
        """Address, in this process, of the data area of the pool in segment ``shm``."""
        pool = self._pools.get(shm)
        if pool is None or pool.closed:
            pool = self._pools[shm] = Pool.attach(shm)
        return int(pool.address)

    def close(self) -> None:
        """Unmap the pools attached to reach remote memory; close leftover contexts."""
        for ctx in list(self.contexts):
            ctx.close()
        for p in self._pools.values():
            try:
                p.close()
            except BufferError:
                pass
        self._pools.clear()


# ----------------------------------------------------------------------------- launcher


def _serve(argv: list[str]) -> int:
    import argparse
    import signal

    from kvshm.cli import add_server_flags, config_from_args
    from kvshm.server import Server

    p = argparse.ArgumentParser(prog="rdma_double serve")
    p.add_argument("--fabric", required=True)
    p.add_argument("--rate", type=int, default=4)
    add_server_flags(p)
    args = p.parse_args(argv)
    verbs = FakeVerbs(args.fabric, rate=args.rate)
    server = Server(config_from_args(args), rdma_backend=verbs)

    def stop(signum: int, frame: Any) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever(ready=lambda s: print(s.ready_line(), flush=True))
    except OSError as exc:
        print(f"rdma_double serve: {exc}", file=sys.stderr)
        return 2
    finally:
        verbs.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(_serve(sys.argv[2:]))
    print(__doc__)
    sys.exit(2)
