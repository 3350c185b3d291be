"""Opening an RDMA device and port through a backend (:func:`open_port`), and the opened
port (:class:`LocalPort`).

The port's data types and the GID choice are in :mod:`kvshm.rdma.ports` (re-exported
here); see there for how the GID is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvshm.rdma.constants import PORT_ACTIVE
from kvshm.rdma.errors import DeviceError
from kvshm.rdma.ports import (LINK_TYPES, DeviceCaps, GidEntry, PortInfo, describe_gid_table,
                              gid_text, no_device_cause, normalize_link_type, select_gid)

if TYPE_CHECKING:
    from kvshm.rdma.verbs import Backend, Context

__all__ = ["GidEntry", "PortInfo", "DeviceCaps", "LocalPort", "LINK_TYPES",
           "normalize_link_type", "select_gid", "describe_gid_table", "gid_text",
           "no_device_cause", "open_port"]


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
