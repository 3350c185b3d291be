"""RC queue pairs: the information both ends exchange, and the RESET -> INIT -> RTR -> RTS
transitions.

The exchange rides in HELLO (see ``docs/RDMA.md``): each side sends a :class:`QpInfo`
(``to_wire`` gives a msgpack-able dict). Both ends then move their QP through the states
with the attributes of :func:`init_attrs`, :func:`rtr_attrs` and :func:`rts_attrs`. These
are pure data (:class:`QpAttrs`, a subset of ``struct ibv_qp_attr``) plus the attribute
masks; the verbs backend copies them into ``pyverbs.qp.QPAttr``.

What differs between the link layers is the address vector of RTR:

* InfiniBand: ``dlid`` = the peer's LID, no GRH (``is_global=0``) unless a GID index was
  chosen explicitly (routing across subnets).
* RoCE (Ethernet): there are no LIDs; the address is the peer's GID, so ``is_global=1``
  with ``dgid`` = peer GID, ``sgid_index`` = our GID index and ``hop_limit`` 64 (RoCEv2
  packets are routed UDP/IP; a hop limit of 1 would stop at the first router).

Everything else is the same on both: path MTU = the smaller active MTU of the two ports,
ack timeout 14 (4.096 us * 2^14 = 67 ms), 7 transport retries, 7 RNR retries, and RDMA
READ depth = the smaller of the requester's initiator depth and the responder's
resources, so the server never refuses a READ for lack of resources.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kvshm.rdma import constants as C

__all__ = ["QpInfo", "QpAttrs", "Timing", "INIT_MASK", "RTR_MASK", "RTS_MASK",
           "new_psn", "path_mtu", "init_attrs", "rtr_attrs", "rts_attrs"]

INIT_MASK = C.QP_STATE | C.QP_PKEY_INDEX | C.QP_PORT | C.QP_ACCESS_FLAGS
RTR_MASK = (C.QP_STATE | C.QP_AV | C.QP_PATH_MTU | C.QP_DEST_QPN | C.QP_RQ_PSN
            | C.QP_MAX_DEST_RD_ATOMIC | C.QP_MIN_RNR_TIMER)
RTS_MASK = (C.QP_STATE | C.QP_TIMEOUT | C.QP_RETRY_CNT | C.QP_RNR_RETRY | C.QP_SQ_PSN
            | C.QP_MAX_QP_RD_ATOMIC)

_LINKS = ("IB", "Ethernet")


def new_psn() -> int:
    """A random 24-bit packet sequence number."""
    return int.from_bytes(os.urandom(3), "little")


@dataclass(frozen=True)
class QpInfo:
    """What one end tells the other about its RC QP.

    Attributes
    ----------
    qpn : int
        QP number (24 bits).
    psn : int
        Initial packet sequence number of its send queue (24 bits).
    lid : int
        Port LID (InfiniBand; 0 on RoCE).
    gid : bytes
        16-byte GID (the one of its chosen GID index).
    mtu : int
        Active MTU of its port in bytes (256-4096).
    link_layer : str
        ``"IB"`` or ``"Ethernet"``.
    rd_atomic : int
        RDMA READ depth: the client's initiator depth, or the server's responder
        resources (the client uses the smaller).
    """

    qpn: int
    psn: int
    lid: int
    gid: bytes
    mtu: int
    link_layer: str
    rd_atomic: int = 1

    def to_wire(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "lid": self.lid, "gid": bytes(self.gid),
                "mtu": self.mtu, "link": self.link_layer, "rd": self.rd_atomic}

    @classmethod
    def from_wire(cls, d: Any) -> "QpInfo":
        """Decode and check :meth:`to_wire`'s dict.

        Raises
        ------
        ValueError
            A missing field or a value out of range, named.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"RDMA QP info must be a map, got {type(d).__name__}")

        def num(name: str, lo: int, hi: int) -> int:
            v = d.get(name)
            if type(v) is not int or not lo <= v <= hi:
                raise ValueError(f"RDMA QP info field {name!r} must be an int in "
                                 f"[{lo}, {hi}], got {v!r}")
            return v

        gid = d.get("gid")
        if not isinstance(gid, (bytes, bytearray)) or len(gid) != 16:
            raise ValueError(f"RDMA QP info field 'gid' must be 16 bytes, got {gid!r}")
        link = d.get("link")
        if link not in _LINKS:
            raise ValueError(f"RDMA QP info field 'link' must be IB or Ethernet, "
                             f"got {link!r}")
        mtu = num("mtu", 256, 4096)
        if mtu not in C.MTU_BYTES.values():
            raise ValueError(f"RDMA QP info field 'mtu' must be 256, 512, 1024, 2048 or "
                             f"4096, got {mtu}")
        return cls(qpn=num("qpn", 1, (1 << 24) - 1), psn=num("psn", 0, (1 << 24) - 1),
                   lid=num("lid", 0, 0xFFFF), gid=bytes(gid), mtu=mtu, link_layer=link,
                   rd_atomic=num("rd", 1, 255))


