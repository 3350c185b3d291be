"""Work-request planning for a batch of one-sided transfers (pure: no verbs calls).

A batch is a list of :class:`Segment`: one run of a value each, a contiguous local
buffer (address, lkey) and a contiguous range of the server's pool (remote address); a
value laid over several block runs is one segment per run, cut by
:class:`kvshm.movers.ExtentMover`. :func:`plan` turns it into RDMA WRITE or READ work
requests that the QP accepts:

* a piece longer than the port's maximum message size is split;
* pieces whose remote ranges follow each other ride in one work request, one
  scatter/gather entry each (local pieces that also follow each other share an entry),
  at most ``max_sge`` entries and ``max_msg`` bytes per work request;
* every ``signal_every``-th work request, and the last, is signalled (asks for a
  completion); the others are reclaimed when a later signalled one completes.

:func:`groups` cuts the plan into runs that each end with a signalled work request: the
mover posts whole runs while the number of work requests outstanding stays within the
send queue, and polls the completion queue for the end of the oldest run otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from kvshm.rdma.constants import WR_RDMA_READ, WR_RDMA_WRITE

__all__ = ["Segment", "Sge", "WorkRequest", "plan", "groups", "opcode_name"]

#: An SGE's length is a u32.
_SGE_MAX = (1 << 32) - 1


@dataclass(frozen=True)
class Segment:
    """One value's transfer: ``length`` bytes between local ``laddr`` and remote ``raddr``.

    ``item`` is the value's index in the caller's batch (it names the key in errors).
    """

    laddr: int
    lkey: int
    length: int
    raddr: int
    item: int


@dataclass(frozen=True)
class Sge:
    """A scatter/gather entry: local address, length in bytes, lkey of its MR."""

    addr: int
    length: int
    lkey: int


@dataclass(frozen=True)
class WorkRequest:
    """One RDMA WRITE or READ work request (what ``struct ibv_send_wr`` holds for it).

    ``items`` are the batch indexes of the values it carries.
    """

    wr_id: int
    opcode: int
    sges: tuple[Sge, ...]
    remote_addr: int
    rkey: int
    signaled: bool
    items: tuple[int, ...]

    @property
    def length(self) -> int:
        """Bytes moved by this work request."""
        return sum(s.length for s in self.sges)


def opcode_name(opcode: int) -> str:
    """``"RDMA WRITE"`` or ``"RDMA READ"``."""
    return {WR_RDMA_WRITE: "RDMA WRITE", WR_RDMA_READ: "RDMA READ"}.get(opcode,
                                                                       f"opcode {opcode}")


def _pieces(segments: Iterable[Segment], max_msg: int) -> list[Segment]:
    out = []
    for s in segments:
        if s.length < 0:
            raise ValueError(f"negative length {s.length} for item {s.item}")
        done = 0
        while done < s.length:
            n = min(max_msg, s.length - done)
            out.append(Segment(s.laddr + done, s.lkey, n, s.raddr + done, s.item))
            done += n
    return out


def plan(segments: Sequence[Segment], *, opcode: int, rkey: int, max_sge: int,
         max_msg: int, signal_every: int, wr_id_base: int = 0) -> list[WorkRequest]:
    """Work requests that move ``segments`` (see the module docstring).

    Parameters
    ----------
    segments : sequence of Segment
        Zero-length segments are dropped (nothing to move).
    opcode : int
        ``WR_RDMA_WRITE`` or ``WR_RDMA_READ`` (:mod:`kvshm.rdma.constants`).
    rkey : int
        The remote memory region's key (the server's pool).
    max_sge : int
        Scatter/gather entries per work request (the QP's ``max_send_sge``; for READ
        also at most the device's ``max_sge_rd``). >= 1.
    max_msg : int
        Bytes per work request (the port's ``max_msg_sz``). >= 1.
    signal_every : int
        Signal every this many work requests (and the last). >= 1.
    wr_id_base : int
        ``wr_id`` of the i-th work request is ``wr_id_base + i``.

    Returns
    -------
    list of WorkRequest
    """
    if opcode not in (WR_RDMA_WRITE, WR_RDMA_READ):
        raise ValueError(f"opcode must be RDMA WRITE or READ, got {opcode}")
    if max_sge < 1 or max_msg < 1 or signal_every < 1:
        raise ValueError("max_sge, max_msg and signal_every must be >= 1")
    max_msg = min(max_msg, _SGE_MAX)
    pieces = sorted(_pieces(segments, max_msg), key=lambda p: p.raddr)
    wrs: list[WorkRequest] = []
    sges: list[Sge] = []
    items: list[int] = []
    start = end = 0   # remote range of the work request being built

    def flush() -> None:
        if sges:
            wrs.append(WorkRequest(wr_id_base + len(wrs), opcode, tuple(sges), start,
                                   rkey, False, tuple(dict.fromkeys(items))))
            sges.clear()
            items.clear()

    for p in pieces:
        fits = bool(sges) and p.raddr == end and end - start + p.length <= max_msg
        if fits:
            last = sges[-1]
            if last.lkey == p.lkey and last.addr + last.length == p.laddr:
                sges[-1] = Sge(last.addr, last.length + p.length, last.lkey)
            elif len(sges) < max_sge:
                sges.append(Sge(p.laddr, p.length, p.lkey))
            else:
                fits = False
        if not fits:
            flush()
            start = p.raddr
            sges.append(Sge(p.laddr, p.length, p.lkey))
        end = p.raddr + p.length
        items.append(p.item)
    flush()
    n = len(wrs)
    for i, w in enumerate(wrs):
        if (i + 1) % signal_every == 0 or i == n - 1:
            wrs[i] = WorkRequest(w.wr_id, w.opcode, w.sges, w.remote_addr, w.rkey, True,
                                 w.items)
    return wrs


def groups(wrs: Sequence[WorkRequest]) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges of ``wrs``, each ending with a signalled one.

    Raises
    ------
    ValueError
        The last work request is not signalled (its slots would never be reclaimed).
    """
    out = []
    start = 0
    for i, w in enumerate(wrs):
        if w.signaled:
            out.append((start, i + 1))
            start = i + 1
    if start != len(wrs):
        raise ValueError("the last work request of a plan must be signalled")
    return out
