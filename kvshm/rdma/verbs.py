"""The verbs backend: the one module that touches pyverbs.

The rest of :mod:`kvshm.rdma` talks to a :class:`Backend` (device contexts, protection
domains, memory regions, completion queues, RC queue pairs) with plain data in and out
(:class:`~kvshm.rdma.wr.WorkRequest`, :class:`~kvshm.rdma.qp.QpAttrs`,
:class:`Completion`, :class:`~kvshm.rdma.device.GidEntry`). :class:`PyverbsBackend` is the
real one; the functions ``send_wrs``, ``qp_attr``, ``completion_of``, ``gid_entry_of``,
``port_info_of`` and ``device_caps_of`` map between that plain data and pyverbs objects
(they need no device, so the tests check them with real pyverbs objects).

A replacement backend (the tests' verbs double) is passed explicitly by a caller, as the
``backend`` argument of :class:`~kvshm.rdma.RdmaOptions` or of ``kvshm.Server``; nothing
reads one from the environment, so ``kvshm serve`` always uses pyverbs.

pyverbs is imported lazily, on first use. When the plain ``import pyverbs`` fails (a
virtual environment does not see the distribution's packages), :func:`load_pyverbs` loads
the distribution's package (Debian/Ubuntu ``python3-pyverbs`` in
``/usr/lib/python3/dist-packages``, Fedora/RHEL in ``/usr/lib64/python3.X/site-packages``)
by its path, exposing only the ``pyverbs`` package and nothing else of that directory.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import ipaddress
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol, Sequence

from kvshm.rdma import constants as C
from kvshm.rdma.ports import DeviceCaps, GidEntry, PortInfo, no_device_cause
from kvshm.rdma.errors import DeviceError, PostError, RdmaError
from kvshm.rdma.qp import QpAttrs
from kvshm.rdma.wr import WorkRequest

__all__ = ["Backend", "Context", "ProtectionDomain", "MemoryRegion", "CompletionQueue",
           "QueuePair", "QpCaps", "Completion", "PyverbsBackend", "load_pyverbs",
           "pyverbs_search_dirs", "sge_list", "send_wrs", "qp_attr", "qp_init_attr",
           "completion_of", "gid_entry_of", "port_info_of", "device_caps_of"]

log = logging.getLogger(__name__)

_SUBMODULES = ("pyverbs_error", "enums", "device", "pd", "mr", "cq", "qp", "wr", "addr")


# ----------------------------------------------------------------------------- interface


@dataclass(frozen=True)
class QpCaps:
    """Queue sizes of a QP (asked for at creation; the created QP reports what it got)."""

    max_send_wr: int
    max_send_sge: int
    max_recv_wr: int = 1
    max_recv_sge: int = 1


@dataclass(frozen=True)
class Completion:
    """One work completion: the ``wr_id`` it completes, ``ibv_wc_status``, opcode."""

    wr_id: int
    status: int
    opcode: int = 0
    vendor_err: int = 0


class MemoryRegion(Protocol):
    addr: int
    length: int
    lkey: int
    rkey: int

    def close(self) -> None: ...


class CompletionQueue(Protocol):
    def poll(self, n: int) -> list[Completion]:
        """Up to ``n`` completions; an empty list when none is ready (never blocks)."""

    def close(self) -> None: ...


class QueuePair(Protocol):
    qpn: int
    caps: QpCaps

    def modify(self, attrs: QpAttrs, mask: int) -> None: ...

    def post_send(self, wrs: Sequence[WorkRequest]) -> None:
        """Post ``wrs`` (one chain, in order). Raises PostError."""

    def close(self) -> None: ...


class ProtectionDomain(Protocol):
    def reg_mr(self, addr: int, length: int, access: int) -> MemoryRegion: ...

    def create_qp(self, cq: CompletionQueue, caps: QpCaps) -> QueuePair: ...

    def close(self) -> None: ...


class Context(Protocol):
    name: str

    def caps(self) -> DeviceCaps: ...

    def port(self, port_num: int) -> PortInfo: ...

    def gid_table(self, port_num: int) -> list[GidEntry]: ...

    def alloc_pd(self) -> ProtectionDomain: ...

    def create_cq(self, cqe: int) -> CompletionQueue: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """What :mod:`kvshm.rdma` needs of a verbs implementation."""

    name: str
    #: True when registering memory pins it (RLIMIT_MEMLOCK applies).
    pins_memory: bool

    def device_names(self) -> list[str]:
        """Names of the RDMA devices. Raises DeviceError when they cannot be listed."""

    def open(self, name: str) -> Context: ...


# ----------------------------------------------------------------------------- loading

_load_lock = threading.Lock()
_pv: SimpleNamespace | None = None


def pyverbs_search_dirs() -> list[str]:
    """Directories searched for a distribution's ``pyverbs`` package."""
    v = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [f"/usr/lib/python{sys.version_info.major}/dist-packages",
            f"/usr/lib64/{v}/site-packages", f"/usr/lib/{v}/site-packages",
            f"/usr/local/lib/{v}/dist-packages", f"/usr/lib/{v}/dist-packages"]


