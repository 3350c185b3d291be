"""What an RDMA port is (its attributes, its GID table) and choosing the GID to address it by.

Pure data and functions, whatever backend read them (:mod:`kvshm.rdma.verbs`, a test
double); opening a device is :mod:`kvshm.rdma.device`.

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
from typing import Sequence

from kvshm.rdma.constants import PORT_STATES
from kvshm.rdma.errors import DeviceError

__all__ = ["GidEntry", "PortInfo", "DeviceCaps", "LINK_TYPES", "normalize_link_type",
           "select_gid", "describe_gid_table", "gid_text", "no_device_cause"]

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
