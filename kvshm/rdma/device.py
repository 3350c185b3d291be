"""Opening an RDMA device and port, and choosing the GID to address it by.

:func:`select_gid` is a pure function over the port's GID table (a list of
:class:`GidEntry`, whatever backend read it), so the choice is tested without a device:

* ``--gid-index`` given: that entry, whatever its type (checked to exist).
* InfiniBand: the first entry of type IB (index 0, the port GID, on every HCA).
* Ethernet (RoCE): a RoCEv2 entry whose GID is an IPv4-mapped address (``::ffff:a.b.c.d``,
  the GID the kernel makes for each IPv4 address of the port's netdev); the one of
  ``prefer_ipv4`` when given, else the lowest index. The GID type is read from the table,
  never assumed from the index (which GID index is RoCEv2 differs between hosts).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvshm.rdma.constants import PORT_ACTIVE, PORT_STATES
from kvshm.rdma.errors import DeviceError

if TYPE_CHECKING:
    from kvshm.rdma.verbs import Backend, Context

__all__ = ["GidEntry", "PortInfo", "DeviceCaps", "LocalPort", "LINK_TYPES",
           "normalize_link_type", "select_gid", "describe_gid_table", "gid_text",
           "no_device_cause", "open_port"]

#: Spellings accepted for ``--link-type``; values are the two link layers.
LINK_TYPES = {"ib": "IB", "infiniband": "IB", "ethernet": "Ethernet", "eth": "Ethernet",
              "roce": "Ethernet"}

_V4_PREFIX = bytes(10) + b"\xff\xff"


def normalize_link_type(value: str | None) -> str | None:
    """``"IB"``, ``"Ethernet"`` or None; raises ValueError for anything else."""
    if value is None:
        return None
    try:
        return LINK_TYPES[value.strip().lower()]
    except KeyError:
        raise ValueError(f"link type must be IB or Ethernet, got {value!r}") from None


def gid_text(gid: bytes) -> str:
    """A GID as text: ``fe80::1``, ``::ffff:10.0.0.1``."""
    gid = bytes(gid)
    if gid[:12] == _V4_PREFIX:
        return f"::ffff:{ipaddress.IPv4Address(gid[12:])}"
    return str(ipaddress.IPv6Address(gid))


@dataclass(frozen=True)
class GidEntry:
    """One valid entry of a port's GID table.

    Attributes
    ----------
    index : int
        GID index (the ``sgid_index`` of an address vector).
    gid : bytes
        The 16-byte GID.
    gid_type : str
        ``"IB"``, ``"RoCEv1"`` or ``"RoCEv2"``.
    ifindex : int
        Interface index of the netdev the GID belongs to (RoCE; 0 for IB).
    netdev : str
        Its name, when known.
    """

    index: int
    gid: bytes
    gid_type: str
    ifindex: int = 0
    netdev: str = ""

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID, else None."""
        if len(self.gid) == 16 and self.gid[:12] == _V4_PREFIX:
            return str(ipaddress.IPv4Address(self.gid[12:]))
        return None

    @property
    def is_zero(self) -> bool:
        return not any(self.gid)

    def __str__(self) -> str:
        dev = f" {self.netdev}" if self.netdev else ""
        return f"{self.index}: {gid_text(self.gid)} {self.gid_type}{dev}"


@dataclass(frozen=True)
class PortInfo:
    """What kvshm needs of ``ibv_query_port``; ``active_mtu`` in bytes."""

    state: int
    lid: int
    link_layer: str
    active_mtu: int
    max_msg_sz: int
    gid_tbl_len: int

    @property
    def state_name(self) -> str:
        return PORT_STATES.get(self.state, str(self.state))


@dataclass(frozen=True)
class DeviceCaps:
    """What kvshm needs of ``ibv_query_device``."""

    max_qp_wr: int
    max_sge: int
    max_sge_rd: int
    max_qp_rd_atom: int
    max_qp_init_rd_atom: int
    max_cqe: int
    max_mr_size: int
    phys_port_cnt: int


def describe_gid_table(entries: Sequence[GidEntry]) -> str:
    live = [e for e in entries if not e.is_zero]
    return "; ".join(str(e) for e in live) if live else "empty"


