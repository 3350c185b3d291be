"""The server's RDMA endpoint: one device port, one protection domain, one memory region
over the whole pool (registered once at start-up), one completion queue, and one RC queue
pair per client connection.

The server never posts a work request: clients RDMA WRITE into and READ from the pool,
and the server's NIC answers. A client's QP is set up inside its HELLO (see
``docs/RDMA.md``): :meth:`ServerEndpoint.hello_hook` is the ServiceLoop's ``hello_hook``.
It runs in the loop thread, which owns this object.

Connections are dropped when the same client (its session nonce) says HELLO with a new QP
(the previous one is kept ``grace`` seconds so transfers already in flight on it finish),
when there are more than ``max_connections`` (the oldest goes), when the store reclaims
the client's grants (:meth:`ServerEndpoint.drop`: every QP of the client, retired ones
too, so a late WRITE fails at the NIC instead of landing in reused blocks), and at
:meth:`close`.

What a QP grants: the pool's rkey covers the whole pool (one memory region, registered
once), so an authenticated remote client with a connected QP can READ and WRITE any
byte of the pool, not only the blocks it was granted. RDMA is therefore offered only to
clients the server lets in (CURVE with an allow-list for other hosts; docs/RDMA.md), and
a reclaimed client loses every QP at once.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvshm.rdma import constants as C
from kvshm.rdma.device import LocalPort, open_port
from kvshm.rdma.errors import DeviceError, RdmaError
from kvshm.rdma.memlock import check_memlock
from kvshm.rdma.qp import (INIT_MASK, RTR_MASK, RTS_MASK, QpInfo, init_attrs, new_psn,
                           rtr_attrs, rts_attrs)
from kvshm.rdma.verbs import QpCaps

if TYPE_CHECKING:
    from kvshm.rdma.verbs import Backend, MemoryRegion, QueuePair

__all__ = ["ServerEndpoint", "POOL_ACCESS"]

log = logging.getLogger(__name__)

#: Access of the pool's memory region.
POOL_ACCESS = C.ACCESS_LOCAL_WRITE | C.ACCESS_REMOTE_READ | C.ACCESS_REMOTE_WRITE
_QP_ACCESS = C.ACCESS_REMOTE_READ | C.ACCESS_REMOTE_WRITE


@dataclass
class _Conn:
    qp: "QueuePair"
    local: QpInfo
    remote: QpInfo
    since: float

    def close(self) -> None:
        try:
            self.qp.close()
        except Exception as exc:
            log.warning("destroying QP %d failed: %s", self.local.qpn, exc)


def _fmt_gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB pool"


class ServerEndpoint:
    """The RDMA side of a kvshm server (see the module docstring).

    Create with :meth:`open`, then :meth:`register_pool`.
    """

    def __init__(self, port: LocalPort, *, force_grh: bool = False,
                 max_connections: int = 1024, grace: float = 60.0) -> None:
        self.port = port
        self.force_grh = force_grh
        self.max_connections = max_connections
        self.grace = grace
        self.pd = port.ctx.alloc_pd()
        try:
            self.cq = port.ctx.create_cq(16)
        except BaseException:
            self.pd.close()
            raise
        self.mr: "MemoryRegion | None" = None
        self.pool_size = 0
        self.responder_depth = max(1, min(port.caps.max_qp_rd_atom, 16))
        self._conns: "OrderedDict[bytes, _Conn]" = OrderedDict()
        self._retired: list[tuple[float, bytes, _Conn]] = []
        self.accepted = 0
        self.refused = 0
        self._closed = False

    @classmethod
    def open(cls, dev_name: str, *, ib_port: int = 1, link_type: str | None = None,
             gid_index: int | None = None, pool_bytes: int = 0, host: str | None = None,
             backend: "Backend | None" = None, **kwargs: Any) -> "ServerEndpoint":
        """Open ``dev_name`` for a pool of ``pool_bytes``.

        ``host`` (the address the server binds) picks the RoCE GID of that IPv4 address
        when it is one of the port's. ``backend`` replaces pyverbs (tests only).

        Raises
        ------
        DeviceError
            No such device / no RDMA on this host / port not active / no usable GID /
            pyverbs missing; the message names the device and the cause.
        MemlockError
            RLIMIT_MEMLOCK is below the pool size; the message says how to raise it.
        """
        if backend is None:
            from kvshm.rdma.verbs import PyverbsBackend

            try:
                backend = PyverbsBackend()
            except DeviceError as exc:
                raise exc.naming(dev_name) from None
        prefer = None
        if host:
            try:
                ip = ipaddress.ip_address(host)
                if ip.version == 4 and not ip.is_unspecified:
                    prefer = str(ip)
            except ValueError:
                pass
        port = open_port(backend, dev_name, ib_port, link_type=link_type,
                         gid_index=gid_index, prefer_ipv4=prefer)
        try:
            if pool_bytes and backend.pins_memory:
                check_memlock(pool_bytes, what=f"the {_fmt_gib(pool_bytes)}")
            if pool_bytes > port.caps.max_mr_size > 0:
                raise RdmaError(f"the pool ({pool_bytes} bytes) is larger than the largest "
                                f"memory region {dev_name} can register "
                                f"({port.caps.max_mr_size} bytes)")
            return cls(port, force_grh=(gid_index is not None and port.link_layer == "IB"),
                       **kwargs)
        except BaseException:
            port.close()
            raise

    # ------------------------------------------------------------------ set-up

    def register_pool(self, address: int, size: int) -> None:
        """Register the pool's data area (``Pool.address``, ``Pool.size``) once."""
        if self.mr is not None:
            raise RuntimeError("the pool is registered already")
        self.mr = self.pd.reg_mr(address, size, POOL_ACCESS)
        self.pool_size = size
        log.info("RDMA: pool registered on %s (rkey 0x%x)", self.port.describe(),
                 self.mr.rkey)

    def describe(self) -> str:
        """For the ready line: ``mlx5_0:1 RoCEv2 gid 3 (::ffff:10.0.0.1) mtu 4096``."""
        return self.port.describe()

    def offer(self) -> dict[str, Any]:
        """What every HELLO reply says about this server's RDMA."""
        return {"dev": self.port.device, "port": self.port.port_num,
                "link": self.port.link_layer, "gid_type": self.port.gid.gid_type,
                "mtu": self.port.port.active_mtu}

    def local_info(self, qpn: int) -> QpInfo:
        p = self.port
        return QpInfo(qpn=qpn, psn=new_psn(), lid=p.port.lid, gid=p.gid.gid,
                      mtu=p.port.active_mtu, link_layer=p.link_layer,
                      rd_atomic=self.responder_depth)

    # ------------------------------------------------------------------ HELLO

    def hello_hook(self, session: Any, body: dict[str, Any]) -> dict[str, Any]:
        """ServiceLoop ``hello_hook``: the ``rdma`` part of the HELLO reply (``session``:
        the client's :class:`kvshm.store.Session`; its QPs are keyed by its nonce).

        Without ``body["rdma"]["qp"]``: only the offer. With it: the server's QP info,
        the pool's address, rkey and size, or ``error`` saying why not.
        """
        client_id = session.nonce if not isinstance(session, bytes) else session
        out: dict[str, Any] = {"offer": self.offer()}
        req = body.get("rdma")
        if isinstance(req, dict) and "qp" in req:
            try:
                out.update(self.accept(client_id, QpInfo.from_wire(req["qp"])))
            except (ValueError, RdmaError) as exc:
                self.refused += 1
                log.warning("RDMA connection of client %s refused: %s", client_id.hex(), exc)
                out["error"] = str(exc)
        return {"rdma": out}

    def accept(self, client_id: bytes, remote: QpInfo) -> dict[str, Any]:
        """Create, connect and return (for the HELLO reply) a QP for ``client_id``.

        Raises
        ------
        ValueError
            ``remote`` does not fit this port (other link layer).
        RdmaError
            A verbs call failed.
        """
        if self._closed or self.mr is None:
            raise RdmaError("the server's pool is not registered for RDMA")
        if remote.link_layer != self.port.link_layer:
            raise ValueError(f"the client's port is {remote.link_layer}, this server's "
                             f"{self.port.device}:{self.port.port_num} is "
                             f"{self.port.link_layer}")
        now = time.monotonic()
        self.reap(now)
        old = self._conns.pop(client_id, None)
        if old is not None:
            self._retired.append((now + self.grace, client_id, old))
        p = self.port
        qp = self.pd.create_qp(self.cq, QpCaps(max_send_wr=1, max_send_sge=1))
        try:
            local = self.local_info(qp.qpn)
            qp.modify(init_attrs(port_num=p.port_num, access=_QP_ACCESS), INIT_MASK)
            qp.modify(rtr_attrs(local, remote, port_num=p.port_num, sgid_index=p.gid.index,
                                responder_depth=self.responder_depth,
                                force_grh=self.force_grh), RTR_MASK)
            qp.modify(rts_attrs(local, initiator_depth=1), RTS_MASK)
        except BaseException:
            qp.close()
            raise
        self._conns[client_id] = _Conn(qp, local, remote, now)
        self.accepted += 1
        while len(self._conns) > self.max_connections:
            cid, c = self._conns.popitem(last=False)
            log.warning("RDMA: more than %d connections; dropping the oldest (client %s)",
                        self.max_connections, cid.hex())
            c.close()
        log.debug("RDMA: QP %d connected to client %s QP %d", local.qpn, client_id.hex(),
                  remote.qpn)
        return {"qp": local.to_wire(), "addr": self.mr.addr, "rkey": self.mr.rkey,
                "size": self.pool_size}

    def drop(self, client_id: bytes) -> bool:
        """Destroy every QP of ``client_id`` now: its current one and those retired by
        a newer HELLO (still in their grace period). Returns whether it had any."""
        found = False
        c = self._conns.pop(client_id, None)
        if c is not None:
            c.close()
            found = True
        keep = []
        for deadline, cid, rc in self._retired:
            if cid == client_id:
                rc.close()
                found = True
            else:
                keep.append((deadline, cid, rc))
        self._retired = keep
        return found

    def reap(self, now: float | None = None) -> None:
        """Destroy replaced QPs whose grace period is over."""
        now = time.monotonic() if now is None else now
        keep = []
        for item in self._retired:
            if item[0] <= now:
                item[2].close()
            else:
                keep.append(item)
        self._retired = keep

    @property
    def connections(self) -> int:
        return len(self._conns)

    def stats(self) -> dict[str, Any]:
        return {"connections": len(self._conns), "retired": len(self._retired),
                "accepted": self.accepted, "refused": self.refused}

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Destroy every QP, deregister the pool, free CQ, PD and device. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for c in list(self._conns.values()):
            c.close()
        self._conns.clear()
        for _, _, c in self._retired:
            c.close()
        self._retired.clear()
        steps: list[tuple[str, Any]] = []
        if self.mr is not None:
            steps.append(("deregistering the pool", self.mr.close))
        steps += [("destroying the CQ", self.cq.close),
                  ("deallocating the PD", self.pd.close),
                  ("closing the device", self.port.close)]
        for what, fn in steps:
            try:
                fn()
            except Exception as exc:
                log.warning("RDMA teardown: %s failed: %s", what, exc)
        self.mr = None

    def __enter__(self) -> "ServerEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