def _forget_pyverbs() -> None:
    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        del sys.modules[name]


def _load_from(directory: str) -> None:
    pkg = os.path.join(directory, "pyverbs")
    spec = importlib.util.spec_from_file_location(
        "pyverbs", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {pkg}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        _forget_pyverbs()
        raise


def _abi_note(directory: str) -> str:
    pkg = os.path.join(directory, "pyverbs")
    try:
        sos = sorted(n for n in os.listdir(pkg) if n.startswith("device.") and
                     n.endswith(".so"))
    except OSError:
        return ""
    ours = importlib.machinery.EXTENSION_SUFFIXES
    if sos and not any(n.endswith(s) for n in sos for s in ours):
        return (f"; {pkg} is built for another Python ({', '.join(sos)}), this is "
                f"{sys.version_info.major}.{sys.version_info.minor}")
    return ""


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs modules kvshm uses, as a namespace (``device``, ``pd``, ``mr``, ``cq``,
    ``qp``, ``wr``, ``addr``, ``enums``, ``pyverbs_error``).

    Raises
    ------
    DeviceError
        pyverbs is not importable; the message says what to install.
    """
    global _pv
    with _load_lock:
        if _pv is not None:
            return _pv
        errors = []
        try:
            importlib.import_module("pyverbs")
        except ImportError as exc:
            errors.append(f"import pyverbs: {exc}")
            _forget_pyverbs()
            for d in pyverbs_search_dirs():
                if not os.path.isfile(os.path.join(d, "pyverbs", "__init__.py")):
                    continue
                try:
                    _load_from(d)
                    for sub in _SUBMODULES:
                        importlib.import_module(f"pyverbs.{sub}")
                except ImportError as exc2:
                    _forget_pyverbs()
                    errors.append(f"{d}/pyverbs: {exc2}{_abi_note(d)}")
                    continue
                log.debug("pyverbs loaded from %s", d)
                break
        try:
            mods = {sub: importlib.import_module(f"pyverbs.{sub}") for sub in _SUBMODULES}
        except ImportError as exc:
            _forget_pyverbs()
            errors.append(str(exc))
            raise DeviceError(None, "pyverbs is not importable (" + "; ".join(errors) +
                              "): install rdma-core's Python bindings built for this "
                              "Python (Debian/Ubuntu: apt-get install python3-pyverbs; "
                              "Fedora/RHEL: dnf install python3-pyverbs)") from None
        _pv = SimpleNamespace(**mods)
        return _pv


# ----------------------------------------------------------------------------- mapping

_GID_TYPES = {C.GID_TYPE_IB: "IB", C.GID_TYPE_ROCE_V1: "RoCEv1", C.GID_TYPE_ROCE_V2: "RoCEv2"}


def _gid_bytes(text: str) -> bytes:
    return ipaddress.IPv6Address(text).packed


def _gid_string(gid: bytes) -> str:
    return ipaddress.IPv6Address(bytes(gid)).exploded


def sge_list(pv: SimpleNamespace, w: WorkRequest) -> list[Any]:
    """``pyverbs.wr.SGE`` objects of one work request."""
    return [pv.wr.SGE(s.addr, s.length, s.lkey) for s in w.sges]


def send_wrs(pv: SimpleNamespace, wrs: Sequence[WorkRequest]) -> list[Any]:
    """``pyverbs.wr.SendWR`` objects for ``wrs``, chained with ``next_wr`` in order.

    Keep the returned list alive until ``post_send`` returned: each link of the chain
    points into the next object (SendWR copies its SGEs, so they need not be kept).
    """
    out: list[Any] = []
    for w in wrs:
        sges = sge_list(pv, w)
        swr = pv.wr.SendWR(wr_id=w.wr_id, opcode=w.opcode, num_sge=len(sges), sg=sges,
                           send_flags=C.SEND_SIGNALED if w.signaled else 0)
        swr.set_wr_rdma(w.rkey, w.remote_addr)
        out.append(swr)
    for a, b in zip(out, out[1:]):
        a.next_wr = b
    return out


def qp_attr(pv: SimpleNamespace, a: QpAttrs) -> Any:
    """A ``pyverbs.qp.QPAttr`` holding ``a``."""
    qa = pv.qp.QPAttr(qp_state=a.qp_state, cur_qp_state=C.QPS_RESET, port_num=a.port_num,
                      path_mtu=a.path_mtu or C.mtu_enum(1024))
    qa.pkey_index = a.pkey_index
    qa.qp_access_flags = a.qp_access_flags
    qa.dest_qp_num = a.dest_qp_num
    qa.rq_psn = a.rq_psn
    qa.max_dest_rd_atomic = a.max_dest_rd_atomic
    qa.min_rnr_timer = a.min_rnr_timer
    qa.timeout = a.timeout
    qa.retry_cnt = a.retry_cnt
    qa.rnr_retry = a.rnr_retry
    qa.sq_psn = a.sq_psn
    qa.max_rd_atomic = a.max_rd_atomic
    gr = None
    if a.ah_is_global:
        gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(_gid_string(a.ah_dgid)),
                                 sgid_index=a.ah_sgid_index, hop_limit=a.ah_hop_limit,
                                 traffic_class=a.ah_traffic_class,
                                 flow_label=a.ah_flow_label)
    qa.ah_attr = pv.addr.AHAttr(dlid=a.ah_dlid, sl=a.ah_sl, src_path_bits=a.ah_src_path_bits,
                                is_global=a.ah_is_global, port_num=a.ah_port_num, gr=gr)
    return qa


def qp_init_attr(pv: SimpleNamespace, caps: QpCaps, cq: Any = None) -> Any:
    """A ``pyverbs.qp.QPInitAttr`` for an RC QP: ``caps``, send and receive completions on
    ``cq`` (a ``pyverbs.cq.CQ``), only signalled work requests complete."""
    cap = pv.qp.QPCap(max_send_wr=caps.max_send_wr, max_recv_wr=caps.max_recv_wr,
                      max_send_sge=caps.max_send_sge, max_recv_sge=caps.max_recv_sge)
    return pv.qp.QPInitAttr(qp_type=C.QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def completion_of(wc: Any) -> Completion:
    """A :class:`Completion` of a ``pyverbs.cq.WC``."""
    return Completion(int(wc.wr_id), int(wc.status), int(wc.opcode), int(wc.vendor_err))


def _netdev(ifindex: int) -> str:
    if not ifindex:
        return ""
    try:
        return socket.if_indextoname(ifindex)
    except OSError:
        return ""


def gid_entry_of(entry: Any) -> GidEntry:
    """A :class:`GidEntry` of a ``pyverbs.device.GIDEntry`` (``ibv_query_gid_table``)."""
    return GidEntry(index=int(entry.gid_index), gid=_gid_bytes(entry.gid_str()),
                    gid_type=_GID_TYPES.get(int(entry.gid_type), f"type{entry.gid_type}"),
                    ifindex=int(entry.ndev_ifindex), netdev=_netdev(int(entry.ndev_ifindex)))


def port_info_of(attr: Any) -> PortInfo:
    """A :class:`PortInfo` of a ``pyverbs.device.PortAttr``."""
    ll = int(attr.link_layer)
    return PortInfo(state=int(attr.state), lid=int(attr.lid),
                    link_layer="Ethernet" if ll == C.LINK_LAYER_ETHERNET else "IB",
                    active_mtu=C.mtu_bytes(int(attr.active_mtu)),
                    max_msg_sz=int(attr.max_msg_sz), gid_tbl_len=int(attr.gid_tbl_len))


def device_caps_of(attr: Any) -> DeviceCaps:
    """A :class:`DeviceCaps` of a ``pyverbs.device.DeviceAttr``."""
    return DeviceCaps(max_qp_wr=int(attr.max_qp_wr), max_sge=int(attr.max_sge),
                      max_sge_rd=int(attr.max_sge_rd) or int(attr.max_sge),
                      max_qp_rd_atom=int(attr.max_qp_rd_atom),
                      max_qp_init_rd_atom=int(attr.max_qp_init_rd_atom),
                      max_cqe=int(attr.max_cqe), max_mr_size=int(attr.max_mr_size),
                      phys_port_cnt=int(attr.phys_port_cnt))


# ----------------------------------------------------------------------------- pyverbs


class _PvMR:
    def __init__(self, mr: Any, addr: int, length: int) -> None:
        self._mr = mr
        self.addr = addr
        self.length = length
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)

    def close(self) -> None:
        if self._mr is not None:
            mr, self._mr = self._mr, None
            mr.close()


class _PvCQ:
    def __init__(self, cq: Any) -> None:
        self.cq = cq

    def poll(self, n: int) -> list[Completion]:
        _, wcs = self.cq.poll(n)
        return [completion_of(w) for w in wcs]

    def close(self) -> None:
        self.cq.close()


class _PvQP:
    def __init__(self, pv: SimpleNamespace, qp: Any, caps: QpCaps) -> None:
        self._pv = pv
        self.qp = qp
        self.qpn = int(qp.qp_num)
        self.caps = caps

    def modify(self, attrs: QpAttrs, mask: int) -> None:
        try:
            self.qp.modify(qp_attr(self._pv, attrs), mask)
        except self._pv.pyverbs_error.PyverbsError as exc:
            state = {C.QPS_INIT: "INIT", C.QPS_RTR: "RTR", C.QPS_RTS: "RTS"}.get(
                attrs.qp_state, str(attrs.qp_state))
            raise RdmaError(f"moving QP {self.qpn} to {state} failed: {exc}") from None

    def post_send(self, wrs: Sequence[WorkRequest]) -> None:
        chain = send_wrs(self._pv, wrs)   # alive until post_send returned
        try:
            self.qp.post_send(chain[0])
        except self._pv.pyverbs_error.PyverbsError as exc:
            raise PostError(f"ibv_post_send of {len(wrs)} work requests on QP {self.qpn} "
                            f"failed: {exc}") from None

    def close(self) -> None:
        self.qp.close()


class _PvPD:
    def __init__(self, pv: SimpleNamespace, pd: Any, device: str) -> None:
        self._pv = pv
        self.pd = pd
        self.device = device

    def reg_mr(self, addr: int, length: int, access: int) -> MemoryRegion:
        try:
            mr = self._pv.mr.MR(self.pd, length, access, address=addr)
        except self._pv.pyverbs_error.PyverbsError as exc:
            hint = ""
            if "Errno: 12" in str(exc) or "Errno: 1," in str(exc):
                hint = (" (pinning memory past RLIMIT_MEMLOCK fails this way: raise it, "
                        "see docs/RDMA.md)")
            raise RdmaError(f"registering {length} bytes at 0x{addr:x} with {self.device} "
                            f"failed: {exc}{hint}") from None
        return _PvMR(mr, addr, length)

    def create_qp(self, cq: CompletionQueue, caps: QpCaps) -> QueuePair:
        pv = self._pv
        assert isinstance(cq, _PvCQ)
        init = qp_init_attr(pv, caps, cq.cq)
        try:
            qp = pv.qp.QP(self.pd, init)
        except pv.pyverbs_error.PyverbsError as exc:
            raise RdmaError(f"creating an RC QP on {self.device} ({caps}) failed: {exc}"
                            ) from None
        got = init.cap   # ibv_create_qp writes the sizes it granted back into the attr
        return _PvQP(pv, qp, QpCaps(int(got.max_send_wr), int(got.max_send_sge),
                                    int(got.max_recv_wr), int(got.max_recv_sge)))

    def close(self) -> None:
        self.pd.close()


class _PvContext:
    def __init__(self, pv: SimpleNamespace, ctx: Any, name: str) -> None:
        self._pv = pv
        self.ctx = ctx
        self.name = name
        self._caps: DeviceCaps | None = None

    def _err(self, what: str, exc: BaseException) -> DeviceError:
        return DeviceError(self.name, f"{what} failed: {exc}")

    def caps(self) -> DeviceCaps:
        if self._caps is None:
            try:
                self._caps = device_caps_of(self.ctx.query_device())
            except self._pv.pyverbs_error.PyverbsError as exc:
                raise self._err("ibv_query_device", exc) from None
        return self._caps

    def port(self, port_num: int) -> PortInfo:
        try:
            return port_info_of(self.ctx.query_port(port_num))
        except self._pv.pyverbs_error.PyverbsError as exc:
            raise self._err(f"ibv_query_port({port_num})", exc) from None

    def gid_table(self, port_num: int) -> list[GidEntry]:
        pv = self._pv
        try:
            total = sum(self.port(p).gid_tbl_len
                        for p in range(1, self.caps().phys_port_cnt + 1))
            entries = self.ctx.query_gid_table(max(total, 1))
            return [gid_entry_of(e) for e in entries if int(e.port_num) == port_num]
        except (pv.pyverbs_error.PyverbsError, AttributeError) as exc:
            log.debug("ibv_query_gid_table failed (%s); reading GIDs one by one", exc)
        port = self.port(port_num)
        out = []
        for i in range(port.gid_tbl_len):
            try:
                gid = _gid_bytes(self.ctx.query_gid(port_num, i).gid)
            except pv.pyverbs_error.PyverbsError:
                continue
            if not any(gid):
                continue
            kind = "IB"
            if port.link_layer == "Ethernet":
                try:
                    t = self.ctx.query_gid_type(port_num, i)
                except pv.pyverbs_error.PyverbsError:
                    continue
                kind = "RoCEv2" if t == C.GID_TYPE_SYSFS_ROCE_V2 else "RoCEv1"
            netdev = ""
            try:
                with open(f"/sys/class/infiniband/{self.name}/ports/{port_num}/gid_attrs/"
                          f"ndevs/{i}") as f:
                    netdev = f.read().strip()
            except OSError:
                pass
            out.append(GidEntry(i, gid, kind, 0, netdev))
        return out

    def alloc_pd(self) -> ProtectionDomain:
        try:
            return _PvPD(self._pv, self._pv.pd.PD(self.ctx), self.name)
        except self._pv.pyverbs_error.PyverbsError as exc:
            raise self._err("ibv_alloc_pd", exc) from None

    def create_cq(self, cqe: int) -> CompletionQueue:
        try:
            return _PvCQ(self._pv.cq.CQ(self.ctx, cqe, None, None, 0))
        except self._pv.pyverbs_error.PyverbsError as exc:
            raise self._err(f"ibv_create_cq({cqe})", exc) from None

    def close(self) -> None:
        self.ctx.close()


class PyverbsBackend:
    """Verbs through rdma-core's pyverbs (the backend of ``kvshm serve`` and clients).

    Raises
    ------
    DeviceError
        At construction, when pyverbs cannot be imported.
    """

    name = "pyverbs"
    pins_memory = True

    def __init__(self) -> None:
        self.pv = load_pyverbs()

    def device_names(self) -> list[str]:
        try:
            devs = self.pv.device.get_device_list()
        except self.pv.pyverbs_error.PyverbsError as exc:
            raise DeviceError(None, no_device_cause(exc)) from None
        names = []
        for d in devs:
            n = d.name
            names.append(n.decode() if isinstance(n, bytes) else str(n))
        return names

    def open(self, name: str) -> Context:
        try:
            ctx = self.pv.device.Context(name=name)
        except self.pv.pyverbs_error.PyverbsError as exc:
            raise DeviceError(name, f"cannot be opened: {exc}") from None
        return _PvContext(self.pv, ctx, name)