@dataclass(frozen=True)
class Timing:
    """Transport timing of RTR/RTS (the defaults suit both IB and RoCE)."""

    timeout: int = 14        # local ACK timeout: 4.096 us * 2^14 = 67 ms
    retry_cnt: int = 7       # transport retries before IBV_WC_RETRY_EXC_ERR
    rnr_retry: int = 7       # 7 = retry forever (no SENDs are used: never happens)
    min_rnr_timer: int = 12  # 0.64 ms
    hop_limit: int = 64      # RoCEv2 / GRH hop limit
    traffic_class: int = 0
    sl: int = 0              # service level (IB) / priority


@dataclass(frozen=True)
class QpAttrs:
    """The fields of ``struct ibv_qp_attr`` kvshm sets (``ah_*`` are ``ah_attr``'s)."""

    qp_state: int
    pkey_index: int = 0
    port_num: int = 1
    qp_access_flags: int = 0
    path_mtu: int = 0            # enum ibv_mtu
    dest_qp_num: int = 0
    rq_psn: int = 0
    max_dest_rd_atomic: int = 0
    min_rnr_timer: int = 0
    ah_is_global: int = 0
    ah_dgid: bytes = field(default=bytes(16))
    ah_sgid_index: int = 0
    ah_hop_limit: int = 0
    ah_traffic_class: int = 0
    ah_flow_label: int = 0
    ah_dlid: int = 0
    ah_sl: int = 0
    ah_src_path_bits: int = 0
    ah_port_num: int = 1
    timeout: int = 0
    retry_cnt: int = 0
    rnr_retry: int = 0
    sq_psn: int = 0
    max_rd_atomic: int = 0

    def with_(self, **changes: Any) -> "QpAttrs":
        return replace(self, **changes)


def path_mtu(local: QpInfo, remote: QpInfo) -> int:
    """The path MTU in bytes: the smaller of the two ports' active MTUs."""
    return min(local.mtu, remote.mtu)


def init_attrs(*, port_num: int, access: int) -> QpAttrs:
    """RESET -> INIT (mask :data:`INIT_MASK`). ``access``: remote access the QP allows
    (the server's: REMOTE_READ | REMOTE_WRITE; the client's: none)."""
    return QpAttrs(qp_state=C.QPS_INIT, pkey_index=0, port_num=port_num,
                   qp_access_flags=access)


def rtr_attrs(local: QpInfo, remote: QpInfo, *, port_num: int, sgid_index: int,
              responder_depth: int, force_grh: bool = False,
              timing: Timing = Timing()) -> QpAttrs:
    """INIT -> RTR (mask :data:`RTR_MASK`): connect to ``remote``.

    ``responder_depth`` is this QP's ``max_dest_rd_atomic`` (RDMA READs the peer may have
    outstanding against it). ``force_grh`` adds a GRH on InfiniBand too.

    Raises
    ------
    ValueError
        The two ends are on different link layers.
    """
    if local.link_layer != remote.link_layer:
        raise ValueError(f"link layers differ: this end is {local.link_layer}, the peer "
                         f"is {remote.link_layer}")
    grh = local.link_layer == "Ethernet" or force_grh
    return QpAttrs(
        qp_state=C.QPS_RTR, port_num=port_num,
        path_mtu=C.mtu_enum(path_mtu(local, remote)), dest_qp_num=remote.qpn,
        rq_psn=remote.psn, max_dest_rd_atomic=max(1, responder_depth),
        min_rnr_timer=timing.min_rnr_timer,
        ah_is_global=1 if grh else 0,
        ah_dgid=remote.gid if grh else bytes(16),
        ah_sgid_index=sgid_index if grh else 0,
        ah_hop_limit=timing.hop_limit if grh else 0,
        ah_traffic_class=timing.traffic_class if grh else 0,
        ah_dlid=0 if local.link_layer == "Ethernet" else remote.lid,
        ah_sl=timing.sl, ah_port_num=port_num)


def rts_attrs(local: QpInfo, *, initiator_depth: int, timing: Timing = Timing()) -> QpAttrs:
    """RTR -> RTS (mask :data:`RTS_MASK`). ``initiator_depth`` is ``max_rd_atomic``: RDMA
    READs this QP may have outstanding."""
    return QpAttrs(qp_state=C.QPS_RTS, timeout=timing.timeout, retry_cnt=timing.retry_cnt,
                   rnr_retry=timing.rnr_retry, sq_psn=local.psn,
                   max_rd_atomic=max(1, initiator_depth))
