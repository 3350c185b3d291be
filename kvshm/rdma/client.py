"""The client's RDMA side: :class:`ClientLink` (device, protection domain, registered
buffers; lives as long as the client) and :class:`RdmaMover` (one RC connection to the
server's pool; one per HELLO), the one-sided mover of :mod:`kvshm.movers`.

A batch (``write``, ``read_into``, ``read_bytes``) is one list of RDMA WRITEs or READs:
caller buffers are looked up in (or registered into) the :class:`~kvshm.rdma.mr_cache.MrCache`,
:func:`~kvshm.rdma.wr.plan` makes the work requests, and :meth:`RdmaMover._execute` posts
them in runs that end with a signalled one, never more outstanding than the send queue
holds, polling the completion queue as it goes. A completion error raises
:class:`~kvshm.rdma.errors.CompletionError` naming the key and the cause; the connection
is then torn down and the session says HELLO again (with a new QP) on its next call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from kvshm._buffers import byte_view
from kvshm.errors import ServerUnavailable
from kvshm.rdma import constants as C
from kvshm.rdma.device import LocalPort, open_port
from kvshm.rdma.errors import CompletionError, DeviceError, RdmaError
from kvshm.rdma.memlock import available_bytes
from kvshm.rdma.mr_cache import MrCache
from kvshm.rdma.qp import (INIT_MASK, RTR_MASK, RTS_MASK, QpInfo, init_attrs, new_psn,
                           rtr_attrs, rts_attrs)
from kvshm.rdma.verbs import QpCaps
from kvshm.rdma.wr import Segment, WorkRequest, groups, opcode_name, plan

if TYPE_CHECKING:
    from kvshm.rdma.verbs import Backend, CompletionQueue, ProtectionDomain, QueuePair

__all__ = ["RdmaOptions", "ClientLink", "RdmaMover"]

log = logging.getLogger(__name__)


@dataclass
class RdmaOptions:
    """RDMA settings of a client (``Client(..., rdma=RdmaOptions(...))`` or a dict).

    Attributes
    ----------
    dev_name : str, optional
        Device (``mlx5_0``); None: the first device whose ``ib_port`` is active.
    ib_port : int
        Port number (1-based). Default 1.
    link_type : {"IB", "Ethernet"}, optional
        Expected link layer; checked against the port when given.
    gid_index : int, optional
        GID index; None: chosen from the GID table (see :mod:`kvshm.rdma.device`).
    max_send_wr : int
        Send queue depth asked for (capped by the device). Default 256.
    max_sge : int
        Scatter/gather entries per work request asked for (capped by the device).
    signal_every : int
        Signal every N-th work request (and the last of a batch). Default 16.
    max_outstanding : int, optional
        Work requests in flight at once; default and upper bound: the send queue depth.
    poll_timeout : float
        Seconds without any completion before a batch fails. Default 30.
    mr_cache_bytes : int, optional
        Bound on registered caller memory; default: what RLIMIT_MEMLOCK still allows
        (no bound when unlimited).
    backend : object, optional
        A verbs backend replacing pyverbs. For tests (the verbs double) only.
    """

    dev_name: str | None = None
    ib_port: int = 1
    link_type: str | None = None
    gid_index: int | None = None
    max_send_wr: int = 256
    max_sge: int = 16
    signal_every: int = 16
    max_outstanding: int | None = None
    poll_timeout: float = 30.0
    mr_cache_bytes: int | None = None
    backend: Any = None

    @classmethod
    def coerce(cls, value: Any) -> "RdmaOptions":
        """``RdmaOptions`` from None, a dict of its fields, or an RdmaOptions."""
        if value is None:
            opts = cls()
        elif isinstance(value, cls):
            opts = value
        elif isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise TypeError(f"unknown RDMA option(s): {', '.join(sorted(unknown))}")
            opts = cls(**value)
        else:
            raise TypeError(f"rdma must be a dict or RdmaOptions, got {type(value).__name__}")
        opts.validate()
        return opts

    def validate(self) -> None:
        if self.ib_port < 1:
            raise ValueError(f"ib_port must be >= 1, got {self.ib_port}")
        if self.gid_index is not None and self.gid_index < 0:
            raise ValueError(f"gid_index must be >= 0, got {self.gid_index}")
        for name in ("max_send_wr", "max_sge", "signal_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_outstanding is not None and self.max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1, got {self.max_outstanding}")
        if not self.poll_timeout > 0:
            raise ValueError(f"poll_timeout must be > 0, got {self.poll_timeout}")


class _Conn:
    """A client QP and its CQ."""

    def __init__(self, qp: "QueuePair", cq: "CompletionQueue", info: QpInfo) -> None:
        self.qp = qp
        self.cq = cq
        self.info = info
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for what, fn in (("QP", self.qp.close), ("CQ", self.cq.close)):
            try:
                fn()
            except Exception as exc:
                log.warning("destroying the client's %s failed: %s", what, exc)


class ClientLink:
    """A client's RDMA resources that outlive connections: device, PD, registered buffers.

    The session calls :meth:`prepare` to build the ``rdma`` part of a HELLO (a new QP),
    then :meth:`connect` with the server's answer, which returns an :class:`RdmaMover`.

    Parameters
    ----------
    options : RdmaOptions
    on_broken : callable
        Called (from a copying thread) when a connection broke, so the session says
        HELLO again on its next call.
    """

    def __init__(self, options: RdmaOptions, on_broken: Callable[[], None]) -> None:
        self.options = options
        self.on_broken = on_broken
        self.port: LocalPort | None = None
        self.pd: "ProtectionDomain | None" = None
        self.cache: MrCache | None = None
        self.pending: _Conn | None = None
        self.scratch: np.ndarray | None = None   # RdmaMover.read_bytes reads into it
        self.lock = threading.Lock()      # one batch at a time over all of its movers
        self.failed: str | None = None    # transport="auto": why RDMA is not used
        self.wanted = False               # transport="auto": the server offers RDMA
        self._again = False
        self._closed = False

    # ------------------------------------------------------------------ device

    def open(self) -> LocalPort:
        """Open the device (once). Raises DeviceError naming the device and the cause."""
        if self._closed:
            raise RdmaError("the client's RDMA link is closed")
        if self.port is None:
            o = self.options
            backend: "Backend"
            if o.backend is not None:
                backend = o.backend
            else:
                from kvshm.rdma.verbs import PyverbsBackend

                try:
                    backend = PyverbsBackend()
                except DeviceError as exc:
                    raise exc.naming(o.dev_name) from None
            port = open_port(backend, o.dev_name, o.ib_port, link_type=o.link_type,
                             gid_index=o.gid_index)
            try:
                pd = port.ctx.alloc_pd()
            except BaseException:
                port.close()
                raise
            limit = o.mr_cache_bytes
            if limit is None and backend.pins_memory:
                limit = available_bytes()
            self.port, self.pd = port, pd
            self.cache = MrCache(pd, access=C.ACCESS_LOCAL_WRITE, max_bytes=limit)
            log.debug("RDMA client on %s", port.describe())
        return self.port

    # ------------------------------------------------------------------ HELLO

    def prepare(self) -> dict[str, Any]:
        """A new QP (in RESET) for the HELLO being sent: the ``rdma`` body field."""
        port = self.open()
        assert self.pd is not None
        self.drop_pending()
        caps = port.caps
        send_wr = max(1, min(self.options.max_send_wr, caps.max_qp_wr or 1))
        sge = max(1, min(self.options.max_sge, caps.max_sge or 1))
        cq = port.ctx.create_cq(max(send_wr + 1, 16))
        try:
            qp = self.pd.create_qp(cq, QpCaps(max_send_wr=send_wr, max_send_sge=sge))
        except BaseException:
            cq.close()
            raise
        info = QpInfo(qpn=qp.qpn, psn=new_psn(), lid=port.port.lid, gid=port.gid.gid,
                      mtu=port.port.active_mtu, link_layer=port.link_layer,
                      rd_atomic=max(1, min(caps.max_qp_init_rd_atom, 16)))
        self.pending = _Conn(qp, cq, info)
        return {"qp": info.to_wire()}

    def drop_pending(self) -> None:
        if self.pending is not None:
            p, self.pending = self.pending, None
            p.close()

    def connect(self, reply: Any, peer: str) -> "RdmaMover":
        """Connect the pending QP to the server's (``reply`` = the HELLO reply's ``rdma``).

        Raises
        ------
        RdmaError
            The server does not serve RDMA, refused, or a transition failed.
        """
        conn, self.pending = self.pending, None
        if conn is None:
            raise RdmaError("no RDMA QP was offered in this HELLO")
        port = self.port
        assert port is not None
        try:
            if not isinstance(reply, dict) or not reply.get("offer"):
                raise RdmaError(f"the kvshm server at {peer} does not serve RDMA (start it "
                                "with --dev-name)")
            if "error" in reply:
                raise RdmaError(f"the kvshm server at {peer} refused the RDMA connection: "
                                f"{reply['error']}")
            try:
                remote = QpInfo.from_wire(reply.get("qp"))
                addr, rkey, size = (reply.get(k) for k in ("addr", "rkey", "size"))
                if not all(type(v) is int and v >= 0 for v in (addr, rkey, size)):
                    raise ValueError(f"bad pool address/rkey/size {addr!r}/{rkey!r}/{size!r}")
                remote_pool = (int(addr), int(rkey), int(size))   # type: ignore[arg-type]
                rtr = rtr_attrs(conn.info, remote, port_num=port.port_num,
                                sgid_index=port.gid.index, responder_depth=1,
                                force_grh=(self.options.gid_index is not None and
                                           port.link_layer == "IB"))
            except ValueError as exc:
                raise RdmaError(f"RDMA connection to {peer}: {exc}") from None
            initiator = max(1, min(conn.info.rd_atomic, remote.rd_atomic))
            conn.qp.modify(init_attrs(port_num=port.port_num, access=0), INIT_MASK)
            conn.qp.modify(rtr, RTR_MASK)
            conn.qp.modify(rts_attrs(conn.info, initiator_depth=initiator), RTS_MASK)
        except BaseException:
            conn.close()
            raise
        log.debug("RDMA: QP %d connected to %s QP %d", conn.info.qpn, peer, remote.qpn)
        return RdmaMover(self, conn, remote, *remote_pool, peer=peer)

    # ------------------------------------------------------------------ auto

    def give_up(self, exc: BaseException) -> None:
        """transport="auto": stop trying RDMA for this client (logged once)."""
        self.drop_pending()
        if self.failed is None:
            log.info("RDMA not used (%s); falling back to TCP", exc)
        self.failed = str(exc)
        self.wanted = False

    def want(self) -> None:
        """transport="auto": the server offers RDMA and this host has a device."""
        if self.failed is None and not self.wanted:
            self.wanted = True
            self._again = True

    def take_hello_again(self) -> bool:
        """True once after :meth:`want`: the client should say HELLO again, with a QP."""
        again, self._again = self._again, False
        return again and self.wanted

    def close(self) -> None:
        """Free the pending QP, the registered buffers, the PD and the device."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self.drop_pending()
            if self.cache is not None:
                self.cache.close()
            self.scratch = None
            for what, fn in (("PD", self.pd.close if self.pd else None),
                             ("device", self.port.close if self.port else None)):
                if fn is not None:
                    try:
                        fn()
                    except Exception as exc:
                        log.warning("closing the client's RDMA %s failed: %s", what, exc)
            self.pd = None
            self.port = None