def select_gid(entries: Sequence[GidEntry], *, link_layer: str,
               gid_index: int | None = None, prefer_ipv4: str | None = None,
               device: str | None = None, port: int = 1) -> GidEntry:
    """The GID entry to use (see the module docstring).

    Raises
    ------
    DeviceError
        No entry fits; the message lists the table and says what to do.
    """
    live = sorted((e for e in entries if not e.is_zero), key=lambda e: e.index)
    where = f"port {port}"
    if gid_index is not None:
        for e in live:
            if e.index == gid_index:
                return e
        raise DeviceError(device, f"GID index {gid_index} of {where} is empty or out of "
                                  f"range (table: {describe_gid_table(live)})")
    if link_layer == "IB":
        for e in live:
            if e.gid_type == "IB":
                return e
        if live:
            return live[0]
        raise DeviceError(device, f"the GID table of {where} is empty")
    v4 = [e for e in live if e.gid_type == "RoCEv2" and e.ipv4 is not None]
    if prefer_ipv4 is not None:
        for e in v4:
            if e.ipv4 == prefer_ipv4:
                return e
    if v4:
        return v4[0]
    raise DeviceError(device, f"{where} has no RoCEv2 GID of an IPv4 address (table: "
                              f"{describe_gid_table(live)}); give the port's network "
                              "interface an IPv4 address, or choose a GID with "
                              "--gid-index")


def no_device_cause(exc: BaseException | None = None) -> str:
    """Why this host lists no RDMA device, as precisely as the system tells."""
    if not os.path.isdir("/sys/class/infiniband"):
        return ("this host has no RDMA devices: the kernel exposes none "
                "(/sys/class/infiniband does not exist: no RDMA driver loaded, or a "
                "kernel without RDMA support)")
    if not os.path.isdir("/dev/infiniband"):
        return ("/dev/infiniband is missing: load ib_uverbs (modprobe ib_uverbs), or "
                "give a container the devices (--device=/dev/infiniband)")
    detail = f" ({exc})" if exc is not None else ""
    return f"listing RDMA devices failed{detail}"


@dataclass
class LocalPort:
    """An opened device, one of its ports and the GID chosen for it.

    ``ctx`` is the backend's device context; :meth:`close` closes it (and everything
    made from it).
    """

    backend: "Backend"
    ctx: "Context"
    device: str
    port_num: int
    port: PortInfo
    caps: DeviceCaps
    gid: GidEntry
    link_layer: str

    def describe(self) -> str:
        kind = "InfiniBand" if self.link_layer == "IB" else self.gid.gid_type
        return (f"{self.device}:{self.port_num} {kind} gid {self.gid.index} "
                f"({gid_text(self.gid.gid)}) mtu {self.port.active_mtu}")

    def close(self) -> None:
        self.ctx.close()


def open_port(backend: "Backend", dev_name: str | None, ib_port: int = 1, *,
              link_type: str | None = None, gid_index: int | None = None,
              prefer_ipv4: str | None = None) -> LocalPort:
    """Open ``dev_name`` (None: the first device whose ``ib_port`` is active).

    Raises
    ------
    DeviceError
        Naming the device and the cause: no devices on this host, no such device, port
        out of range or not active, link layer other than ``link_type``, no usable GID.
    """
    try:
        names = backend.device_names()
    except DeviceError as exc:
        raise exc.naming(dev_name) from None
    if dev_name is None:
        if not names:
            raise DeviceError(None, no_device_cause())
        errors = []
        for name in names:
            try:
                return open_port(backend, name, ib_port, link_type=link_type,
                                 gid_index=gid_index, prefer_ipv4=prefer_ipv4)
            except DeviceError as exc:
                errors.append(str(exc))
        raise DeviceError(None, "no usable device: " + "; ".join(errors))
    if dev_name not in names:
        here = ", ".join(names) if names else "none"
        raise DeviceError(dev_name, f"no such device (RDMA devices on this host: {here})")
    ctx = backend.open(dev_name)
    try:
        caps = ctx.caps()
        if not 1 <= ib_port <= max(1, caps.phys_port_cnt):
            raise DeviceError(dev_name, f"has no port {ib_port} (ports 1-"
                                        f"{caps.phys_port_cnt})")
        port = ctx.port(ib_port)
        if port.state != PORT_ACTIVE:
            raise DeviceError(dev_name, f"port {ib_port} is {port.state_name}, not ACTIVE "
                                        f"(check the link and, on InfiniBand, the subnet "
                                        f"manager: ibstat {dev_name})")
        want = normalize_link_type(link_type)
        if want is not None and port.link_layer != want:
            raise DeviceError(dev_name, f"--link-type {want} was given but port {ib_port} "
                                        f"is {port.link_layer}")
        if port.link_layer == "IB" and port.lid == 0:
            raise DeviceError(dev_name, f"port {ib_port} has no LID (is a subnet manager "
                                        "running?)")
        gid = select_gid(ctx.gid_table(ib_port), link_layer=port.link_layer,
                         gid_index=gid_index, prefer_ipv4=prefer_ipv4, device=dev_name,
                         port=ib_port)
        return LocalPort(backend, ctx, dev_name, ib_port, port, caps, gid, port.link_layer)
    except BaseException:
        ctx.close()
        raise