class RdmaMover:
    """One-sided mover over one RC connection to the server's pool.

    Implements :class:`kvshm.movers.OneSidedMover`. Batches of all movers of one
    :class:`ClientLink` run one at a time (the NIC is the bottleneck; the completion queue
    and the registration cache are not shared between threads).
    """

    name = "rdma"

    def __init__(self, link: ClientLink, conn: _Conn, remote: QpInfo, pool_addr: int,
                 rkey: int, pool_size: int, *, peer: str) -> None:
        self.link = link
        self.conn = conn
        self.remote = remote
        self.pool_addr = pool_addr
        self.rkey = rkey
        self.pool_size = pool_size
        self.peer = peer
        port = link.port
        assert port is not None and link.cache is not None
        self.cache = link.cache
        o = link.options
        caps = conn.qp.caps
        self.window = max(1, min(o.max_outstanding or caps.max_send_wr, caps.max_send_wr))
        self.signal_every = max(1, min(o.signal_every, self.window))
        self.max_sge_write = max(1, min(caps.max_send_sge, port.caps.max_sge or 1))
        self.max_sge_read = max(1, min(caps.max_send_sge, port.caps.max_sge_rd or 1))
        self.max_msg = port.port.max_msg_sz or (1 << 30)
        self.poll_timeout = o.poll_timeout
        self.broken: str | None = None
        self.closed = False
        self._gen = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.work_requests = 0

    # ------------------------------------------------------------------ protocol

    def write(self, offsets: Sequence[int], values: Sequence[Any],
              keys: Sequence[bytes]) -> None:
        views = [v if isinstance(v, memoryview) and v.format == "B" and v.ndim == 1
                 else byte_view(v) for v in values]
        self._batch(C.WR_RDMA_WRITE, offsets, [v.nbytes for v in views], views, keys)

    def read_into(self, offsets: Sequence[int], sizes: Sequence[int], outs: Sequence[Any],
                  keys: Sequence[bytes]) -> None:
        views = []
        for k, o, s in zip(keys, outs, sizes):
            v = o if isinstance(o, memoryview) and o.format == "B" and o.ndim == 1 \
                else byte_view(o, writable=True, what=f"output for key {k!r}")
            if v.readonly:
                raise TypeError(f"output for key {k!r} must be writable")
            if v.nbytes < s:
                raise ValueError(f"output buffer for key {k!r} holds {v.nbytes} bytes; "
                                 f"the value is {s} bytes")
            views.append(v[:s])
        self._batch(C.WR_RDMA_READ, offsets, list(sizes), views, keys)

    def read_bytes(self, offsets: Sequence[int], sizes: Sequence[int],
                   keys: Sequence[bytes]) -> list[bytes]:
        with self.link.lock:
            total = sum(sizes)
            scratch = self.link.scratch   # one registered scratch buffer per client
            if scratch is None or scratch.nbytes < total:
                if scratch is not None:
                    self.cache.forget(scratch)
                scratch = self.link.scratch = np.empty(max(total, 1 << 20), dtype=np.uint8)
            mv = memoryview(scratch)  # type: ignore[arg-type]
            views = []
            pos = 0
            for s in sizes:
                views.append(mv[pos:pos + s])
                pos += s
            self._batch_locked(C.WR_RDMA_READ, offsets, list(sizes), views, keys)
            return [bytes(v) for v in views]

    def close(self) -> None:
        """Tear the connection down (after the batch in flight). Idempotent."""
        with self.link.lock:
            self.closed = True
            self.conn.close()

    # ------------------------------------------------------------------ batches

    def _batch(self, opcode: int, offsets: Sequence[int], sizes: Sequence[int],
               views: Sequence[memoryview], keys: Sequence[bytes]) -> None:
        with self.link.lock:
            self._batch_locked(opcode, offsets, sizes, views, keys)

    def _batch_locked(self, opcode: int, offsets: Sequence[int], sizes: Sequence[int],
                      views: Sequence[memoryview], keys: Sequence[bytes]) -> None:
        if self.closed:
            raise ServerUnavailable(f"the RDMA connection to {self.peer} was replaced; "
                                    "retry")
        if self.broken is not None:
            raise RdmaError(f"the RDMA connection to {self.peer} is broken ({self.broken}); "
                            "it is re-established on the next call")
        if not len(offsets) == len(sizes) == len(views) == len(keys):
            raise ValueError("offsets, sizes, buffers and keys differ in length")
        self.cache.next_batch()
        segs = []
        for i, (off, n, v) in enumerate(zip(offsets, sizes, views)):
            if n < 0:
                raise ValueError(f"negative size {n} for key {keys[i]!r}")
            if off < 0 or off > self.pool_size or n > self.pool_size - off:
                raise IndexError(f"range [{off}, {off + n}) of key {keys[i]!r} is outside "
                                 f"the pool of {self.pool_size} bytes")
            if n == 0:
                continue
            addr, lkey = self.cache.lookup(v[:n])
            segs.append(Segment(addr, lkey, n, self.pool_addr + off, i))
        if not segs:
            return
        self._gen = (self._gen + 1) & 0xFFFFFFFF
        max_sge = self.max_sge_read if opcode == C.WR_RDMA_READ else self.max_sge_write
        wrs = plan(segs, opcode=opcode, rkey=self.rkey, max_sge=max_sge,
                   max_msg=self.max_msg, signal_every=self.signal_every,
                   wr_id_base=self._gen << 32)
        try:
            self._execute(wrs, keys)
        except RdmaError as exc:   # CompletionError, PostError, a poll timeout
            self._break(exc)
            raise
        n = sum(s.length for s in segs)
        if opcode == C.WR_RDMA_WRITE:
            self.bytes_written += n
        else:
            self.bytes_read += n
        self.work_requests += len(wrs)

    def _execute(self, wrs: list[WorkRequest], keys: Sequence[bytes]) -> None:
        """Post ``wrs`` run by run within the window; poll until the last completes."""
        qp, cq = self.conn.qp, self.conn.cq
        runs = groups(wrs)
        base = wrs[0].wr_id
        pending: deque[tuple[int, int]] = deque()   # (index of a run's last wr, its size)
        inflight = 0
        r = 0
        idle_since = time.monotonic()
        spins = 0
        while r < len(runs) or pending:
            while r < len(runs):
                start, stop = runs[r]
                if inflight + (stop - start) > self.window:
                    break
                qp.post_send(wrs[start:stop])
                inflight += stop - start
                pending.append((stop - 1, stop - start))
                r += 1
            wcs = cq.poll(16)
            if not wcs:
                spins += 1
                if spins > 64:
                    now = time.monotonic()
                    if now - idle_since > self.poll_timeout:
                        raise RdmaError(f"no RDMA completion from {self.peer} within "
                                        f"{self.poll_timeout:g} s ({inflight} work requests "
                                        "outstanding)")
                    time.sleep(0 if spins < 256 else 50e-6)
                continue
            spins = 0
            idle_since = time.monotonic()
            for wc in wcs:
                i = wc.wr_id - base
                if wc.status != C.WC_SUCCESS:
                    wr = wrs[i] if 0 <= i < len(wrs) else None
                    op = opcode_name(wr.opcode if wr else wrs[0].opcode)
                    ks = [keys[j] for j in wr.items] if wr else []
                    raise CompletionError(op=op, keys=ks, status=wc.status, peer=self.peer,
                                          vendor_err=wc.vendor_err)
                if not 0 <= i < len(wrs):
                    continue   # not of this batch (cannot happen: one CQ per QP, drained)
                while pending and pending[0][0] <= i:
                    inflight -= pending.popleft()[1]

    def _break(self, exc: BaseException) -> None:
        """Tear the connection down after an error; the session reconnects next call."""
        if self.broken is None:
            self.broken = getattr(exc, "status_name", None) or str(exc)
            log.warning("RDMA connection to %s broken: %s", self.peer, exc)
            self.conn.close()
            try:
                self.link.on_broken()
            except Exception:   # pragma: no cover - a callback bug must not hide exc
                log.exception("on_broken callback failed")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self.broken else "connected"
        return (f"<RdmaMover {self.peer} QP {self.conn.info.qpn}->{self.remote.qpn} "
                f"{state}>")
