"""kvshm clients.

:class:`Client` is the synchronous client. Each operation is written once, as a
generator that yields the requests it needs and receives their replies (the protocol
logic knows nothing of sockets); :class:`Client` drives these generators over a blocking
:class:`~kvshm.zmq_ctrl.channel.Channel`, and :class:`kvshm.aio.AsyncClient` drives the
same generators with asyncio.

Movers: ``transport="shm"`` copies through the server's segment mapped here,
``"tcp"`` carries the bytes in the messages, ``"rdma"`` uses one-sided RDMA verbs, and
``"auto"`` picks shm when the segment can be attached, else RDMA when both sides have a
device, else TCP.

Pipelined batches: a large ``exists_batch`` through the server (no same-host index
answering it) goes as several requests of :data:`PIPE_KEYS` keys sent back to back
(:meth:`kvshm.zmq_ctrl.channel.Channel.request_many`), so that the server serves one
while this client packs the next and reads the replies already come. The result is the
one request's: the parts' answers are put together in key order, whatever order they
come in; a refused part raises what the one request would have raised (the first refused
part's); the keys are checked (InvalidKey, InvalidRequest for a batch over the limits)
before any is sent, as before. Off by default: ``KVSHM_PIPELINE=1`` in the environment
(read at import; also :data:`PIPELINE`, read per call) turns it on. Measured on this
2-core VM with client and server on one host (``perf/bench_small.py``'s BATCH section
times both in turns), it gains only when a core is idle for the other end (a prototype,
load 0.6: 5.0 -> 7.1 M keys/s) and loses 1-15% beside other jobs (load 1.9-4.6: the two
ends then share the cores, and the client pays ~0.01-0.02 us a key more); a client on
another host, whose packing runs on its own CPU while the bytes cross the network, is
the case it is for.

Packed shm puts: a same-host client's ALLOC + COMMIT ``put_batch`` (no checksum, no
source, not write-behind) packs the values in one C loop (``_batch.pack_values``: the
checks and errors of the views it replaces) and the shm mover copies them into the pool
in another (``Pool.write_values``); the requests are those of before. Measured (100 k
keys of 64 bytes, load 0.5): the client 3.7-4.8 -> 0.6 us a key (no memoryview and
buffer holder per value, whose allocations had set off garbage collections taking ~40%
of its time), 0.15 -> 0.35 M keys/s; the server's ALLOC + COMMIT (2.2-2.5 us a key,
COMMIT's ``install_entries`` the most of it) is then the rest. ``KVSHM_PACKED_PUT=0``
(read at import; also :data:`PACKED_PUT`, read per call) turns it off.

Inline small puts: a same-host (shm) client sends a ``put_batch`` of small values as one
PUT carrying them, the message a TCP client sends and the server installs in one C pass
(``_index.put_packed``), instead of ALLOC, a copy into the pool and COMMIT. Measured
(100 k keys of 64 bytes, ``--block-size 4``, load 0.5-2.5): ALLOC + COMMIT cost the
client 3.7-5.5 us a key (~40% of it the garbage collections set off by a memoryview and
a buffer holder made per key) and the server 1.7-2.7, 0.12-0.20 M keys/s; inline,
0.2 us and 0.9-1.4 us, 0.6-0.9 M keys/s (as over TCP). Per value size (same bench,
fewer keys) inline gains 1.6-2x at 1 KiB, breaks even at 4 KiB and loses 2-3x at
16-64 KiB (the bytes are copied three more times), hence :data:`INLINE_PUT_MAX` =
2048 (``KVSHM_INLINE_PUT_MAX``). It is taken only for a client that commits at once
(not ``lazy_commit``, not ``write_behind``), without checksums or a source (kvshm.paged,
kvshm.layerwise), when every value is at most INLINE_PUT_MAX bytes, the values at most
:data:`INLINE_PUT_TOTAL`, and the batch's blocks at most half the pool and at most the
pending limit the server announces in HELLO (``pending_limit``; a server that does not:
never), since a PUT holds nothing pending and ALLOC's quota would not apply to it. The
statuses, errors and failed keys are then those of ALLOC + COMMIT (tests/test_inline_put.py
compares both), except in two cases, which is why it is off by default: the pending
that other clients of the same principal hold (ALLOCs, write-behind reservations) is
not counted against an inline PUT, so it is stored where ALLOC answers QUOTA_EXCEEDED
(tests/test_write_behind.py test_reservation_counts_against_the_pending_quota); and a
PUT of more than ``slice_keys`` keys installs its slices as they are served (ALLOC holds
all pending until COMMIT), so with the pool full of pins a later slice may evict an
earlier one's keys where ALLOC answers POOL_FULL. ``KVSHM_INLINE_PUT=1`` in the
environment (read at import; also :data:`INLINE_PUT`, read per call) turns it on.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Callable, Generator, Iterable, NamedTuple, Sequence

import xxhash
import zmq

from kvshm import localread, segments
from kvshm._buffers import byte_view

try:
    from kvshm import _batch   # the per-key loops of a batch in C
except ImportError:            # not built: the Python loops below
    _batch = None  # type: ignore[assignment]
try:    # a pipelined batch's part packed without its slice (kvshm.zmq_ctrl._batchq)
    from kvshm.zmq_ctrl._batchq import pack_keys_request as _pack_keys
except ImportError:     # pragma: no cover - the extension is not built
    _pack_keys = None  # type: ignore[assignment]
from kvshm._pool import PackedValues, Pool
from kvshm.errors import (
    CorruptValue,
    InvalidKey,
    InvalidRequest,
    KeyNotFound,
    KvshmError,
    LeaseExpired,
    ProtocolError,
    QuotaExceeded,
    ServerUnavailable,
    TransportError,
    ValueTooLarge,
    WriteRefused,
    WritesLost,
)
from kvshm.replies import MAX_SIZE as _MAX_SIZE
from kvshm.replies import count_of, found_of, places_of, prefix_of, sizes_of, sums_of
from kvshm.movers import Layout, OneSidedMover, ShmMover, placed
from kvshm.zmq_ctrl.channel import CALL1 as _CALL1, NOT_SENT as _NOT_SENT, _pid
from kvshm.zmq_ctrl.channel import DRAIN_MAX, Channel, check_resolvable, endpoint_of
from kvshm.zmq_ctrl import serverwatch
from kvshm.zmq_ctrl import frames as _frames
from kvshm.zmq_ctrl.frames import FrameLayoutError
from kvshm.zmq_ctrl.frames import pack as pack_frames
from kvshm.zmq_ctrl.frames import unpack as unpack_frames
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Limits, Op, Status, error_for
from kvshm.zmq_ctrl.serverwatch import ServerGone

__all__ = ["Client", "Key", "TRANSPORTS"]

log = logging.getLogger(__name__)

Key = str | bytes
TRANSPORTS = ("auto", "shm", "tcp", "rdma")
#: Seconds an idle client waits before it sends queued RELEASE/COMMIT on its own.
IDLE_FLUSH_S = 0.1
#: A write-behind put that finds its reservation dry waits this long for the RESERVE
#: already asked for (its answer is usually on its way) before taking the general path.
REFILL_WAIT_S = 0.05
#: A write-behind put's PLACE is sent at once unless this many PLACEs are unanswered
#: (as last read: the server is behind) or this client streams puts (more than this
#: many in a row, each within PLACE_STREAM_GAP_S of the one before, and a PLACE went
#: out less than PLACE_HOLD_S ago). Then puts are held and sent together as one PLACE of many
#: keys (the message carries lists), one message for the lot on both sides: a message
#: costs the server ~60 us and the client ~20 us, more than the copy of 64 KiB. A held
#: put waits at most until the PLACE has:
PLACE_WINDOW = 8
#: ... this many keys, a quarter of the reservation's blocks, or is this many seconds
#: old (then the next put or the client's place-flush thread sends it), and never
#: past the client's next request of another kind.
PLACE_BATCH_KEYS = 32
PLACE_HOLD_S = 0.001
#: Puts this close together count as one stream (a preempted client's puts too).
PLACE_STREAM_GAP_S = 0.01
#: Bytes a write-behind client keeps reserved (``write_behind=True``): 32 MiB, and at
#: most 1/16 of the pool (the server's per-session cap, kvshm.store.reserve).
WRITE_BEHIND_BYTES = 32 << 20
#: A client maps a pool up to this size pre-faulted (MAP_POPULATE); larger ones fault
#: pages in as they are first touched. 4 GiB costs a client 8 MiB of page tables.
POPULATE_MAX_BYTES = 4 << 30
#: Whether large batches are pipelined (see the module docstring): the environment's
#: ``KVSHM_PIPELINE`` (``1``: on; off by default), read at import.
PIPELINE = os.environ.get("KVSHM_PIPELINE", "0").strip() not in ("", "0")
#: Inline small puts of a same-host client (see the module docstring): off unless the
#: environment's ``KVSHM_INLINE_PUT`` is ``1`` (read at import; also :data:`INLINE_PUT`,
#: read per call).
INLINE_PUT = os.environ.get("KVSHM_INLINE_PUT", "0").strip() not in ("", "0")
#: A shm put_batch goes inline when every value is at most this many bytes
#: (``KVSHM_INLINE_PUT_MAX``, default 2048: measured in the module docstring) ...
INLINE_PUT_MAX = int(os.environ.get("KVSHM_INLINE_PUT_MAX", "2048"))
#: ... and the values add up to at most this many bytes (16 MiB: one message's worth
#: held in memory twice, well under the server's 65 MiB message limit).
INLINE_PUT_TOTAL = 16 << 20
#: A shm client's ALLOC + COMMIT put_batch packs the values in C and copies them in one
#: C loop (:class:`_Packed`): on unless the environment's ``KVSHM_PACKED_PUT`` is ``0``
#: (read at import; also :data:`PACKED_PUT`, read per call).
PACKED_PUT = os.environ.get("KVSHM_PACKED_PUT", "1").strip() not in ("", "0")
#: Keys per request of a pipelined batch, by op. EXISTS: the server's C batch path
#: serves up to ``SLICE_MULT * slice_keys`` (8,192 at the default 2,048) keys in one
#: turn, so a part of that size is answered as it comes, in order (a larger one would be
#: served in slices, round robin with the others, and answered last). PUT: a TCP
#: put_batch (no checksum, not written behind), parts packed before the first is sent
#: (:meth:`_Session.op_put_parts`); measured in stop 16 the server's CPU grew with parts
#: (1.07 -> 1.12-1.45 us a key); in stop 28 (100 k keys of 64 bytes, beside a CI run,
#: load ~3) 0.55-0.57 -> 0.54-0.83 M keys/s in two runs of parts of 2,048-32,768 keys,
#: 0.45 -> 0.34 in ``perf/bench_small.py`` (server 0.80 -> 1.10 us a key), which times
#: both in turns. Off by default, as EXISTS's. GET is not pipelined.
PIPE_KEYS: dict[int, int] = {Op.EXISTS: 8192, Op.PUT: 8192}
#: A batch is pipelined from this many parts on (fewer: one request).
PIPE_MIN_PARTS = 2


class _Req(NamedTuple):
    op: int
    body: dict[str, Any]
    frames: Sequence[Any] = ()
    stateful: bool = False      # offsets/grants involved: needs this server instance
    retry_stale: bool = True    # after a server restart, say HELLO and resend
    # sent without waiting for its reply: called with the request id before it goes
    # (the reply reaches _Session.late_reply); the operation gets an empty OK reply
    noreply: Callable[[int], None] | None = None
    # where the reply's payload may go (Channel.request's into: a GET into buffers)
    into: Callable[[int, dict[str, Any]], Any] | None = None


class _Many(NamedTuple):
    """Several requests sent back to back, their replies waited for together
    (:meth:`Client._roundtrip_many`; the operation receives a list of :class:`_Reply`
    in the same order). Only the synchronous client drives operations that yield it;
    the requests are not stateful (no grants) and carry no noreply."""
    reqs: list[_Req]


class _KeysPart:
    """The body ``{"keys": keys[start:stop]}`` of one part of a pipelined batch,
    packed when it is sent (:meth:`header`) without making the slice."""

    __slots__ = ("keys", "start", "stop")

    def __init__(self, keys: list[bytes], start: int, stop: int) -> None:
        self.keys = keys
        self.start = start
        self.stop = stop

    def body(self) -> dict[str, Any]:
        return {"keys": self.keys[self.start:self.stop]}

    def header(self, op: int, rid: int, epoch: int) -> bytes | dict[str, Any]:
        """The header frame (C), else the body (encode_request packs it)."""
        if _pack_keys is not None:
            h = _pack_keys(PROTOCOL_VERSION, op, rid, epoch, self.keys, self.start,
                           self.stop)
            if h is not None:
                return h  # type: ignore[no-any-return]
        return self.body()


def _parts(n: int, op: int) -> int:
    """Keys per part when a batch of ``n`` keys is pipelined, else 0."""
    if not PIPELINE:
        return 0
    k = PIPE_KEYS.get(op, 0)
    return k if k and n >= PIPE_MIN_PARTS * k else 0


def _out_view(o: Any) -> memoryview:
    """A writable byte view of an output without the buffer protocol (a tensor)."""
    return byte_view(o, writable=True)


class _Reply(NamedTuple):
    req_id: int
    status: int
    body: dict[str, Any]
    frames: list[Any]


class _Restarted(ServerUnavailable):
    """The server restarted between two steps of one operation."""


def _gone_unsent(exc: BaseException) -> bool:
    """``exc`` says the same-host server was proven gone before the request was sent:
    nothing was done, as with STALE_EPOCH (the HELLO that follows raises at once when no
    server listens at the address, :meth:`_Session.check_gone`)."""
    return isinstance(exc, ServerGone) and not exc.sent


class _Buffers:
    """Values given as caller buffers: the usual source of ``_Session.op_put_batch``."""

    __slots__ = ("keys", "views", "sizes")

    def __init__(self, keys: list[bytes], views: list[memoryview],
                 sizes: list[int] | None = None) -> None:
        self.keys = keys
        self.views = views
        self.sizes = [v.nbytes for v in views] if sizes is None else sizes

    def buffers(self) -> list[memoryview]:
        return self.views

    def to_pool(self, mover: OneSidedMover, offsets: list[int], idx: list[int]) -> None:
        mover.write(offsets, [self.views[i] for i in idx], [self.keys[i] for i in idx])


class _Packed:
    """Values packed back to back (``_batch.pack_values``, read in place as a
    :class:`~kvshm._pool.PackedValues`): a shm client's source for ALLOC + COMMIT
    without a memoryview per value. The shm mover's ``write`` copies them in one C loop
    (``Pool.write_values``, -1 offsets for refused keys); any other mover (values of several runs: an ExtentMover)
    is given views as :class:`_Buffers` gives them. Off: ``KVSHM_PACKED_PUT=0``
    (:data:`PACKED_PUT`)."""

    __slots__ = ("keys", "packed", "sizes")

    def __init__(self, keys: list[bytes], packed: Any, sizes: list[int]) -> None:
        self.keys = keys
        self.packed = packed
        self.sizes = sizes

    def buffers(self) -> list[memoryview]:
        p = self.packed
        return [p[i] for i in range(len(p))]

    def to_pool(self, mover: OneSidedMover, offsets: list[int], idx: list[int]) -> None:
        if type(mover) is ShmMover:
            # -1 means "refused, skip" to write_values: a granted (OK) key's offset
            # must never read so (a hostile reply: COMMIT of blocks never written)
            if offsets and min(offsets) < 0:
                raise IndexError(f"ALLOC granted offset {min(offsets)}")
            n = len(self.sizes)
            if len(idx) != n:       # some refused: -1 is not written
                full = [-1] * n
                for j, i in enumerate(idx):
                    full[i] = offsets[j]
                offsets = full
            mover.write(offsets, self.packed, self.keys)   # one C loop (ShmMover.write)
            return
        p = self.packed
        mover.write(offsets, [p[i] for i in idx], [self.keys[i] for i in idx])


OpGen = Generator[_Req, _Reply, Any]


def _check(r: _Reply, what: str) -> None:
    if r.status != Status.OK:
        msg = r.body.get("error", Status(r.status).name if r.status in Status._value2member_map_
                         else str(r.status))
        raise error_for(r.status, f"{what}: {msg}")


_STALE = int(Status.STALE_EPOCH)
_OP_PUT, _OP_GET, _OP_EXISTS = int(Op.PUT), int(Op.GET), int(Op.EXISTS)
if _CALL1:      # the one-key request path in C (Client._fast1)
    from kvshm.zmq_ctrl._zmqc import EXISTS1 as _EXISTS1, GET1 as _GET1
    from kvshm.zmq_ctrl._zmqc import GET1_INTO as _GET1_INTO, PUT1 as _PUT1
_ONE_OK = [int(Status.OK)]
_ONE_FRAME = [1]
_OK = int(Status.OK)


def _key1(s: "_Session", key: Any) -> bytes | None:
    """``key`` as bytes when it passes _Session.keys as a batch of one, else None (the
    general path then raises what it raises)."""
    if type(key) is bytes:
        bkey = key
    elif type(key) is str and key.isascii():
        bkey = key.encode()
    else:
        return None
    n = len(bkey)
    if (n == 0 or n > s.limits.max_key_bytes or s.limits.max_batch < 1
            or (s.max_message and n + 8 > s.max_message)):
        return None
    return bkey


def _xxh(view: memoryview) -> int:
    return xxhash.xxh64_intdigest(view)


class _WriteBehind:
    """A write-behind client's reservation and its writes not yet acknowledged.

    The server hands out runs of free blocks (RESERVE, :mod:`kvshm.store.reserve`); a put takes
    the blocks it needs from them, copies the value in and sends PLACE without waiting.
    ``runs`` is this client's view of what it still holds, ``gen`` the reservation's
    generation (0: none; the next RESERVE resets). ``outstanding`` maps each PLACE's
    request id to its keys until its reply is read; ``placed`` serves this client's own
    reads of them meanwhile. ``copying`` counts copies into the reservation in flight:
    a reset (which frees the old blocks on the server) waits until none is.

    ``held_*``: the PLACE being gathered (``held_rid`` its request id, 0: none; already
    in ``outstanding`` and ``placed`` under it), sent by the put that fills it, by any
    other request of the client, or by the place-flush thread (see PLACE_WINDOW).
    """

    __slots__ = ("mover", "pool", "bs", "want", "gen", "runs", "free", "reserve_rid",
                 "outstanding", "placed", "copying", "lock", "max_extents", "checked",
                 "held_rid", "held_gen", "held_keys", "held_sizes", "held_runs",
                 "held_blocks", "held_at", "batch_blocks", "puts", "sent_at",
                 "last_put", "burst", "reserving")

    def __init__(self, mover: ShmMover, block_size: int, want_blocks: int) -> None:
        self.mover = mover
        self.pool = mover.pool
        self.bs = block_size
        self.want = want_blocks
        self.gen = 0
        self.runs: list[list[int]] = []     # [first block, count], in grant order
        self.free = 0
        self.reserve_rid = 0                # a RESERVE in flight (its reply not read)
        self.outstanding: dict[int, list[bytes]] = {}
        self.placed = localread.Placed()
        self.copying = 0
        self.reserving = False              # a RESERVE waited for is in flight
        self.lock = threading.Lock()
        self.max_extents = 8                # kvshm.index.MAX_EXTENTS: runs of one value
        self.checked = 0.0                  # time.monotonic() the server was last seen alive
        self.batch_blocks = max(1, want_blocks // 4)   # most blocks of one held PLACE
        self.puts = 0                       # puts made by Client._put_behind
        self.sent_at = 0.0                  # time.monotonic() of the last PLACE sent
        self.last_put = 0.0                 # ... of the last put, and how many in a row
        self.burst = 0                      # came within PLACE_STREAM_GAP_S of the last
        self.unhold()

    def unhold(self) -> None:
        """Start gathering a new PLACE (the held one was sent, or voided)."""
        self.held_rid = 0
        self.held_gen = 0
        self.held_keys: list[bytes] = []
        self.held_sizes: list[int] = []
        self.held_runs: list[list[list[int]]] = []
        self.held_blocks = 0
        self.held_at = 0.0

    def nblocks(self, size: int) -> int:
        return max(1, -(-size // self.bs))

    def take1(self, n: int) -> tuple[int, list[list[list[int]]], ShmMover, int] | None:
        """:meth:`take` of one value of ``n`` blocks from the front of the first run
        that holds it (the common case); None: use :meth:`take`."""
        with self.lock:
            if not self.gen or n > self.free:
                return None
            for r in self.runs:
                if r[1] >= n:
                    got = [[r[0], n]]
                    r[0] += n
                    r[1] -= n
                    if not r[1]:
                        self.runs.remove(r)
                    self.free -= n
                    self.copying += 1
                    return self.gen, [got], self.mover, self.bs
            return None

    def take(self, need: Sequence[int]
             ) -> tuple[int, list[list[list[int]]], ShmMover, int] | None:
        """Blocks for each value (``[[first block, count], ...]`` each), all or none,
        with the generation, the mover and the block size they belong to; counted as a
        copy in flight (:meth:`copy_done`)."""
        with self.lock:
            if not self.gen or sum(need) > self.free:
                return None
            runs = self.runs
            out: list[list[list[int]]] = []
            undo: list[tuple[int, int]] = []
            ok = True
            for n in need:
                got: list[list[int]] = []
                # one run when one holds it, else the first runs that together do
                j = next((i for i, r in enumerate(runs) if r[1] >= n), -1)
                idx = [j] if j >= 0 else list(range(len(runs)))
                left = n
                for i in idx:
                    if left == 0 or len(got) == self.max_extents:
                        break
                    r = runs[i]
                    k = min(r[1], left)
                    if k == 0:
                        continue
                    got.append([r[0], k])
                    undo.append((i, k))
                    r[0] += k
                    r[1] -= k
                    left -= k
                if left:
                    ok = False
                    break
                out.append(got)
            if not ok:
                for i, k in reversed(undo):     # give back in reverse: runs restored
                    runs[i][0] -= k
                    runs[i][1] += k
                return None
            self.runs = [r for r in runs if r[1] > 0]
            self.free -= sum(need)
            self.copying += 1
            return self.gen, out, self.mover, self.bs

    def claim_reserve(self) -> bool:
        """Whether the caller may send a RESERVE and wait for it now: none such is in
        flight, no refill was asked ahead (``reserve_rid``) and no copy into the
        reservation is under way. The caller clears ``reserving`` once the reply is
        applied (or the request failed). One at a time: a reset gives the old blocks
        back to the pool, so no copy may be running into them, and none may start
        from another RESERVE's reply before the reset is applied (two threads that
        both found the reservation dry each sent a reset, the second under the
        first's copy: its blocks went to other keys with the first's bytes)."""
        with self.lock:
            if self.reserving or self.copying or self.reserve_rid:
                return False
            self.reserving = True
            return True

    def copy_done(self) -> None:
        with self.lock:
            self.copying -= 1

    def low(self) -> bool:
        """Whether to ask for more now (under half of the target held, none asked)."""
        return not self.reserve_rid and self.free * 2 < self.want

    def apply_reserve(self, body: dict[str, Any], reset: bool) -> None:
        """Add the runs of a RESERVE reply (``{gen, runs: [[first block, count], ...]}``,
        kvshm.zmq_ctrl.ops_local); ``reset`` or another generation first drops what is
        held.

        Raises
        ------
        ProtocolError
            A reply the server never sends: ``gen`` not an int in [1, 2**64), ``runs``
            not a list of ``[first block, count]`` int pairs with ``count >= 1`` inside
            the pool, or runs that overlap each other or the runs still held. Nothing of
            it is used and the reservation is forgotten (``gen`` 0: the next RESERVE
            resets it on the server, so blocks it may have granted go back).
        """
        gen: Any = body.get("gen")
        runs = body.get("runs")
        if runs is None:
            runs = []
        with self.lock:
            drop = reset or gen != self.gen
            why = self._bad_reserve(gen, runs, [] if drop else self.runs)
            if why is not None:
                self.gen = 0
                self.runs, self.free = [], 0
                raise ProtocolError(f"bad RESERVE reply: {why}; the reservation is "
                                    "dropped (the next put asks for a new one)")
            if drop:
                self.gen = gen          # (an int: _bad_reserve said so)
                self.runs, self.free = [], 0
            for r in runs:
                self.runs.append([r[0], r[1]])
                self.free += r[1]

    def _bad_reserve(self, gen: Any, runs: Any, held: list[list[int]]) -> str | None:
        """Why a RESERVE reply's ``gen`` and ``runs`` cannot be used, or None."""
        if type(gen) is not int or not 0 < gen < 1 << 64:
            return f"generation {gen!r} is not an int in [1, 2**64)"
        if type(runs) is not list:
            return f"runs is a {type(runs).__name__}, not a list"
        nblocks = self.pool.size // self.bs
        for r in runs:
            if not (type(r) is list and len(r) == 2 and type(r[0]) is int
                    and type(r[1]) is int and r[0] >= 0 and r[1] >= 1
                    and r[0] + r[1] <= nblocks):
                return (f"run {r!r} is not [first block, count >= 1] inside the pool's "
                        f"{nblocks} blocks")
        if runs:
            end = -1
            for b0, c in sorted([(r[0], r[1]) for r in held] + [(r[0], r[1]) for r in runs]):
                if b0 < end:
                    return f"run [{b0}, {c}] overlaps blocks already reserved"
                end = b0 + c
        return None

    def void(self) -> list[int]:
        """Forget the reservation (a new HELLO); returns the PLACE ids not answered."""
        with self.lock:
            self.gen = 0
            self.runs, self.free = [], 0
            self.reserve_rid = 0
            self.unhold()             # a held PLACE is in outstanding: lost with it
            rids = list(self.outstanding)
            return rids


class _Session:
    """Per-client state shared by the sync and async clients (no I/O here).

    The server knows this client by its session (``session_id``, issued in HELLO) and
    its ``nonce`` (random, one per client object): a new HELLO with the same nonce, after
    a reconnect, carries the grants over. A same-host client proves that it attached
    the pool and is alive with a locked file next to the segment
    (:class:`kvshm.segments.ClientProof`); the shm mover is used only once the server
    saw that proof.
    """

    def __init__(self, transport: str, lazy_commit: bool, rdma: Any = None,
                 token: "bytes | Callable[[], bytes | None] | None" = None,
                 write_behind: bool | int = False) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if write_behind is True:
            write_behind = WRITE_BEHIND_BYTES
        if type(write_behind) is not int and write_behind is not False or write_behind < 0:
            raise ValueError(f"write_behind must be a bool or a byte count >= 0, got "
                             f"{write_behind!r}")
        #: bytes to keep reserved for writes that do not wait (0: off)
        self.write_behind = int(write_behind)
        self.wb: _WriteBehind | None = None
        self.wb_refused: dict[bytes, int] = {}   # refused PLACE keys, not yet raised
        self.wb_lost: list[bytes] = []           # unacknowledged PLACE keys, not raised
        self.transport = transport
        self.nonce = os.urandom(16)
        # the server's door token, or how to read it (again at each HELLO: a restarted
        # server has a new one)
        self.token = token
        # the server's operator token (DRAIN, PURGE, EVICT), or how to read it
        self.operator_token: "bytes | Callable[[], bytes | None] | None" = None
        self.session_id = 0
        self.pid = os.getpid()
        self._ids = itertools.count(1)
        self.proof: segments.ClientProof | None = None
        self._unproven: ShmMover | None = None    # attached, waiting for the server's "local"
        self.lazy_commit = lazy_commit
        self.epoch = 0
        self.hello: dict[str, Any] = {}
        self.limits = Limits()
        self.max_message = 0        # bytes in one message the server takes (0: unknown)
        self.capacity = 0
        self.mover: OneSidedMover | None = None
        self.commits: list[int] = []
        self.aborts: list[int] = []
        self.releases: list[int] = []
        self.need_hello = True
        self._retired: list[OneSidedMover] = []
        self.lazy_rids: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self.lost_commits: list[int] = []   # lazily committed writes the server refused
        # lazy COMMIT ids sent on a HELLO not applied yet: lost when it finds another
        # server (a restart: the old epoch's settle lists are not applied there)
        self.hello_commits: list[int] = []
        # lazy COMMIT ids sent again after a request carrying them failed (a timeout: it
        # may have reached the server): one reported refused may have been applied
        self.resent_commits: set[int] = set()
        self.rdma_options = rdma   # kvshm.rdma.RdmaOptions or dict, for "rdma"/"auto"
        self.rdma: Any = None      # kvshm.rdma.ClientLink, made by kvshm.rdma on first use
        self.local: Any = None     # kvshm.localread reader of the server's shared index
        self.last_watch: Any = None  # serverwatch.ServerWatch of the last local HELLO

    # ---------------------------------------------------------------- keys

    def keys(self, keys: Iterable[Key]) -> list[bytes]:
        if type(keys) is not list:
            keys = list(keys)
        if _batch is not None:      # one C loop; None: something to word below
            fast = _batch.keys(keys, self.limits.max_key_bytes)
            if fast is not None:
                if fast[0]:
                    self._check_batch(len(fast[0]), fast[1])
                return fast[0]  # type: ignore[no-any-return]
        try:
            out: list[Any] = [k.encode() if type(k) is str else k for k in keys]
        except UnicodeEncodeError as exc:
            raise InvalidKey(f"a str key must encode as UTF-8 ({exc}); pass bytes for "
                             "arbitrary keys") from None
        limit = self.limits.max_key_bytes
        if not out:
            return out
        if set(map(type, out)) == {bytes}:      # the common case, checked at C speed
            lens = list(map(len, out))
            if min(lens) > 0 and max(lens) <= limit:
                self._check_batch(len(out), sum(lens))
                return out
        for i, k in enumerate(out):
            if type(k) is not bytes:
                if isinstance(k, (bytearray, memoryview)):
                    out[i] = k = bytes(k)
                else:
                    raise InvalidKey(f"a key must be str or bytes, got {type(k).__name__}")
            if not k:
                raise InvalidKey("empty key")
            if len(k) > limit:
                raise InvalidKey(f"key of {len(k)} bytes exceeds the server's limit of "
                                 f"{limit} bytes: {k[:32]!r}...")
        self._check_batch(len(out), sum(map(len, out)))
        return out

    def _check_batch(self, n: int, key_bytes: int) -> None:
        if n > self.limits.max_batch:
            raise InvalidRequest(f"batch of {n} keys exceeds the server's limit of "
                                 f"{self.limits.max_batch}")
        if self.max_message and key_bytes + 8 * n > self.max_message:
            raise InvalidRequest(f"the {n} keys of this batch take more than the "
                                 f"{self.max_message} bytes the server takes in one "
                                 "message; split the batch")

    # ---------------------------------------------------------------- piggyback

    def take_piggyback(self, body: dict[str, Any]) -> dict[str, Any]:
        if not (self.commits or self.aborts or self.releases) or not self.epoch:
            return body
        body = dict(body)
        for name, q in (("commit", self.commits), ("abort", self.aborts),
                        ("release", self.releases)):
            if q:
                # copy, then drop just what was copied: another thread (an AsyncClient's
                # copy thread) may append meanwhile, and its id must not be lost
                taken = q[:]
                del q[:len(taken)]
                body[name] = body.get(name, []) + taken
        return body

    def hello_piggyback(self, hb: dict[str, Any]) -> dict[str, Any]:
        """The HELLO body ``hb`` with the queued settle lists (applied to the old
        session first; none before the first HELLO); its COMMIT ids are remembered
        until the reply is applied (:meth:`apply_hello`)."""
        if not self.epoch:
            return hb
        body = self.take_piggyback(hb)
        if body is not hb:
            self.hello_commits.extend(body.get("commit", ()))
        return body

    def requeue(self, body: dict[str, Any], unapplied: bool = False,
                failed: bool = False) -> None:
        """Put back the RELEASE/ABORT ids a request carried that the server may not have
        seen (both are idempotent). COMMITs are not resent unless asked (one the server
        applied is reported refused when sent again): with ``unapplied``, the server
        answered that it applied none (STALE_EPOCH), and the lazy COMMITs go again, on
        the HELLO that
        follows (applied by the same server; reported lost by another,
        :meth:`apply_hello`). With ``failed`` (the request failed: timed out, its send
        failed, interrupted; the server may or may not have applied them) the lazy
        COMMITs go again too: a put that returned is committed (the COMMIT was lost) or
        reported (LeaseExpired, from a reply's ``commit_failed``: the grant was settled
        by the first or its lease ran out), never silently dropped."""
        for name, q in (("release", self.releases), ("abort", self.aborts)):
            for rid in body.get(name, ()):
                if rid not in q:
                    q.append(rid)
        if unapplied or failed:
            for rid in body.get("commit", ()):
                if rid in self.lazy_rids and rid not in self.commits:
                    self.commits.append(rid)
                    if failed:
                        self.resent_commits.add(rid)

    def note_reply(self, body: dict[str, Any]) -> None:
        """Keep the lazily committed writes a reply says were refused (their lease ran
        out): the next put or :meth:`Client.flush` raises LeaseExpired for them."""
        failed = body.get("commit_failed")
        if failed and type(failed) is list:     # (anything else: a reply the server
            for rid in failed:                  # never sends; late_reply must not raise)
                if type(rid) is int and rid in self.lazy_rids:
                    del self.lazy_rids[rid]
                    self.lost_commits.append(rid)

    def raise_lost_commits(self) -> None:
        if self.lost_commits:
            n = len(self.lost_commits)
            resent = self.resent_commits
            maybe = sum(1 for rid in self.lost_commits if rid in resent)
            if resent:
                resent.difference_update(self.lost_commits)
            self.lost_commits.clear()
            also = (f" ({maybe} of them sent again after a request carrying their COMMIT "
                    "failed: those may have been stored by it)") if maybe else ""
            raise LeaseExpired(f"{n} earlier write(s) committed lazily were not committed: "
                               "the server refused them (their lease ran out before the "
                               "COMMIT arrived) or restarted before the COMMIT reached it; "
                               f"those keys were not stored{also}")

    def piggyback_pending(self) -> bool:
        wb = self.wb
        return bool(self.commits or self.aborts or self.releases or
                    (wb is not None and (wb.outstanding or wb.reserve_rid)))

    # ---------------------------------------------------------------- write-behind

    def late_reply(self, rid: int, status: int, body: dict[str, Any]) -> None:
        """A reply nobody waited for (kvshm.zmq_ctrl.channel.Channel.on_stray): the
        answer to a PLACE or a RESERVE sent ahead; others are dropped."""
        wb = self.wb
        if wb is None:
            return
        if rid and rid == wb.reserve_rid:
            wb.reserve_rid = 0
            if status == Status.OK:
                try:
                    wb.apply_reserve(body, reset=False)
                except ProtocolError as exc:
                    # nobody waits for this reply, and a reader must not raise (an
                    # AsyncClient's reader task would end): the next put reserves again
                    log.warning("kvshm server %s: %s", self.hello.get("server"), exc)
            elif status == Status.STALE_EPOCH:
                self.need_hello = True
            return
        with wb.placed.lock:
            keys = wb.outstanding.pop(rid, None)
            if keys is None:
                return
            if status != Status.OK:
                if status == Status.STALE_EPOCH:     # the server restarted: gone
                    self.need_hello = True
                    self.wb_lost.extend(keys)
                else:
                    for k in keys:
                        self.wb_refused[k] = status
            else:
                self.note_reply(body)
                st = body.get("st")
                if type(st) is not list:
                    st = []             # (a reply the server never sends: all INTERNAL)
                if any(x == Status.OK for x in st):
                    self.releases.append(rid)     # the pins the PLACE holds
                for k, x in zip(keys, st):
                    if x != Status.OK:
                        self.wb_refused[k] = x if type(x) is int else Status.INTERNAL
                        if x == Status.STALE_EPOCH:
                            wb.gen = 0          # voided on the server: reset it
                if len(st) < len(keys):
                    for k in keys[len(st):]:
                        self.wb_refused[k] = Status.INTERNAL
            m = wb.placed.map
            for k in keys:
                v = m.get(k)
                if v is not None and v[0] == rid:
                    del m[k]

    def unsent(self, rid: int) -> None:
        """A PLACE/RESERVE that could not be sent: forget it (the caller raises)."""
        wb = self.wb
        if wb is None:
            return
        if rid and rid == wb.reserve_rid:
            wb.reserve_rid = 0
        with wb.placed.lock:
            keys = wb.outstanding.pop(rid, None) or []
            m = wb.placed.map
            for k in keys:
                v = m.get(k)
                if v is not None and v[0] == rid:
                    del m[k]

    def raise_wb_errors(self) -> None:
        """Raise WritesLost / WriteRefused for write-behind puts the server did not
        store (each reported once)."""
        if self.wb_lost:
            lost, self.wb_lost = self.wb_lost, []
            names = ", ".join(repr(k) for k in lost[:5])
            more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
            raise WritesLost(f"{len(lost)} write(s) made behind were not acknowledged by "
                             f"the server (it restarted or the connection was reset): "
                             f"{names}{more}; they may not be stored", lost)
        if self.wb_refused:
            failed, self.wb_refused = self.wb_refused, {}
            parts = []
            for k, st in list(failed.items())[:5]:
                name = Status(st).name if st in Status._value2member_map_ else str(st)
                parts.append(f"{k!r} ({name})")
            more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
            raise WriteRefused(f"the server refused {len(failed)} write(s) made behind: "
                               f"{', '.join(parts)}{more}; they were not stored",
                               {k: Status(v) if v in Status._value2member_map_ else v
                                for k, v in failed.items()})

    def _wb_after_hello(self, same_server: bool) -> None:
        wb = self.wb
        if wb is not None:
            rids = wb.void()
            with wb.placed.lock:
                for rid in rids:
                    self.wb_lost.extend(wb.outstanding.pop(rid, []))
                    if same_server:
                        self.releases.append(rid)   # it may hold pins: drop them
                wb.placed.map.clear()
        m = self.mover
        bs = int(self.hello.get("pool", {}).get("block_size", 0) or 0)
        if not (self.write_behind and isinstance(m, ShmMover) and bs > 0):
            self.wb = None
            return
        want = max(1, min(self.write_behind, self.capacity // 16) // bs)
        if wb is None:
            self.wb = _WriteBehind(m, bs, want)
        else:
            # the same object: a copy still running into the old reservation keeps
            # counting in ``copying``, so the reset that frees it waits for it
            wb.mover, wb.pool, wb.bs, wb.want = m, m.pool, bs, want
            wb.batch_blocks = max(1, want // 4)

    def read_own(self, key: Key, out: Any) -> Any:
        """This client's value of ``key`` written behind and not yet answered: bytes
        (``out`` None) or the size copied into ``out``; None when there is none."""
        wb = self.wb
        if wb is None:
            return None
        # a forked child has a copy of the parent's ``placed`` that no reply updates:
        # its blocks may hold other keys by now
        self.check_owner()
        bk = self.keys([key])[0]
        if bk not in wb.placed:
            return None
        with wb.mover.copying() as pool:
            if out is None:
                return wb.placed.get(pool, bk)
            n = wb.placed.get_into(pool, bk, byte_view(out, writable=True,
                                                       what=f"output for key {key!r}"))
            return None if n == localread.MISS else n

    def own_flags(self, keys: Sequence[Key]) -> list[bool] | None:
        """Per key, whether it is this client's write behind not yet answered; None
        when none is (the common case, checked first)."""
        wb = self.wb
        if wb is None or not wb.placed:
            return None
        flags = [k in wb.placed for k in self.keys(keys)]
        return flags if any(flags) else None

    def placed_any(self, bkeys: Sequence[bytes]) -> bool:
        wb = self.wb
        return wb is not None and bool(wb.placed) and any(k in wb.placed for k in bkeys)

    def bye(self) -> tuple[int, dict[str, Any]] | None:
        """The BYE to send at close (epoch, body with what is left to settle), or None
        when there is no session to end or the caller still holds views of pinned pool
        memory (their pins must stay until lease expiry or the liveness proof ends)."""
        if not self.epoch or self.need_hello or getattr(self, "views_alive", False):
            return None
        for m in (self.mover, *self._retired):
            pool = getattr(m, "pool", None)
            if pool is not None and not pool.closed and pool.num_views:
                return None
        return self.epoch, self.take_piggyback({})

    # ---------------------------------------------------------------- HELLO

    def new_id(self) -> int:
        """A request id, unique for the life of this client (thread-safe)."""
        return next(self._ids)

    def check_owner(self) -> None:
        """Raise at once in a forked child: its sockets, mapping and session are the
        parent's (a request would time out, or mix its replies with the parent's)."""
        if os.getpid() != self.pid:
            raise KvshmError("this kvshm client was made before fork(); make a new client "
                             "in the child process")

    def hello_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"version": PROTOCOL_VERSION, "transport": self.transport,
                                "nonce": self.nonce}
        tok = self.token() if callable(self.token) else self.token
        if tok is not None:
            body["token"] = tok
        op = self.operator_token() if callable(self.operator_token) else self.operator_token
        if op is not None:
            body["operator_token"] = op
        if self._unproven is not None:
            body["proof"] = True        # the liveness file is locked: look at it
        elif self.transport in ("rdma", "auto"):
            from kvshm import rdma

            body.update(rdma.hello_fields(self))   # a new QP's info when RDMA is tried
        return body

    def ipc_for_proof(self, endpoint: str) -> str | None:
        """The server's ipc endpoint to say the HELLO with the liveness proof on, when
        this client is on tcp and the endpoint is on this host's filesystem."""
        ipc = self.hello.get("ipc")
        if (self._unproven is None or not ipc or not endpoint.startswith("tcp://")
                or not os.path.exists(ipc[len("ipc://"):])):
            return None
        return ipc

    def server_watch(self, endpoint: str) -> "serverwatch.ServerWatch | None":
        """What the kernel proves about the server, for a client the server saw as local
        (its pool's flock; on ``endpoint`` ipc, the socket file's inode); else None. Kept
        for :meth:`check_gone` at the next HELLO."""
        pool = self.hello.get("pool")
        w = None
        if self.hello.get("local") is True and isinstance(pool, dict):
            w = serverwatch.ServerWatch(str(pool["name"]), endpoint)
        old, self.last_watch = self.last_watch, w
        if old is not None:
            old.close()
        return w

    def check_gone(self, base_endpoint: str) -> None:
        """Before a HELLO at ``base_endpoint``: raise ServerGone at once when the server
        this client was on is proven gone and nothing listens at the address (instead of
        a HELLO that waits the whole timeout). Blocks for at most a local connect."""
        w = self.last_watch
        why = w.gone() if w is not None else None
        if why is None:
            return
        if serverwatch.listening(base_endpoint):
            self.last_watch = None       # a new server: the HELLO goes to it
            w.close()
            return
        raise ServerGone(f"kvshm server at {base_endpoint} is gone: {why}, and nothing "
                         "listens there", sent=False)

    def hello_again(self) -> bool:
        """Whether the HELLO just applied asks for another (the liveness proof is made,
        or a QP is offered)."""
        if self._unproven is not None:
            return True
        return self.rdma is not None and self.rdma.take_hello_again()

    def apply_hello(self, r: _Reply, address: str) -> None:
        _check(r, f"HELLO to {address}")
        h = r.body
        same_server = int(h["epoch"]) == self.epoch
        self.hello = h
        self.epoch = int(h["epoch"])
        self.session_id = int(h.get("session", 0))
        self.limits = Limits.from_wire(h["limits"])
        self.max_message = int(h.get("max_message", 0))
        self.capacity = int(h["pool"]["size"])
        if same_server:       # it applied what the HELLO carried: COMMITs it refused
            self.note_reply(h)
        else:                 # another instance: none of the grants the lists name exist
            # lazily committed puts (reported done) whose COMMIT no server applied:
            # raised as LeaseExpired by the next call, as refused lazy commits are
            gone = [rid for rid in dict.fromkeys((*self.hello_commits, *self.commits))
                    if rid in self.lazy_rids]
            for rid in gone:
                del self.lazy_rids[rid]
            self.lost_commits.extend(gone)
            self.commits.clear()
            self.aborts.clear()
            self.releases.clear()
        self.hello_commits.clear()
        self._close_local()
        unproven, self._unproven = self._unproven, None
        if unproven is not None and not same_server:
            self._close_unproven(unproven)  # proof of another server's pool: start again
            unproven = None
        if unproven is not None:          # the answer to the HELLO with the proof
            if h.get("local") is True:
                self.mover = unproven
                self.local = localread.attach(h, self.mover, self.epoch,
                                              self.limits.max_key_bytes)
                self.need_hello = False
                self._wb_after_hello(same_server)
                return
            self._close_unproven(unproven)
            if self.transport == "shm":
                raise TransportError(
                    f"the server at {address} did not see this client's proof of "
                    f"attaching {h['pool']['name']} (a liveness file in /dev/shm); is "
                    "/dev/shm the server's?")
            self.mover = self._pick_mover(h, address, shm=False)
            self.need_hello = False
            self._wb_after_hello(same_server)
            return
        m = self.mover
        if (same_server and isinstance(m, ShmMover) and not self.write_behind
                and self.wb is None and self._same_pool(m, h["pool"])):
            # The same server again (a HELLO after another thread's call timed out, a
            # ping, a reconnect): its pool is the one mapped. Keep that mapping and this
            # mover, proven again by the next HELLO: an operation of another thread
            # between two of its requests (a copy after ALLOC or LOOKUP, whose grants
            # moved over with the nonce) goes on with it. A new mover would make that
            # operation take the HELLO for a restart (_Restarted, "reset twice").
            # Not with write-behind: a HELLO resets the reservation, and retiring the
            # mover (its close waits for the copies into the old blocks, later ones
            # fail) is what keeps those copies out of blocks handed out again.
            self._unproven = m
            self.need_hello = False
            return
        self._retire_mover()
        self.mover = self._pick_mover(h, address)
        self.local = localread.attach(h, self.mover, self.epoch, self.limits.max_key_bytes)
        self.need_hello = False
        self._wb_after_hello(same_server)

    def _close_unproven(self, m: OneSidedMover) -> None:
        """Close a mover a HELLO proved nothing for. Since a HELLO to the same server
        keeps the mover in use (5786ce2), it may be :attr:`mover` with views of its pool
        still alive (BufferError from its close): retired as :meth:`_retire_mover` does,
        instead of the error out of the HELLO."""
        if m is self.mover:
            self.mover = None
        try:
            m.close()
        except BufferError:
            self._retired.append(m)

    def _same_pool(self, m: ShmMover, pool_info: dict[str, Any]) -> bool:
        """Whether ``m`` maps the pool a HELLO names (name and token), and this client's
        liveness proof of it is there."""
        pool = m.pool
        return (self.transport in ("auto", "shm") and not pool.closed
                and pool.name == pool_info.get("name")
                and segments.token_digest(pool.token) == pool_info.get("token_digest")
                and self._prove(pool))

    def local_reader(self) -> Any:
        """The shared-index reader when a read may skip the server now, else None (not
        local, HELLO due, or lazy commits of this client not yet sent: it must read its
        own writes)."""
        r = self.local
        if r is None or self.commits or self.need_hello:
            return None
        self.check_owner()          # a forked child fails at once, also without a request
        return r

    def _close_local(self) -> None:
        r, self.local = self.local, None
        if r is not None:
            try:
                r.close()
            except BufferError:       # a read runs in another thread: keep it mapped
                self._retired.append(r)

    def _prove(self, pool: Pool) -> bool:
        """Make (or keep) this client's liveness file for ``pool``."""
        p = self.proof
        name = segments.proof_name(pool.name, pool.token, self.nonce)
        if p is not None and p.name == name:
            return True
        if p is not None:
            p.close()
            self.proof = None
        try:
            self.proof = segments.ClientProof(pool.name, pool.token, self.nonce)
        except OSError as exc:
            log.debug("cannot make the liveness file for %s: %s", pool.name, exc)
            return False
        return True

    def _pick_mover(self, h: dict[str, Any], address: str, shm: bool = True
                    ) -> OneSidedMover | None:
        t = self.transport
        if t in ("auto", "shm") and shm:
            pool_info = h["pool"]
            try:
                # Pre-fault the mapping (no page faults in the first copies) only for pools
                # up to POPULATE_MAX_BYTES: beyond, every client would pay seconds and
                # megabytes of page tables for memory it may never touch.
                pool = Pool.attach(pool_info["name"],
                                   populate=int(pool_info["size"]) <= POPULATE_MAX_BYTES)
            except (OSError, ValueError) as exc:
                if t == "shm":
                    raise TransportError(
                        f"cannot attach the server's shared memory {pool_info['name']} "
                        f"({exc}); is the server at {address} on this host?") from None
                log.debug("shm attach failed (%s); trying the next mover", exc)
            else:
                if segments.token_digest(pool.token) == pool_info.get("token_digest") \
                        and self._prove(pool):
                    # used once the server saw the proof (the next HELLO's "local")
                    self._unproven = ShmMover(pool)
                    return None
                pool.close()
                if t == "shm":
                    raise TransportError(
                        f"segment {pool_info['name']} here is not the one the server at "
                        f"{address} uses (another host?)")
        if t in ("auto", "rdma"):
            from kvshm import rdma

            mover = rdma.client_mover(h, address, required=(t == "rdma"), session=self)
            if mover is not None:
                return mover
        return None

    def _retire_mover(self) -> None:
        if self.mover is not None:
            m, self.mover = self.mover, None
            try:
                m.close()
            except BufferError:
                self._retired.append(m)

    def close(self) -> None:
        self._close_local()
        self._retire_mover()
        w, self.last_watch = self.last_watch, None
        if w is not None:
            w.close()
        u, self._unproven = self._unproven, None
        if u is not None and u not in self._retired:  # (the kept mover: retired above)
            self._close_unproven(u)
        if self.proof is not None:
            self.proof.close()
            self.proof = None
        self.views_alive = False
        for m in self._retired:
            try:
                m.close()
            except BufferError:
                self.views_alive = True     # the caller still reads pinned pool memory
        self._retired.clear()
        if self.rdma is not None:
            self.rdma.close()

    @property
    def transport_name(self) -> str:
        return self.mover.name if self.mover is not None else "tcp"

    # ---------------------------------------------------------------- operations

    def _values(self, keys: list[bytes], values: Sequence[Any]) -> list[memoryview]:
        return self._views_sizes(keys, values)[0]

    def _views_sizes(self, keys: list[bytes], values: Sequence[Any]
                     ) -> tuple[list[memoryview], list[int]]:
        """Byte views of ``values`` and their sizes; raises what a bad value means."""
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if _batch is not None:      # one C loop; messages made only on failure
            return _batch.value_views(  # type: ignore[no-any-return]
                keys, values, self.capacity, self.limits.max_value_bytes or 0, byte_view,
                ValueTooLarge)
        views = [byte_view(v, what=f"value for key {k!r}") for k, v in zip(keys, values)]
        for k, v in zip(keys, views):
            if v.nbytes > self.capacity or (self.limits.max_value_bytes and
                                            v.nbytes > self.limits.max_value_bytes):
                raise ValueTooLarge(f"value for key {k!r} is {v.nbytes} bytes; the server "
                                    f"takes at most {self.limits.max_value_bytes or self.capacity}")
        return views, [v.nbytes for v in views]

    def raise_failures(self, keys: Sequence[bytes], statuses: Sequence[int],
                       what: str) -> None:
        if type(statuses) is list and statuses.count(_OK) == len(statuses):
            return                  # the common case, checked at C speed
        failed = {keys[i]: Status(s) for i, s in enumerate(statuses) if s != Status.OK}
        if not failed:
            return
        first_key, first = next(iter(failed.items()))
        more = f" (and {len(failed) - 1} more keys)" if len(failed) > 1 else ""
        why = first.name
        if first == Status.QUOTA_EXCEEDED:
            why += (": over this client's limit on uncommitted bytes (the server's "
                    "--max-client-pending, default 3/4 of the pool); write smaller batches")
        elif first == Status.POOL_FULL:
            why += ": nothing left to evict (every entry is pinned or being written)"
        elif first == Status.TOO_LARGE:
            why += f": larger than the pool ({self.capacity} bytes)"
        exc = error_for(first, f"{what} of key {first_key!r} failed: {why}{more}")
        exc.failed = failed  # type: ignore[attr-defined]
        raise exc

    def op_put_batch(self, keys: Iterable[Key], values: Sequence[Any],
                     checksum: bool, source: Any = None,
                     lazy: bool | None = None) -> OpGen:
        """Shared write path.

        ``source``, when given, provides the values instead of ``values`` (kvshm.paged:
        pages of a KV tensor, copied with one scatter): ``sizes`` (bytes per key),
        ``buffers()`` (the values as byte views, for TCP and checksums) and
        ``to_pool(mover, offsets, indices)`` (copy values ``indices`` to ``offsets``).
        ``lazy`` overrides the session's ``lazy_commit`` for this call (kvshm.layerwise).
        """
        self.raise_lost_commits()
        self.raise_wb_errors()
        bkeys = self.keys(keys)
        mover = self.mover
        frames: Any = None
        if source is None and _batch is not None and self.wb is None and not checksum \
                and (mover is None or self._inline_put(values, lazy)):
            # TCP, or small values of a same-host client (inline, see the module
            # docstring): sizes and packed frames straight from the values, one C loop
            if len(values) != len(bkeys):
                raise ValueError(f"{len(bkeys)} keys but {len(values)} values")
            sizes, frames, counts = _batch.pack_values(
                bkeys, values, self.capacity, self.limits.max_value_bytes or 0, byte_view,
                ValueTooLarge)
            if not bkeys:
                return None
            if mover is not None and not self._inline_fits(sizes):
                frames = None       # a large value after all: the ALLOC path below
        if frames is not None:
            r = yield _Req(Op.PUT, {"keys": bkeys, "sizes": sizes, "counts": counts},
                           frames)
            _check(r, "put")
            self.raise_failures(bkeys, r.body["st"], "put")
            return None
        if source is None and PACKED_PUT and _batch is not None and self.wb is None \
                and not checksum and type(mover) is ShmMover:
            # the values packed in one C loop (the checks and errors of _views_sizes),
            # copied by the mover in another: no object per value
            if len(values) != len(bkeys):
                raise ValueError(f"{len(bkeys)} keys but {len(values)} values")
            sizes, frames, counts = _batch.pack_values(
                bkeys, values, self.capacity, self.limits.max_value_bytes or 0, byte_view,
                ValueTooLarge)
            packed = PackedValues.of(frames, counts, sizes) if bkeys else None
            if packed is not None:      # (else the views below, checked again)
                source = _Packed(bkeys, packed, sizes)
        if source is None:
            views, vsizes = self._views_sizes(bkeys, values)
            wb = self.wb
            if wb is not None and bkeys and lazy is None and self.mover is wb.mover:
                return (yield from self.op_put_behind(bkeys, views, checksum))
            src: Any = _Buffers(bkeys, views, vsizes)
        else:
            src = source
        if not bkeys:
            return None
        if self.wb is not None and self.wb.placed:
            self.wb.placed.drop(bkeys)   # written again this way: no longer read from there
        body: dict[str, Any] = {"keys": bkeys}
        if checksum:
            body["sums"] = [_xxh(v) for v in src.buffers()]
        for attempt in range(2):
            mover = self.mover
            if mover is None:
                frames, counts = pack_frames(src.buffers())
                r = yield _Req(Op.PUT, {**body, "sizes": list(src.sizes), "counts": counts},
                               frames)
                _check(r, "put")
                self.raise_failures(bkeys, r.body["st"], "put")
                return None
            body["sizes"] = list(src.sizes)
            r = yield _Req(Op.ALLOC, body, stateful=True)
            _check(r, "put")
            if self.mover is not mover:     # HELLO again in between: new segment
                self.aborts.append(r.req_id)
                continue
            st, offsets = r.body.get("st"), r.body.get("offsets")
            if type(st) is not list or type(offsets) is not list \
                    or len(st) != len(bkeys) or len(offsets) != len(st):
                # (checked before anything is read from it: the grant the server may
                # hold is aborted, not left to its lease)
                self.aborts.append(r.req_id)
                raise ProtocolError(
                    f"ALLOC reply for {len(bkeys)} keys has "
                    f"{len(st) if type(st) is list else type(st).__name__} statuses and "
                    f"{len(offsets) if type(offsets) is list else type(offsets).__name__}"
                    " offsets")
            if st.count(_OK) == len(st):
                ok = list(range(len(st)))           # the common case, at C speed
                some = offsets
            else:
                if not all(type(s) is int and s in _STATUSES for s in st):
                    self.aborts.append(r.req_id)
                    bad = next(s for s in st if type(s) is not int or s not in _STATUSES)
                    raise ProtocolError(f"ALLOC reply for {len(bkeys)} keys has a status "
                                        f"{bad!r:.40} (no status)")
                ok = [i for i, s in enumerate(st) if s == Status.OK]
                some = [offsets[i] for i in ok]
            if ok:
                try:
                    # an offset that is no place in the pool (not an int nor runs:
                    # placed; negative or past the pool: the write's range check, before
                    # a byte of that value is written) is the reply's fault, not the
                    # caller's: ProtocolError
                    try:
                        # values of several runs: a mover that cuts at the runs' edges
                        mv, offs = placed(mover, some, Layout())
                    except (IndexError, TypeError, ValueError) as exc:
                        raise ProtocolError(f"ALLOC reply for {len(bkeys)} keys has an "
                                            f"offset that is no place: {exc}") from exc
                    try:
                        src.to_pool(mv, offs, ok)
                    except IndexError as exc:
                        raise ProtocolError(f"ALLOC reply for {len(bkeys)} keys has an "
                                            f"offset outside the pool: {exc}") from exc
                except BaseException:
                    self.aborts.append(r.req_id)
                    raise
                if self.lazy_commit if lazy is None else lazy:
                    self.commits.append(r.req_id)
                    self.lazy_rids[r.req_id] = None
                    while len(self.lazy_rids) > 65536:   # old ones long settled
                        self.resent_commits.discard(self.lazy_rids.popitem(last=False)[0])
                else:
                    # this put's own COMMIT carries it (not the queue of ids that ride on
                    # the next request, which may be another thread's: lost with that
                    # request, its timeout was that thread's, and this put said stored)
                    try:
                        c = yield _Req(Op.COMMIT, {"commit": [r.req_id]}, stateful=True,
                                       retry_stale=False)
                    except _Restarted:
                        if attempt:
                            raise
                        continue
                    _check(c, "commit")
                    if r.req_id in c.body.get("commit_failed", ()):
                        raise LeaseExpired(
                            f"the write of {len(ok)} keys was reclaimed before COMMIT "
                            "(lease timeout); nothing was stored")
            self.raise_failures(bkeys, st, "put")
            return None
        raise ServerUnavailable("the session was reset twice during one put (a server "
                                "restart, or a HELLO of another thread's ping); retry")

    def _inline_put(self, values: Sequence[Any], lazy: bool | None) -> bool:
        """Whether a shm put_batch of ``values`` may go inline (one PUT carrying the
        values, as over TCP) rather than ALLOC + copy + COMMIT: switched on, the shm
        mover, not lazily committed, and a first value that looks small (the rest are
        checked once packed)."""
        if not INLINE_PUT or self.mover is None or self.mover.name != "shm":
            return False
        if self.lazy_commit if lazy is None else lazy:
            return False
        if not values:
            return True
        v = values[0]
        n = len(v) if type(v) is bytes else -1
        return n <= INLINE_PUT_MAX

    def _inline_fits(self, sizes: list[int]) -> bool:
        """Whether packed values of ``sizes`` (bytes) may go inline: each at most
        INLINE_PUT_MAX, together at most INLINE_PUT_TOTAL, and their blocks (at most
        ``len(sizes) * ceil(max / block_size)``) at most half the pool and at most the
        pending limit HELLO announced (a server that announces none: never), so that
        ALLOC would have refused none of them for quota that PUT grants (see the module
        docstring for what is left)."""
        top = max(sizes)
        if top > INLINE_PUT_MAX or sum(sizes) > INLINE_PUT_TOTAL:
            return False
        h = self.hello
        limit = h.get("pending_limit")
        bs = int(h.get("pool", {}).get("block_size", 0) or 0)
        if type(limit) is not int or limit < 0 or bs <= 0:
            return False
        need = len(sizes) * max(1, -(-top // bs)) * bs
        return 2 * need <= self.capacity and (limit == 0 or need <= limit)

    def op_put_behind(self, bkeys: list[bytes], views: list[memoryview],
                      checksum: bool) -> OpGen:
        """Write-behind put: copy into reserved blocks, send PLACE, do not wait.

        Falls back to the ALLOC/COMMIT path when the values do not fit what is
        reserved (nothing reserved yet and a refill in flight, quota, a value larger
        than half the reservation).
        """
        wb = self.wb
        assert wb is not None
        epoch = self.epoch
        need = [wb.nblocks(v.nbytes) for v in views]
        total = sum(need)
        got = None
        if total * 2 <= wb.want:
            got = wb.take(need)
            if got is None and wb.claim_reserve():
                # dry (or reset due): one round trip for the reservation, one such
                # RESERVE at a time (see claim_reserve)
                try:
                    reset = not wb.gen
                    try:
                        r = yield _Req(Op.RESERVE,
                                       {"blocks": wb.want - (0 if reset else wb.free),
                                        "reset": reset},
                                       stateful=True, retry_stale=False)
                    except _Restarted:
                        r = None
                    if r is not None and r.status == Status.OK and self.wb is wb:
                        wb.apply_reserve(r.body, reset)
                        got = wb.take(need)
                finally:
                    wb.reserving = False
        if got is None:
            return (yield from self.op_put_batch(bkeys, views, checksum, lazy=False))
        gen, runs, mover, bs = got
        sizes = [v.nbytes for v in views]
        try:
            sums = [_xxh(v) for v in views] if checksum else None
            with mover.copying() as pool:
                for v, ext in zip(views, runs):
                    pos = 0
                    n = v.nbytes
                    for b0, c in ext:
                        k = min(c * bs, n - pos)
                        if k <= 0:
                            break
                        pool.stream_write(b0 * bs, v[pos:pos + k])
                        pos += k
        finally:
            wb.copy_done()
        extents = [[(b0 * bs, c * bs) for b0, c in ext] for ext in runs]
        body: dict[str, Any] = {"gen": gen, "keys": bkeys, "sizes": sizes, "runs": runs}
        if sums is not None:
            body["sums"] = sums

        def sent(rid: int) -> None:
            if self.wb is not wb or self.epoch != epoch:
                # the HELLO before this PLACE found another server: the copy went into
                # the old pool, its reservation is gone (the PLACE is refused there):
                # lost, raised by the next call (not read back from the new pool)
                self.wb_lost.extend(bkeys)
                return
            with wb.placed.lock:
                wb.outstanding[rid] = bkeys
            if wb.gen != gen:
                # a HELLO voided the reservation since the blocks were taken: a reset
                # may give them to other keys before this PLACE's reply (refused, or
                # done) is read, so it is not read back from them (see _put_behind)
                return
            wb.placed.add(rid, bkeys, sizes, extents, sums)

        if wb.gen != gen:       # (voided already: the general path, as _put_behind)
            return (yield from self.op_put_batch(bkeys, views, checksum, lazy=False))
        yield _Req(Op.PLACE, body, stateful=True, noreply=sent)
        if wb.low() and wb.gen == gen and self.wb is wb:
            def asked(rid: int) -> None:
                wb.reserve_rid = rid

            yield _Req(Op.RESERVE, {"blocks": wb.want - wb.free, "reset": False},
                       stateful=True, noreply=asked)
        return None

    def op_sync_behind(self) -> OpGen:
        """One round trip: every reply to PLACE/RESERVE sent before it is read by then
        (the server answers one connection in order)."""
        r = yield _Req(Op.COMMIT, {}, stateful=True, retry_stale=False)
        _check(r, "flush")
        return None

    def op_lookup_copy(self, keys: Iterable[Key], outs: Sequence[Any] | None,
                       verify: bool, sink: Any = None, _again: bool = False) -> OpGen:
        """Shared read path: returns (sizes, data) where data is bytes per hit or None
        (with ``outs``: a view of ``outs[i]`` per hit, or all None over TCP, where the
        values are copied into ``outs`` without views; callers with ``outs`` read sizes).

        ``sink``, when given (with ``outs=None``), places the hits itself (kvshm.paged):
        ``from_pool(mover, offsets, sizes, indices)`` with a one-sided mover,
        ``from_frame(index, buffer)`` over TCP; ``data`` is then all None.
        """
        bkeys = self.keys(keys)
        views = None
        if outs is not None:
            if len(outs) != len(bkeys):
                raise ValueError(f"{len(bkeys)} keys but {len(outs)} output buffers")
            if _batch is not None and sink is None and not verify and self.mover is None \
                    and self.wb is None and self.local is None:
                # TCP: one GET, the values copied straight into ``outs`` (no view made
                # unless something is unusual); ``data`` is then all None
                _batch.check_outs(bkeys, outs, byte_view)   # refuses as byte_view would
                if not bkeys:
                    return [], []
                r = yield _Req(Op.GET, {"keys": bkeys}, into=_frames.into(outs, _out_view))
                return self.got(bkeys, None, None, False, r, outs)
            if _batch is not None:      # one C loop; messages made only on failure
                views = _batch.out_views(bkeys, outs, byte_view)
            else:
                views = [byte_view(o, writable=True, what=f"output for key {k!r}")
                         for k, o in zip(bkeys, outs)]
        if not bkeys:
            return [], []
        wb = self.wb
        if wb is not None and wb.placed and self.placed_any(bkeys):
            if sink is None and not verify and all(k in wb.placed for k in bkeys):
                got = self._read_placed(bkeys, views)    # own writes, not yet answered
                if got is not None:
                    return got
            try:       # the others too: once the server has them all, ask as usual
                yield from self.op_sync_behind()
            except _Restarted:
                pass
        lr = self.local_reader()
        if lr is not None and not verify:
            done = localread.read_batch(lr, bkeys, views, sink, self.mover)
            if done is not None:
                return done
        mover = self.mover
        if mover is None:
            r = yield _Req(Op.GET, {"keys": bkeys})
            return self.got(bkeys, views, sink, verify, r)
        r = yield _Req(Op.LOOKUP, {"keys": bkeys}, stateful=True)
        _check(r, "get")
        if self.mover is not mover and not _again:
            # HELLO again in between (the server restarted, STALE_EPOCH): look up again
            # through the new mover, as a put allocates again
            self.releases.append(r.req_id)
            return (yield from self.op_lookup_copy(bkeys, outs, verify, sink, True))
        try:        # (a reply whose sizes or places do not fit the keys asked, the pool)
            sizes = sizes_of(r.body, len(bkeys), "LOOKUP", self.capacity)
            offsets = places_of(r.body, sizes, self.capacity)
            sums = sums_of(r.body, len(bkeys), "LOOKUP") if verify else None
        except ProtocolError as exc:
            self.releases.append(r.req_id)      # whatever it pinned goes
            raise ProtocolError(f"{exc} (from {self.hello.get('server')})") from None
        if -2 in sizes:      # the server's per-client pin limit (store.QUOTA_REFUSED)
            self.releases.append(r.req_id)
            refused = [bkeys[i] for i, s in enumerate(sizes) if s == -2]
            raise QuotaExceeded(f"reading {len(refused)} keys (first {refused[0]!r}) would "
                                "exceed this client's pin limit on the server; read in "
                                "smaller batches")
        hits = [i for i, s in enumerate(sizes) if s >= 0]
        data: list[Any] = [None] * len(sizes)
        if not hits:
            return sizes, data
        try:
            if self.mover is not mover:
                raise _Restarted("the server restarted during a get; retry")
            hs = [sizes[i] for i in hits]
            hk = [bkeys[i] for i in hits]
            # values of several runs: a mover that cuts at the runs' edges
            mover, ho = placed(mover, [offsets[i] for i in hits], Layout())
            if sink is not None:
                sink.from_pool(mover, ho, hs, hits)
            elif views is not None:
                hv = [views[i] for i in hits]
                for k, v, s in zip(hk, hv, hs):
                    self._check_out(k, v, s)
                mover.read_into(ho, hs, hv, hk)
                for i in hits:
                    data[i] = views[i][:sizes[i]]
            else:
                for i, b in zip(hits, mover.read_bytes(ho, hs, hk)):
                    data[i] = b
        finally:
            # The pins go only after the copy: until then the blocks cannot be reused.
            self.releases.append(r.req_id)
        if verify:
            self._verify(bkeys, sizes, sums, data)
        return sizes, data

    def got(self, bkeys: Sequence[bytes], views: Sequence[memoryview] | None, sink: Any,
            verify: bool, r: _Reply, outs: Sequence[Any] | None = None
            ) -> tuple[list[int], list[Any]]:
        """``(sizes, data)`` of a GET reply (the TCP mover), as :meth:`op_lookup_copy`
        returns them; raises what a refused or malformed reply means. ``outs`` (instead
        of ``views``, no sink, no verify): the caller's output buffers, filled in C where
        they are plain buffers; ``data`` is then all None.

        Raises ProtocolError for a reply that does not fit the keys asked: sizes not one
        int per key (-2, -1 or 0 .. the pool's size), counts not a list of ints, frames
        that do not add up to the hits, sums not one per key (``verify``)."""
        _check(r, "get")
        try:
            sizes = sizes_of(r.body, len(bkeys), "GET", self.capacity)
            sums = sums_of(r.body, len(bkeys)) if verify else None
        except ProtocolError as exc:
            raise ProtocolError(f"{exc} (from {self.hello.get('server')})") from None
        if -2 in sizes:     # the server's per-principal limit on unsent replies
            refused = [bkeys[i] for i, sz in enumerate(sizes) if sz == -2]
            raise QuotaExceeded(f"reading {len(refused)} keys (first {refused[0]!r}) "
                                "would exceed this client's limit on pinned and "
                                "unsent bytes on the server; read in smaller batches")
        counts = r.body.get("counts", [1] * len(r.frames))
        if type(counts) is not list:
            raise ProtocolError(f"GET reply from {self.hello.get('server')}: counts of "
                                f"{type(counts).__name__} (a list wanted)")
        if outs is not None:
            try:        # received straight into ``outs`` (the ZMTP transport: _Req.into)
                if _frames.placed(r.frames, counts, sizes):
                    return sizes, [None] * len(sizes)
            except FrameLayoutError as exc:
                raise ProtocolError(f"GET reply from {self.hello.get('server')}: "
                                    f"{exc}") from None
            if _batch is not None and type(sizes) is list and \
                    _batch.fill_outs(r.frames, counts, sizes, outs):
                return sizes, [None] * len(sizes)
            views = [byte_view(o, writable=True, what=f"output for key {k!r}")
                     for k, o in zip(bkeys, outs)]
            sizes, _ = self.got(bkeys, views, None, False, r)
            return sizes, [None] * len(sizes)
        if _batch is not None and sink is None and type(sizes) is list:
            # one C loop; None: something unusual, which the loop below words
            fast = _batch.fill(r.frames, counts, sizes,
                               None if views is None else list(views))
            if fast is not None:
                if verify:
                    self._verify(bkeys, sizes, sums, fast)
                return sizes, fast
        hit_sizes = [s for s in sizes if s >= 0]
        try:
            values = unpack_frames(r.frames, counts, hit_sizes)
        except FrameLayoutError as exc:
            raise ProtocolError(f"GET reply from {self.hello.get('server')}: {exc}") \
                from None
        data: list[Any] = [None] * len(sizes)
        j = 0
        for i, sz in enumerate(sizes):
            if sz < 0:
                continue
            v = values[j]
            j += 1
            if sink is not None:
                sink.from_frame(i, v)
            elif views is not None:
                self._check_out(bkeys[i], views[i], sz)
                views[i][:sz] = v
                data[i] = views[i][:sz]
            else:
                data[i] = v.tobytes()
        if verify:
            self._verify(bkeys, sizes, sums, data)
        return sizes, data

    def _read_placed(self, bkeys: Sequence[bytes], views: Sequence[memoryview] | None
                     ) -> tuple[list[int], list[Any]] | None:
        wb = self.wb
        assert wb is not None
        sizes: list[int] = []
        data: list[Any] = []
        with wb.mover.copying() as pool:
            for i, k in enumerate(bkeys):
                if views is not None:
                    n = wb.placed.get_into(pool, k, views[i])
                    if n == localread.MISS:
                        return None          # answered meanwhile: ask as usual
                    sizes.append(n)
                    data.append(views[i][:n])
                else:
                    b = wb.placed.get(pool, k)
                    if b is None:
                        return None
                    sizes.append(len(b))
                    data.append(b)
        return sizes, data

    @staticmethod
    def _check_out(key: bytes, view: memoryview, size: int) -> None:
        if view.nbytes < size:
            raise ValueError(f"output buffer for key {key!r} holds {view.nbytes} bytes; "
                             f"the value is {size} bytes")

    @staticmethod
    def _verify(keys: Sequence[bytes], sizes: Sequence[int], sums: Sequence[Any] | None,
                data: Sequence[Any]) -> None:
        for i, d in enumerate(data):
            if d is None:
                continue
            want = sums[i] if sums else None
            if want is None:
                raise CorruptValue(f"key {keys[i]!r} was stored without a checksum; "
                                   "put it with checksum=True to verify it")
            if _xxh(memoryview(d)[:sizes[i]]) != want:
                raise CorruptValue(f"value of key {keys[i]!r} does not match its checksum")

    def op_exists_parts(self, bkeys: list[bytes], k: int) -> Generator[Any, Any, Any]:
        """EXISTS of ``bkeys`` as parts of ``k`` keys, pipelined (a :class:`_Many`:
        :class:`Client` only); found per key, as the one request's. A refused part
        raises what the one request would have raised."""
        rs = yield _Many([_Req(Op.EXISTS, _KeysPart(bkeys, i, min(i + k, len(bkeys))))  # type: ignore[arg-type]
                          for i in range(0, len(bkeys), k)])
        found: list[bool] = []
        for j, r in enumerate(rs):
            _check(r, "exists")
            found += found_of(r.body, min(k, len(bkeys) - j * k))
        return found

    def op_put_parts(self, keys: Sequence[Key], values: Sequence[Any], k: int
                     ) -> Generator[Any, Any, Any]:
        """put_batch over TCP (no mover, no checksum, not written behind) as PUTs of
        ``k`` keys, pipelined (a :class:`_Many`: :class:`Client` only). Each part packed
        as the one request's (``_batch.pack_values``: its checks and errors, raised
        before anything is sent); the statuses put together in key order; a refused
        part raises what the one request would have (the first refused part's), and
        the keys of the parts before it are stored, as the keys of a batch that fails
        part-way are."""
        self.raise_lost_commits()
        self.raise_wb_errors()
        bkeys = self.keys(keys)
        if len(values) != len(bkeys):
            raise ValueError(f"{len(bkeys)} keys but {len(values)} values")
        reqs = []
        for i in range(0, len(bkeys), k):
            part = bkeys[i:i + k]
            sizes, frames, counts = _batch.pack_values(
                part, values[i:i + k], self.capacity, self.limits.max_value_bytes or 0,
                byte_view, ValueTooLarge)
            reqs.append(_Req(Op.PUT, {"keys": part, "sizes": sizes, "counts": counts},
                             frames))
        rs = yield _Many(reqs)
        st: list[int] = []
        for r in rs:
            _check(r, "put")
            st += r.body["st"]
        self.raise_failures(bkeys, st, "put")
        return None

    def op_simple(self, op: int, body: dict[str, Any], what: str) -> OpGen:
        r = yield _Req(op, body)
        _check(r, what)
        return r.body

    def op_commit_flush(self) -> OpGen:
        try:
            r = yield _Req(Op.COMMIT, {}, stateful=True, retry_stale=False)
        except _Restarted:
            # the new HELLO found the writes made behind lost: flush() says which
            self.raise_wb_errors()
            raise
        _check(r, "flush")
        self.raise_lost_commits()    # note_reply saw this reply's commit_failed already
        self.raise_wb_errors()       # the PLACE replies before it were read by now
        return None


_GRANT_OPS = (Op.ALLOC, Op.LOOKUP)
# the statuses a reply may give (an ALLOC reply's "st" items are checked against them)
_STATUSES = frozenset(int(s) for s in Status)

# what a driver does with a reply (_Drive.after)
_DONE = 0          # hand it to the operation
_HELLO_RETRY = 1   # say HELLO, then send the request again
_HELLO_THROW = 2   # say HELLO, then throw _Restarted into the operation


class _Drive:
    """One operation being driven: the part of the driver that sync and async share.

    :class:`Client` drives it with blocking round trips, :class:`kvshm.aio.AsyncClient`
    with awaits; everything that decides what is sent, what a reply means and what is
    owed to the server when the operation ends early lives here, once:

    * :meth:`prepare` gives each request its id (from the session: unique for the
      client's life), takes the piggybacked COMMIT/ABORT/RELEASE lists, and records the
      grant an ALLOC or LOOKUP may create.
    * :meth:`failed` (the request may or may not have reached the server: timeout, send
      failure, cancellation) puts back the RELEASE/ABORT ids it carried (both
      idempotent) and queues RELEASE/ABORT of the grant it may have made, so a request
      that times out never leaves pins or pending blocks behind; the server also drops
      a parked request that such a RELEASE/ABORT names.
    * :meth:`abandon` (the operation ends by an exception or is cancelled) settles every
      grant it made: ABORT for ALLOCs not committed yet, RELEASE for LOOKUPs.
    """

    __slots__ = ("s", "gen", "grants", "body", "rid")

    def __init__(self, session: "_Session", gen: OpGen) -> None:
        self.s = session
        self.gen = gen
        self.grants: list[tuple[int, int]] = []
        self.body: dict[str, Any] | None = None
        self.rid = 0

    def start(self) -> tuple[bool, Any]:
        """(False, first request) or (True, result)."""
        return self.step(self.gen.send, None)

    @staticmethod
    def step(fn: Callable[[Any], Any], arg: Any) -> tuple[bool, Any]:
        """Advance the operation: (False, next request) or (True, its result).
        StopIteration must not cross a thread or an asyncio future, so it ends here."""
        try:
            return False, fn(arg)
        except StopIteration as stop:
            return True, stop.value

    def prepare(self, req: _Req, piggyback: bool = True) -> tuple[int, dict[str, Any]]:
        """(request id, body to send) for ``req``."""
        s = self.s
        rid = s.new_id()
        body = s.take_piggyback(req.body) if piggyback else req.body
        self.body = body if body is not req.body else None
        self.rid = rid
        if req.op in _GRANT_OPS:
            self.grants.append((rid, req.op))
        return rid, body

    def failed(self) -> None:
        """The request prepared last may not have reached the server (or its reply
        was lost): give back what it carried and what it may hold."""
        if self.body is not None:
            self.s.requeue(self.body, failed=True)
            self.body = None
        self.abandon()

    def after(self, req: _Req, reply: _Reply) -> int:
        """What to do with ``reply`` (_DONE, _HELLO_RETRY, _HELLO_THROW)."""
        body, self.body = self.body, None
        if reply.status != Status.STALE_EPOCH:
            self.s.note_reply(reply.body)
            return _DONE
        if body is not None:       # not applied: they go again (after HELLO)
            self.s.requeue(body, unapplied=True)
        # the server restarted, or does not know this session: nothing was done; the
        # grant this request would have made does not exist
        if self.grants and self.grants[-1][0] == reply.req_id:
            self.grants.pop()
        self.s.need_hello = True
        if req.stateful and not req.retry_stale:
            return _HELLO_THROW
        return _HELLO_RETRY

    def abandon(self) -> None:
        """Settle every grant of this operation on the server (it ended early). Safe to
        repeat: RELEASE and ABORT of a settled grant do nothing, ids are never reused."""
        s = self.s
        for rid, op in self.grants:
            if op == Op.ALLOC:
                try:
                    s.commits.remove(rid)     # written but not committed yet: drop it
                except ValueError:
                    pass
                if rid not in s.aborts:
                    s.aborts.append(rid)
            elif rid not in s.releases:
                s.releases.append(rid)

    def close(self) -> None:
        self.gen.close()
        self.abandon()



class _PlaceFlusher:
    """The thread that sends a write-behind client's held PLACE once it is PLACE_HOLD_S
    old and no later call sent it (:meth:`Client._flush_held`). It holds its client
    weakly and ends with it (:meth:`stop`, from ``Client.close``)."""

    def __init__(self, client: "Client") -> None:
        self._client = weakref.ref(client)
        self._wake = threading.Event()
        self._stopped = False
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._loop, name="kvshm-place-flush",
                                       daemon=True)
        self.thread.start()
        weakref.finalize(client, self._end)    # a client dropped without close()

    def _end(self) -> None:
        self._stopped = True
        self._wake.set()

    def kick(self) -> None:
        """A PLACE is held now: look at it PLACE_HOLD_S from now."""
        self._wake.set()

    def stop(self) -> None:
        self._end()
        if self.thread is not threading.current_thread() and self.pid == os.getpid():
            self.thread.join(5)

    def _loop(self) -> None:
        wait = PLACE_HOLD_S
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            while not self._stopped:
                time.sleep(wait)
                c = self._client()
                if c is None:
                    return
                left = c._flush_held()
                del c
                if left is None:
                    wait = PLACE_HOLD_S
                    break
                wait = max(left, 1e-4)


class Client:
    """Synchronous kvshm client.

    Parameters
    ----------
    address : str
        ``host:port`` of the server's service port (``tcp://``/``ipc://`` endpoints too).
    transport : {"auto", "shm", "tcp", "rdma"}
        How bytes move (see the module docstring).
    timeout : float
        Seconds to wait for any one reply; every wait is bounded by it and a timeout
        raises :class:`~kvshm.errors.ServerUnavailable` naming the server.
    lazy_commit : bool
        Let COMMIT ride on the next request instead of its own round trip: a write is
        then visible to other clients only after this client's next request or
        :meth:`flush`.
    curve_server_key : bytes or str, optional
        The server's CurveZMQ public key: 40 Z85 characters, or its ``.key`` file. Needed
        when the server runs with ``--curve-secret-key``.
    curve_keypair : (public, secret) or str, optional
        This client's CurveZMQ key pair (Z85), or its ``.key_secret`` file; generated
        when not given (enough unless the server restricts client keys).
    connect : bool
        Say HELLO now (default); otherwise on the first call.
    rdma : kvshm.rdma.RdmaOptions or dict, optional
        Device, port, GID index and queue sizes for ``transport="rdma"``/``"auto"``
        (default: the first device with an active port 1; see ``docs/RDMA.md``).
    token : bytes, optional
        The server's door token (32 bytes). Default: read from ``token_file``,
        ``$KVSHM_TOKEN_FILE``, or the default token file of a server of this user
        (:mod:`kvshm.security`); a CURVE connection needs none.
    token_file : str, optional
        Path of the server's token file (the server's ``--token-file``).
    operator_token : bytes, optional
        The server's operator token (DRAIN, PURGE, EVICT). Default: read from the
        default operator token file of a server of this user on this host, if any
        (:mod:`kvshm.security`); a local client of the server's uid needs none.
    write_behind : bool or int
        Same-host writes that do not wait (off by default). When the client is local
        (the shm mover, liveness proven) it keeps a reservation of free pool blocks
        (True: ``WRITE_BEHIND_BYTES`` = 32 MiB, an int: that many bytes; at most 1/16 of
        the pool), refilled ahead of need; a put copies the value into reserved
        blocks and sends PLACE without waiting for the reply. This client reads its own
        writes at once; other clients see them once the server processed the PLACE
        (puts that come quickly, or while ``PLACE_WINDOW`` PLACEs are unanswered, are
        held and sent as one PLACE: within ``PLACE_HOLD_S`` = 1 ms, and before this
        client's next request of another kind); :meth:`flush` waits for all. A write
        the server refused raises
        :class:`~kvshm.errors.WriteRefused` (naming keys and reasons) from the next
        call, one it never acknowledged (server restart, connection reset)
        :class:`~kvshm.errors.WritesLost`. Values larger than half the reservation,
        remote clients and ``put_batch(..., pin_ttl=...)`` take the ALLOC/COMMIT path.
        Reserved blocks are held from the pool (and count against the pending quota), so the
        pool behaves as slightly smaller than an exact LRU of its size.

    Raises
    ------
    ServerUnavailable
        The server did not answer HELLO within ``timeout``.
    WriteRefused, WritesLost
        From any call after a write made behind failed (see ``write_behind``).
    AuthenticationFailed
        The server refused the CURVE handshake (missing or wrong keys), or the HELLO
        (no valid door token).
    TransportError
        ``transport="shm"`` or ``"rdma"`` was asked and cannot be used.

    Notes
    -----
    One client may be shared by threads: requests are serialized on its connection,
    copies run in parallel with the GIL released. RELEASE (and COMMIT with
    ``lazy_commit``) ride on the next request; :meth:`flush` sends them now.
    """

    def __init__(self, address: str = "127.0.0.1:12345", transport: str = "auto",
                 timeout: float = 5.0, *, lazy_commit: bool = False,
                 curve_server_key: bytes | str | None = None,
                 curve_keypair: tuple[bytes, bytes] | str | None = None,
                 connect: bool = True, context: zmq.Context | None = None,
                 rdma: Any = None, token: bytes | None = None,
                 token_file: str | None = None,
                 operator_token: bytes | None = None,
                 write_behind: bool | int = False) -> None:
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.address = address
        self._base_endpoint = endpoint_of(address)
        check_resolvable(self._base_endpoint)
        self._session = _Session(transport, lazy_commit, rdma,
                                 _door_token(self._base_endpoint, token, token_file),
                                 write_behind)
        self._session.operator_token = _operator_token(self._base_endpoint, operator_token)
        self._chan = Channel(self._base_endpoint, timeout, context=context,
                             socket_setup=_curve_setup(curve_server_key, curve_keypair),
                             label=address)
        self._chan.on_stray = self._session.late_reply
        self._closed = False
        self._timer: threading.Timer | None = None
        self._timer_lock = threading.Lock()
        self._flusher: _PlaceFlusher | None = None    # made by the first held PLACE
        if connect:
            with self._chan.lock:
                self._hello_locked()

    # ---------------------------------------------------------------- plumbing

    def _hello_locked(self) -> None:
        s = self._session
        s.check_owner()
        s.need_hello = True
        if s.wb is not None and s.wb.outstanding:
            try:
                # replies already here are not lost with the socket (all of them: the
                # bound is for floods, not for what this client has in flight)
                self._chan.drain(max(DRAIN_MAX, 2 * len(s.wb.outstanding) + 2))
            except ProtocolError:
                pass                # (reset: the writes it left unanswered are reported lost)
        self._chan.reset(self._base_endpoint)
        s.check_gone(self._base_endpoint)
        for _ in range(4):
            rid = s.new_id()
            # the queued settle lists ride on it: applied to the old session first
            hb = s.hello_body()
            body = s.hello_piggyback(hb)
            try:
                rid, st, rbody, frames = self._chan.request(Op.HELLO, body, req_id=rid,
                                                            epoch=s.epoch)
            except BaseException:
                if body is not hb:
                    # its lazy COMMITs go again on the next HELLO (queued: no longer
                    # this HELLO's), as a failed request's (_Drive.failed)
                    com = body.get("commit")
                    if com:
                        s.hello_commits = [r for r in s.hello_commits if r not in com]
                    s.requeue(body, failed=True)
                raise
            s.apply_hello(_Reply(rid, st, rbody, frames), self.address)
            # replies are bounded by what this server's pool can hold (a larger one:
            # ProtocolError, nothing allocated for it)
            self._chan.bound_replies(s.limits.reply_bound(s.capacity))
            # a same-host client proves its liveness file; transport="auto" with RDMA on
            # both sides offers a QP (docs/RDMA.md): each is one more HELLO
            if not s.hello_again():
                break
            ipc = s.ipc_for_proof(self._chan.endpoint)
            if ipc is not None:
                # the HELLO with the proof goes on the server's ipc endpoint (a new
                # socket, so a new routing id: its session is opened there)
                self._chan.reset(ipc)
        self._chan.watch = s.server_watch(self._chan.endpoint)

    def _roundtrip(self, drive: _Drive, req: _Req) -> _Reply:
        if self._closed:
            raise KvshmError("client is closed")
        s = self._session
        if req.noreply is not None:
            return self._send_only(drive, req)
        with self._chan.lock:
            for attempt in range(3):
                if s.need_hello:
                    self._hello_locked()
                if s.wb is not None and s.wb.held_rid:
                    self._send_held_locked()    # this client's writes reach it in order
                rid, body = drive.prepare(req)
                try:
                    kw: dict[str, Any] = {} if req.into is None else {"into": req.into}
                    rid, st, rbody, frames = self._chan.request(
                        req.op, body, req.frames, req_id=rid, epoch=s.epoch, **kw)
                except BaseException as exc:
                    if not _gone_unsent(exc):
                        # timed out, send failed, interrupted: the server may hold what
                        # this request made; RELEASE/ABORT it with the next request
                        drive.failed()
                        s.need_hello = True
                        raise
                    # the same-host server is gone and the request was not sent: as
                    # STALE_EPOCH (HELLO at the address, go again)
                    st, rbody, frames = Status.STALE_EPOCH, {}, []
                reply = _Reply(rid, st, rbody, frames)
                what = drive.after(req, reply)
                if what == _DONE:
                    return reply
                self._hello_locked()
                if what == _HELLO_THROW:
                    raise _Restarted(f"kvshm server at {self.address} restarted during "
                                     "the operation")
        raise ServerUnavailable(f"kvshm server at {self.address} keeps forgetting this "
                                "client's session; retry")

    def _roundtrip_many(self, drive: _Drive, many: _Many) -> list[_Reply]:
        """:meth:`_roundtrip` of several requests, pipelined
        (:meth:`Channel.request_many`). The settles due ride on the first; a part
        answered STALE_EPOCH (the server restarted, or forgot this session) is sent again
        after a HELLO, as :meth:`_roundtrip` sends a request again, the parts answered
        kept (the old server did them, as it may have done a request it then lost)."""
        if self._closed:
            raise KvshmError("client is closed")
        s = self._session
        out: list[_Reply | None] = [None] * len(many.reqs)
        todo = list(range(len(many.reqs)))
        with self._chan.lock:
            for attempt in range(3):
                if s.need_hello:
                    self._hello_locked()
                if s.wb is not None and s.wb.held_rid:
                    self._send_held_locked()
                items = []
                first_body = None
                try:
                    for j, i in enumerate(todo):
                        req = many.reqs[i]
                        assert not req.stateful and req.noreply is None
                        part = req.body
                        if j == 0 and type(part) is _KeysPart:
                            req = req._replace(body=part.body())  # settles may ride on it
                        rid, body = drive.prepare(req, piggyback=j == 0)
                        if j == 0:
                            first_body = drive.body
                        elif type(body) is _KeysPart:
                            body = body.header(req.op, rid, s.epoch)  # type: ignore[assignment]
                        items.append((req.op, body, req.frames, rid))
                except BaseException:
                    # (packing the parts: an interrupt, MemoryError) nothing was sent:
                    # the settles the first part took go again, lazy COMMITs with them
                    drive.body = None
                    if first_body is not None:
                        s.requeue(first_body, unapplied=True)
                    raise
                drive.body = first_body
                try:
                    got = self._chan.request_many(items, epoch=s.epoch)
                except BaseException as exc:
                    if not _gone_unsent(exc):
                        drive.failed()      # (as _roundtrip: settles go again)
                        s.need_hello = True
                        raise
                    got = [(rid, Status.STALE_EPOCH, {}, []) for _, _, _, rid in items]
                stale = []
                for j, (i, g) in enumerate(zip(todo, got)):
                    if g[1] == Status.STALE_EPOCH:
                        if j == 0 and first_body is not None:
                            # not applied: they go again, the lazy COMMITs on the HELLO
                            # (reported lost if it finds another server), as drive.after
                            s.requeue(first_body, unapplied=True)
                        stale.append(i)
                    else:
                        s.note_reply(g[2])
                        out[i] = _Reply(g[0], g[1], g[2], g[3])
                drive.body = None
                if not stale:
                    return out  # type: ignore[return-value]
                s.need_hello = True
                todo = stale
        raise ServerUnavailable(f"kvshm server at {self.address} keeps forgetting this "
                                "client's session; retry")

    def _send_only(self, drive: _Drive, req: _Req) -> _Reply:
        s = self._session
        with self._chan.lock:
            if s.need_hello:
                self._hello_locked()
            if s.wb is not None and s.wb.held_rid:
                self._send_held_locked()
            self._drain_locked()        # replies already here: refusals, refills
            rid, body = drive.prepare(req)
            assert req.noreply is not None
            req.noreply(rid)
            try:
                self._chan.send(req.op, body, req.frames, req_id=rid, epoch=s.epoch)
            except BaseException:
                drive.failed()
                s.need_hello = True
                s.unsent(rid)         # not sent: this call's exception says so
                raise
        return _Reply(rid, Status.OK, {}, [])

    # ------------------------------------------------------ one-key requests (lean)
    #
    # A single-key put / get / get_into / exists through the server's own messages (the
    # TCP mover: no offsets, no grants) is one request and one reply. These paths do
    # what _run + _roundtrip do for such an operation, without the generator and
    # _Drive machinery; each is taken only when nothing else is due (HELLO, errors to
    # report, a local reader, writes behind), else the general path runs and raises
    # what it raises. The messages are the same.

    def _lean(self) -> "_Session | None":
        """The session when a one-key request may take the lean path now, else None."""
        s = self._session
        if (s.mover is None and s.wb is None and s.local is None and not s.need_hello
                and not self._closed and not s.lost_commits and not s.wb_lost
                and not s.wb_refused and s.pid == _pid[0]):
            return s
        return None

    def _call1(self, op: int, body: dict[str, Any], frames: Sequence[Any] = ()
               ) -> tuple[int, dict[str, Any], list[Any]]:
        """One request of an operation that holds no grants and may be sent again
        after a HELLO (as _roundtrip with a fresh _Drive): ``(status, body, frames)``
        of its reply, never STALE_EPOCH."""
        s = self._session
        chan = self._chan
        try:
            with chan.lock:
                for _ in range(3):
                    if s.need_hello:
                        self._hello_locked()
                    rid = s.new_id()
                    sent = s.take_piggyback(body)   # ``body`` itself when nothing rides
                    try:
                        _, st, rbody, rframes = chan.request(op, sent, frames, req_id=rid,
                                                             epoch=s.epoch)
                    except BaseException as exc:
                        if not _gone_unsent(exc):
                            # timed out, send failed, interrupted (as _Drive.failed)
                            if sent is not body:
                                s.requeue(sent, failed=True)
                            s.need_hello = True
                            raise
                        st, rbody, rframes = Status.STALE_EPOCH, {}, []
                    if st != _STALE:
                        s.note_reply(rbody)
                        return st, rbody, rframes
                    # nothing was done: HELLO, then the same request again (the lazy
                    # COMMITs with it, as _Drive.after)
                    if sent is not body:
                        s.requeue(sent, unapplied=True)
                    s.need_hello = True
                    self._hello_locked()
            raise ServerUnavailable(f"kvshm server at {self.address} keeps forgetting "
                                    "this client's session; retry")
        finally:
            self._arm_idle_flush()

    def _fast1(self, s: "_Session", kind: int, op: int, bkey: bytes, value: Any,
               checksum: int | None, out: Any, max_size: int = 65535) -> Any:
        """One single-key request through :meth:`Channel.call1` (packed and read in C),
        when nothing rides on it (no RELEASE/ABORT/COMMIT due) and no HELLO is due.

        Returns NOT_SENT when it was not sent (then ``_call1``, the general one-key path,
        runs: it says HELLO first where this found one due); ``(status, body, frames)``
        for a reply other than the usual one (never STALE_EPOCH: that is NOT_SENT after
        the HELLO is marked due); else the usual reply as Channel.call1 returns it.
        Raises what Channel.request raises (a sent request that failed makes the next
        call say HELLO first, as _call1)."""
        if s.commits or s.aborts or s.releases:
            return _NOT_SENT
        chan = self._chan
        with chan.lock:
            if s.need_hello:
                return _NOT_SENT
            try:
                r = chan.call1(kind, op, bkey, value, checksum, out, s.new_id(), s.epoch,
                               max_size)
            except BaseException as exc:
                # sent and failed (timeout, send error, interrupt): HELLO before the next
                # call, as _call1; proven gone before the send: HELLO, then _call1 again
                s.need_hello = True
                if _gone_unsent(exc):
                    return _NOT_SENT
                raise
        if type(r) is tuple:
            if r[0] == _STALE:
                s.need_hello = True     # nothing was done: _call1 says HELLO, sends again
                return _NOT_SENT
            s.note_reply(r[1])
        return r

    def _put1(self, key: Key, value: Any, checksum: bool) -> bool:
        """put() of one value by a remote client (one PUT). False: not taken (nothing
        done); the general path then runs."""
        s = self._lean()
        if s is None:
            return False
        bkey = _key1(s, key)
        if bkey is None:
            return False
        if _CALL1 and not checksum:
            cap, mv = s.capacity, s.limits.max_value_bytes
            r = self._fast1(s, _PUT1, _OP_PUT, bkey, value, None, None,
                            mv if mv and mv < cap else cap)
            if r is not _NOT_SENT:
                if type(r) is tuple:
                    self._put_reply(s, bkey, r[0], r[1])
                return True
        try:
            view = memoryview(value)
        except TypeError:
            return False            # a tensor, or what byte_view refuses
        if not view.c_contiguous:
            return False
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        size = view.nbytes
        if size > s.capacity or (s.limits.max_value_bytes and
                                 size > s.limits.max_value_bytes):
            return False
        # the body op_put_batch sends for one value in one frame (frames.pack)
        if checksum:
            body = {"keys": [bkey], "sums": [_xxh(view)], "sizes": [size], "counts": [1]}
        else:
            body = {"keys": [bkey], "sizes": [size], "counts": [1]}
        st, rbody, _ = self._call1(Op.PUT, body, (view,))
        self._put_reply(s, bkey, st, rbody)
        return True

    @staticmethod
    def _put_reply(s: "_Session", bkey: bytes, st: int, rbody: dict[str, Any]) -> None:
        if st:
            _check(_Reply(0, st, rbody, []), "put")
        per_key = rbody["st"]
        if per_key != _ONE_OK:
            s.raise_failures([bkey], per_key, "put")

    def _get1(self, key: Key, out: Any, verify: bool) -> tuple[list[int], list[Any]] | None:
        """op_lookup_copy of one key by a remote client (one GET): ``(sizes, data)``;
        None: not taken (nothing done)."""
        s = self._lean()
        if s is None:
            return None
        bkey = _key1(s, key)
        if bkey is None:
            return None
        views = None
        if out is not None:
            try:
                view = memoryview(out)
            except TypeError:
                return None
            if view.readonly or not view.c_contiguous:
                return None
            if view.ndim != 1 or view.format != "B":
                view = view.cast("B")
            views = (view,)
        keys = [bkey]
        # no value is larger than the server's pool: a reply saying so is refused
        # (sizes_of, below), never copied or returned (0: not known, as sizes_of)
        cap = s.capacity if s.capacity > 0 else _MAX_SIZE
        r: Any = _NOT_SENT
        if _CALL1 and not verify:
            if views is None:
                r = self._fast1(s, _GET1, _OP_GET, bkey, None, None, None)
            else:
                # the C copy takes at most the pool's bytes of out: a larger size is
                # handed back unread (the reply's parts), for sizes_of to refuse
                v = views[0]
                r = self._fast1(s, _GET1_INTO, _OP_GET, bkey, None, None,
                                v if v.nbytes <= cap else v[:cap])
            if type(r) is int:
                if r < 0:
                    return [-1], [None]
                return [r], [None]          # (get_into reads the size only)
            if type(r) is bytes:
                if len(r) > cap:
                    raise ProtocolError(f"GET reply for 1 key has a size {len(r)} (an int "
                                        f"in [-2, {cap}] wanted) (from "
                                        f"{s.hello.get('server')})")
                return [len(r)], [r]
        if r is _NOT_SENT:
            st, rbody, frames = self._call1(Op.GET, {"keys": keys})
        else:
            st, rbody, frames = r
        sizes = rbody.get("sizes")
        if not st and not verify and type(sizes) is list and len(sizes) == 1:
            # the usual replies, as got() reads them: a hit in one frame, or a miss
            n = sizes[0]
            counts = rbody.get("counts")
            if type(n) is int and 0 <= n <= cap and len(frames) == 1 and \
                    counts == _ONE_FRAME:
                f = frames[0]
                if len(f) == n:
                    if views is None:
                        return sizes, [f if type(f) is bytes else memoryview(f).tobytes()]
                    view = views[0]
                    s._check_out(bkey, view, n)
                    # (a memoryview of a frame: pyzmq's Frame exports a shape that does
                    # not survive a copy of the buffer struct, as a slice assignment makes)
                    view[:n] = f if type(f) is bytes else memoryview(f)
                    return sizes, [view[:n]]
            elif n == -1 and not frames and not counts:
                return sizes, [None]
        return s.got(keys, views, None, verify, _Reply(0, st, rbody, frames))

    def _exists1(self, key: Key) -> bool | None:
        """exists() of one key by a remote client (one EXISTS); None: not taken."""
        s = self._lean()
        if s is None:
            return None
        bkey = _key1(s, key)
        if bkey is None:
            return None
        r: Any = self._fast1(s, _EXISTS1, _OP_EXISTS, bkey, None, None, None) if _CALL1 \
            else _NOT_SENT
        if type(r) is bool:
            return r
        if r is _NOT_SENT:
            st, rbody, _ = self._call1(Op.EXISTS, {"keys": [bkey]})
        else:
            st, rbody, _ = r
        if st:
            _check(_Reply(0, st, rbody, []), "exists")
        return found_of(rbody, 1)[0]

    def run_op(self, gen: OpGen) -> Any:
        """Drive an operation generator (``kvshm.client._Session.op_*``, or one of
        :mod:`kvshm.paged`, :mod:`kvshm.layerwise`, :mod:`kvshm.integrations`) to its
        result: the public seam for code that composes operations. Every grant the
        operation made is settled on every error path."""
        return self._run(gen)

    @property
    def session(self) -> "_Session":
        """The protocol state the operation generators take (keys, limits, movers)."""
        return self._session

    def _run(self, gen: OpGen, check: bool = True) -> Any:
        s = self._session
        try:
            s.check_owner()
            if check and (s.wb_lost or s.wb_refused):
                s.raise_wb_errors()
            if s.need_hello and not self._closed:
                # HELLO before the operation starts (it picks its mover first): after an
                # RDMA completion error this makes the next call run on a fresh connection
                with self._chan.lock:
                    if s.need_hello:
                        self._hello_locked()
        except BaseException:
            gen.close()
            raise
        drive = _Drive(s, gen)
        reply: _Reply | list[_Reply]
        try:
            done, val = drive.start()
            while not done:
                try:
                    if type(val) is _Many:
                        reply = self._roundtrip_many(drive, val)
                    else:
                        reply = self._roundtrip(drive, val)
                except _Restarted as exc:
                    done, val = drive.step(gen.throw, exc)
                    continue
                except BaseException:
                    drive.close()
                    raise
                done, val = drive.step(gen.send, reply)
            return val
        finally:
            self._arm_idle_flush()

    def _arm_idle_flush(self) -> None:
        # RELEASE (and lazy COMMIT) ride on the next request; a client that goes idle
        # sends them after IDLE_FLUSH_S so its pins do not outlive its reads (the server
        # holds a live local client's grants past their lease).
        if self._closed or not self._session.piggyback_pending():
            return
        with self._timer_lock:
            if self._timer is None and not self._closed:
                t = threading.Timer(IDLE_FLUSH_S, self._idle_flush)
                t.daemon = True
                t.name = "kvshm-idle-flush"
                self._timer = t
                t.start()

    def _idle_flush(self) -> None:
        with self._timer_lock:
            self._timer = None
        if self._closed or not self._session.piggyback_pending():
            return
        if self._chan.lock.locked():       # a call is under way: it carries them
            self._arm_idle_flush()
            return
        try:
            # a plain COMMIT: refused lazy commits and writes made behind are kept for
            # the caller's next call (note_reply, late_reply), never swallowed here
            self._run(self._session.op_simple(Op.COMMIT, {}, "flush"), check=False)
        except Exception as exc:
            log.debug("idle flush to %s failed: %s", self.address, exc)

    # ---------------------------------------------------------------- writes

    def put(self, key: Key, value: Any, *, checksum: bool = False) -> None:
        """Store ``value`` (any buffer or CPU tensor) under ``key``.

        Raises
        ------
        ValueTooLarge, InvalidKey, PoolFull, QuotaExceeded, ServerUnavailable
        WriteRefused, WritesLost
            With ``write_behind``: an earlier write made behind was not stored.
        """
        if self._session.wb is not None and not checksum and self._put_behind(key, value):
            return
        if self._put1(key, value, checksum):
            return
        self._run(self._session.op_put_batch([key], [value], checksum))

    def _put_behind(self, key: Key, value: Any) -> bool:
        """The common write-behind put (one value that fits the reservation, nothing to
        report) without the operation machinery: take blocks, copy, send PLACE and, when
        the reservation runs low, a RESERVE ahead. False: nothing done, take the
        general path (which also raises what is due, and says HELLO again to a server
        found gone here)."""
        s = self._session
        wb = s.wb
        if (wb is None or self._closed or s.need_hello or s.wb_lost or s.wb_refused
                or s.lost_commits or s.mover is not wb.mover or os.getpid() != s.pid):
            return False
        bkey = key.encode() if type(key) is str else key
        if type(bkey) is not bytes or not 0 < len(bkey) <= s.limits.max_key_bytes:
            return False
        try:
            view = memoryview(value)
        except TypeError:
            return False                     # a tensor: the general path takes it
        if view.ndim != 1 or view.format != "B" or not view.c_contiguous:
            if not view.c_contiguous:
                return False
            view = view.cast("B")
        size = view.nbytes
        if size > s.capacity or (s.limits.max_value_bytes and
                                 size > s.limits.max_value_bytes):
            return False
        n = max(1, -(-size // wb.bs))
        if n * 2 > wb.want:
            return False
        chan = self._chan
        now = time.monotonic()
        if now - max(chan._last, wb.checked) > serverwatch.IDLE_S:
            # as the request path: after an idle spell, make sure the server still
            # lives before writing into its pool (a PLACE to a server that is gone
            # would wait in the socket for nobody; the general path says HELLO)
            watch = chan.watch
            if watch is not None and watch.gone() is not None:
                s.need_hello = True
                return False
            wb.checked = now
        epoch = s.epoch
        got = wb.take1(n) or wb.take((n,)) or self._wait_refill(n)
        if got is None:
            return False
        gen, runs, mover, bs = got
        ext = runs[0]
        try:
            pool = mover.begin()
            try:
                # non-temporal stores: the bytes are for the server's other readers
                if len(ext) == 1:
                    pool.stream_write(ext[0][0] * bs, view)
                else:
                    pos = 0
                    for b0, c in ext:
                        k = min(c * bs, size - pos)
                        if k <= 0:
                            break
                        pool.stream_write(b0 * bs, view[pos:pos + k])
                        pos += k
            finally:
                mover.end()
        finally:
            wb.copy_done()
        offs = [(b0 * bs, c * bs) for b0, c in ext]
        with chan.lock:
            if self._closed:
                return False                # close() ran meanwhile: the general path says so
            if s.wb is not wb or s.epoch != epoch:
                # another thread's HELLO found another server (or dropped write-behind)
                # since the blocks were taken: the copy went into a reservation of a
                # pool that is no longer this client's. Put again the general way (not
                # read back from the new pool at these offsets, nor lost unreported).
                return False
            if wb.gen != gen:
                # another thread's HELLO voided the reservation since the blocks were
                # taken (same server): the next RESERVE resets it, which gives these
                # blocks to other keys while this PLACE would still be listed in
                # ``placed`` (read back as another key's bytes: tests/test_break10.py
                # with-ping saw it), and the PLACE would be refused. Put again the
                # general way.
                return False
            if wb.held_rid and wb.held_gen != gen:
                self._send_held_locked()        # another reservation's: not mixed
            wb.puts += 1
            wb.burst = wb.burst + 1 if now - wb.last_put < PLACE_STREAM_GAP_S else 1
            wb.last_put = now
            hold = wb.held_rid != 0
            if not hold:
                if (len(wb.outstanding) >= PLACE_WINDOW or wb.free < 2 * n
                        or not wb.puts & 15):
                    # replies already here (refusals, refills): every 16th put (a read
                    # costs as much as the send), at once when the reservation is nearly
                    # dry, and before holding this put back
                    self._drain_locked()
                hold = (len(wb.outstanding) >= PLACE_WINDOW or
                        (wb.burst > PLACE_WINDOW and now - wb.sent_at < PLACE_HOLD_S))
            if hold:
                # the server is behind, or puts stream: gather this one into the
                # held PLACE (one message for many keys)
                rid = wb.held_rid
                if not rid:
                    rid = wb.held_rid = s.new_id()
                    wb.held_gen = gen
                    wb.held_at = now
                    with wb.placed.lock:
                        wb.outstanding[rid] = wb.held_keys
                    f = self._flusher
                    if f is None or f.pid != s.pid:
                        f = self._flusher = _PlaceFlusher(self)
                    f.kick()
                wb.held_keys.append(bkey)
                wb.held_sizes.append(size)
                wb.held_runs.append(ext)
                wb.held_blocks += n
                with wb.placed.lock:
                    wb.placed.map[bkey] = (rid, size, offs, None)
                if (len(wb.held_keys) >= PLACE_BATCH_KEYS or wb.held_blocks >= wb.batch_blocks
                        or now - wb.held_at >= PLACE_HOLD_S or wb.low()):
                    self._send_held_locked()
            else:
                keys = [bkey]
                rid = s.new_id()
                body = s.take_piggyback({"gen": gen, "keys": keys, "sizes": [size],
                                         "runs": runs})
                with wb.placed.lock:
                    wb.outstanding[rid] = keys
                    wb.placed.map[bkey] = (rid, size, offs, None)
                try:
                    chan.send(Op.PLACE, body, req_id=rid, epoch=s.epoch)
                except BaseException:
                    s.requeue(body, failed=True)
                    s.need_hello = True
                    s.unsent(rid)
                    raise
                wb.sent_at = now
            if wb.low() and wb.gen == gen and not wb.held_rid:
                rid = s.new_id()
                wb.reserve_rid = rid
                try:
                    chan.send(Op.RESERVE, {"blocks": wb.want - wb.free, "reset": False},
                              req_id=rid, epoch=s.epoch)
                except KvshmError:
                    wb.reserve_rid = 0
                    s.need_hello = True
        if self._timer is None:
            self._arm_idle_flush()
        return True

    def _send_held_locked(self) -> None:
        """Send the held write-behind PLACE, if any (with the channel lock held): before
        any other request, so the server sees this client's writes in order. When it
        cannot be sent, its keys are reported lost (WritesLost, from the next call) and
        the exception propagates."""
        s = self._session
        wb = s.wb
        if wb is None or not wb.held_rid:
            return
        rid, keys = wb.held_rid, wb.held_keys
        body = s.take_piggyback({"gen": wb.held_gen, "keys": keys, "sizes": wb.held_sizes,
                                 "runs": wb.held_runs})
        wb.unhold()
        wb.sent_at = time.monotonic()
        try:
            self._chan.send(Op.PLACE, body, req_id=rid, epoch=s.epoch)
        except BaseException:
            s.requeue(body, failed=True)
            s.need_hello = True
            s.unsent(rid)
            s.wb_lost.extend(keys)
            raise

    def _flush_held(self) -> float | None:
        """The place-flush thread's turn: send the held PLACE once it is PLACE_HOLD_S
        old. Returns the seconds until it is due, or None when none is held (now)."""
        s = self._session
        wb = s.wb
        if wb is None or not wb.held_rid or self._closed:
            return None
        with self._chan.lock:
            if not wb.held_rid or s.need_hello or s.pid != os.getpid():
                return None         # sent meanwhile, or the next call's HELLO reports it
            left = wb.held_at + PLACE_HOLD_S - time.monotonic()
            if left > 0:
                return left
            try:
                self._drain_locked()
                self._send_held_locked()
            except Exception as exc:    # its keys are in wb_lost: the next call raises
                log.debug("held PLACE to %s not sent: %s", self.address, exc)
        return None

    def _wait_refill(self, n: int) -> Any:
        """The blocks of a write-behind put the reservation cannot hold now, taken once
        the RESERVE already asked for is answered (waiting up to REFILL_WAIT_S): cheaper
        than the general path's ALLOC and COMMIT round trips. None: no RESERVE in
        flight, no answer in time, or it did not bring enough (then the general path)."""
        wb = self._session.wb
        chan = self._chan
        if wb is None or not wb.reserve_rid:
            return None
        deadline = time.monotonic() + REFILL_WAIT_S
        with chan.lock:
            self._send_held_locked()      # this wait is the server's to catch up anyway
            while wb.reserve_rid:
                sock = chan._sock
                left = deadline - time.monotonic()
                if sock is None or chan._pid != os.getpid() or left <= 0:
                    return None
                try:
                    if not sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                        return None
                except zmq.ZMQError:
                    return None
                self._drain_locked()
        return wb.take1(n) or wb.take((n,))

    def _drain_locked(self) -> None:
        """:meth:`Channel.drain` with the channel lock held. An undecodable reply among
        those read (ProtocolError, raised: the channel was reset, so the replies of the
        RESERVE and PLACEs in flight are lost with it) makes the next call say HELLO,
        which clears what waited for them and reports those writes lost (WritesLost)."""
        try:
            self._chan.drain()
        except ProtocolError:
            self._session.need_hello = True
            raise

    def put_batch(self, keys: Sequence[Key], values: Sequence[Any], *,
                  checksum: bool = False, pin_ttl: float | None = None) -> Any:
        """Store many values with one ALLOC and one COMMIT (or one PUT over TCP).

        Keys that could be placed are stored even when others fail; the first failure
        is then raised, its ``failed`` attribute mapping each failed key to its Status.
        ``checksum=True`` stores an xxh64 of each value for ``get(..., verify=True)``.
        ``pin_ttl`` (seconds): also hold a handoff pin on the keys and return a
        :class:`kvshm.handoff.Handoff` for the reader (prefill/decode); else None.
        """
        if pin_ttl is not None:
            from kvshm import handoff

            return self._run(handoff.op_put_pinned(self._session, keys, values, checksum,
                                                   pin_ttl, self.address))
        s = self._session
        k = _parts(len(keys), Op.PUT)
        if k and s.mover is None and s.wb is None and not checksum and _batch is not None:
            self._run(s.op_put_parts(keys, values, k))
            return None
        self._run(s.op_put_batch(keys, values, checksum))
        return None

    # ---------------------------------------------------------------- handoff pins

    def pin(self, keys: Sequence[Key], ttl: float) -> Any:
        """Hold a handoff pin on stored keys for ``ttl`` s; returns a
        :class:`kvshm.handoff.Handoff`. Raises KeyNotFound when a key is missing."""
        from kvshm import handoff

        return self._run(handoff.op_pin(self._session, keys, ttl, self.address))

    def renew(self, handoff: Any, ttl: float) -> float | None:
        """Extend a handoff pin (a Handoff or pin id) to ``ttl`` s from now; returns the
        new deadline (``time.time()`` s), or None when it is gone (expired, unpinned,
        server restarted)."""
        from kvshm import handoff as h

        return self._run(h.op_renew(self._session, handoff, ttl))  # type: ignore[no-any-return]

    def unpin(self, handoff: Any) -> bool:
        """Drop a handoff pin; returns whether it was still held."""
        from kvshm import handoff as h

        return self._run(h.op_unpin(self._session, handoff))  # type: ignore[no-any-return]

    # ---------------------------------------------------------------- reads

    def get(self, key: Key, *, verify: bool = False) -> bytes:
        """The value of ``key``. Raises KeyNotFound on a miss, CorruptValue on a checksum
        mismatch with ``verify``."""
        s = self._session
        lr = s.local
        if lr is not None and not (verify or s.commits or s.need_hello or
                                   s.wb is not None and s.wb.placed):
            # the common same-host read, no round trip (a reader made before a fork
            # answers FALLBACK in the child, whose server path below then raises)
            v = lr.get(key)
            if v is not localread.FALLBACK:
                if v is None:
                    raise KeyNotFound(f"key {key!r} not found")
                return v  # type: ignore[no-any-return]
        if s.wb is not None and s.wb.placed and not verify:
            s.raise_wb_errors()
            v = s.read_own(key, None)           # this client's write, not yet answered
            if v is not None:
                return v  # type: ignore[no-any-return]
        lr = s.local_reader()
        if lr is not None and not verify:       # same host: no round trip
            v = lr.get(key)
            if v is not localread.FALLBACK:
                if v is None:
                    raise KeyNotFound(f"key {key!r} not found")
                return v  # type: ignore[no-any-return]
        got = self._get1(key, None, verify)
        sizes, data = got if got is not None else self._run(
            self._session.op_lookup_copy([key], None, verify))
        if sizes[0] < 0:
            raise KeyNotFound(f"key {key!r} not found")
        return data[0]  # type: ignore[no-any-return]

    def get_into(self, key: Key, out: Any, *, verify: bool = False) -> int:
        """Copy the value of ``key`` into ``out`` (a writable buffer or CPU tensor).

        Returns the value's size in bytes. Raises KeyNotFound, or ValueError when
        ``out`` is smaller than the value.
        """
        s = self._session
        lr = s.local
        if lr is not None and not (verify or s.commits or s.need_hello or
                                   s.wb is not None and s.wb.placed):
            n = lr.get_into(key, out)           # as get's common same-host read
            if n >= 0:
                return n  # type: ignore[no-any-return]
            if n == localread.MISS:
                raise KeyNotFound(f"key {key!r} not found")
        if s.wb is not None and s.wb.placed and not verify:
            s.raise_wb_errors()
            n = s.read_own(key, out)           # this client's write, not yet answered
            if n is not None:
                return n  # type: ignore[no-any-return]
        lr = s.local_reader()
        if lr is not None and not verify:       # same host: no round trip
            n = lr.get_into(key, out)
            if n != localread.FALLBACK:
                if n == localread.MISS:
                    raise KeyNotFound(f"key {key!r} not found")
                return n  # type: ignore[no-any-return]
        got = self._get1(key, out, verify)
        sizes, _ = got if got is not None else self._run(
            self._session.op_lookup_copy([key], [out], verify))
        if sizes[0] < 0:
            raise KeyNotFound(f"key {key!r} not found")
        return sizes[0]  # type: ignore[no-any-return]

    def get_batch(self, keys: Sequence[Key], *, verify: bool = False) -> list[bytes | None]:
        """Values of ``keys``, None for each miss (a miss never fails the batch)."""
        _, data = self._run(self._session.op_lookup_copy(keys, None, verify))
        return data  # type: ignore[no-any-return]

    def get_batch_into(self, keys: Sequence[Key], outs: Sequence[Any], *,
                       verify: bool = False) -> list[int]:
        """Copy each value into ``outs[i]``; returns sizes in bytes, -1 for a miss."""
        sizes, _ = self._run(self._session.op_lookup_copy(keys, outs, verify))
        return sizes  # type: ignore[no-any-return]

    # ---------------------------------------------------------------- paged KV

    def put_pages(self, keys: Sequence[Key], kv: Any, page_ids: Any, *,
                  layout: str = "auto") -> None:
        """Store pages ``page_ids`` of a paged KV tensor, one key per page (K and V).

        See :func:`kvshm.paged.put_pages` for the layouts taken and what is raised.
        """
        from kvshm import paged

        paged.put_pages(self, keys, kv, page_ids, layout=layout)

    def get_pages_into(self, keys: Sequence[Key], kv: Any, page_ids: Any, *,
                       layout: str = "auto") -> list[bool]:
        """Fill pages ``page_ids`` of a paged KV tensor from ``keys``; found per key.

        See :func:`kvshm.paged.get_pages_into`.
        """
        from kvshm import paged

        return paged.get_pages_into(self, keys, kv, page_ids, layout=layout)

    # ---------------------------------------------------------------- queries

    def exists(self, key: Key) -> bool:
        found = self._exists1(key)
        return self.exists_batch([key])[0] if found is None else found

    def exists_batch(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key is present (committed, or written behind by this client)."""
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)       # (an iterator: own_flags would use it up first)
        own = self._session.own_flags(keys)
        if own is not None:
            return [a or b for a, b in zip(own, self._exists(keys))]
        return self._exists(keys)

    def _exists(self, keys: Sequence[Key]) -> list[bool]:
        lr = self._session.local_reader()
        if lr is not None and localread.fits(keys, self._session.limits):
            found = lr.exists_batch(keys)   # checks the keys itself: odd ones fall back
            if found is not None:
                return found  # type: ignore[no-any-return]
        bkeys = self._session.keys(keys)
        if not bkeys:
            return []
        k = _parts(len(bkeys), Op.EXISTS)
        if k:
            return self._run(self._session.op_exists_parts(bkeys, k))  # type: ignore[no-any-return]
        return found_of(self._run(self._session.op_simple(Op.EXISTS, {"keys": bkeys}, "exists")),
                        len(bkeys))

    def match_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys of ``keys`` the store holds (a prefix match)."""
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)       # (an iterator: own_flags would use it up first)
        if self._session.own_flags(keys) is not None:
            found = self.exists_batch(keys)
            return found.index(False) if False in found else len(found)
        lr = self._session.local_reader()
        if lr is not None and localread.fits(keys, self._session.limits):
            n = lr.match_prefix(keys)       # checks the keys itself: odd ones fall back
            if n >= 0:
                return n  # type: ignore[no-any-return]
        bkeys = self._session.keys(keys)
        if not bkeys:
            return 0
        return prefix_of(self._run(self._session.op_simple(Op.MATCH_PREFIX, {"keys": bkeys},
                                                           "match_prefix")), len(bkeys))

    def delete(self, keys: Key | Sequence[Key]) -> int:
        """Remove keys (a readers' pin keeps its bytes until released). Returns removed."""
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        bkeys = self._session.keys(keys)
        if not bkeys:
            return 0
        if self._session.wb is not None:
            self._session.wb.placed.drop(bkeys)   # the DELETE follows the PLACE
        return count_of(self._run(self._session.op_simple(Op.DELETE, {"keys": bkeys},
                                                          "delete")), "DELETE", len(bkeys))

    def evict(self, to_ratio: float) -> int:
        """Evict LRU entries until usage <= ``to_ratio`` (0..1). Returns entries evicted."""
        if not 0.0 <= to_ratio <= 1.0:
            raise ValueError(f"to_ratio must be in [0, 1], got {to_ratio}")
        return count_of(self._run(self._session.op_simple(Op.EVICT, {"ratio": float(to_ratio)},
                                                          "evict")), "EVICT")

    def list_keys(self, prefix: Key = b"", limit: int | None = None,
                  page: int = 10_000) -> list[bytes]:
        """Committed keys starting with ``prefix`` (at most ``limit``), as bytes.

        Pages through the server's LIST, ``page`` keys a request. An administrative
        scan, O(keys) on the server: not for the data path. Keys written or removed while
        it runs may be missed or listed twice.
        """
        p = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
        out: list[bytes] = []
        while limit is None or len(out) < limit:
            n = page if limit is None else min(page, limit - len(out))
            n = self._session.limits.list_page(n)     # (its reply within the bound)
            body = self._run(self._session.op_simple(
                Op.LIST, {"prefix": p, "start": len(out), "limit": n}, "list"))
            out.extend(body["keys"])
            if not body["more"]:
                break
        return out

    def purge(self) -> int:
        """Remove every entry. Returns entries removed."""
        if self._session.wb is not None:
            self._session.wb.placed.clear()
        return count_of(self._run(self._session.op_simple(Op.PURGE, {}, "purge")), "PURGE")

    def stats(self, *, verify: bool = False, latency: bool = False) -> dict[str, Any]:
        """Server statistics (see :meth:`kvshm.store.Store.stats` for the keys).

        ``verify`` adds the accounting check (entry_blocks, accounting_ok); ``latency``
        the per-op latency histograms.
        """
        body = {"verify": verify, "latency": latency}
        return self._run(self._session.op_simple(Op.STATS, body, "stats"))["stats"]  # type: ignore[no-any-return]

    def flush(self) -> None:
        """Send queued RELEASE/COMMIT now and wait for the replies of every write made
        behind (one round trip). Raises LeaseExpired if a lazy commit came too late,
        WriteRefused / WritesLost for writes made behind that were not stored."""
        if self._session.piggyback_pending():
            self._run(self._session.op_commit_flush())
        else:
            self._session.raise_lost_commits()
            self._session.raise_wb_errors()

    def ping(self) -> dict[str, Any]:
        """Say HELLO again; returns the server's HELLO reply."""
        self._session.check_owner()     # (before a lock the parent's threads may hold)
        wb = self._session.wb
        if wb is not None and wb.outstanding and not self._session.need_hello:
            try:   # their replies first: a new HELLO drops the socket they come on
                self._run(self._session.op_sync_behind(), check=False)
            except KvshmError as exc:
                log.debug("sync before ping failed: %s", exc)
        with self._chan.lock:
            self._hello_locked()
        return dict(self._session.hello)

    # ---------------------------------------------------------------- misc

    @property
    def transport(self) -> str:
        """The mover in use: "shm", "rdma" or "tcp"."""
        return self._session.transport_name

    @property
    def server_info(self) -> dict[str, Any]:
        """The server's last HELLO reply."""
        return dict(self._session.hello)

    def close(self) -> None:
        """Send queued releases/commits (best effort), unmap the pool, close the socket.

        Idempotent.
        """
        if self._closed:
            return
        if self._session.pid != os.getpid():
            self._forget_in_child()
            return
        s = self._session
        # lazy COMMITs queued again by a request that failed (a HELLO is due then): the
        # flush says that HELLO and sends them; else the BYE, skipped while a HELLO is
        # due, would not carry them either and those writes, reported done, were lost
        owed = sum(1 for rid in s.commits if rid in s.lazy_rids) if s.need_hello else 0
        try:
            if s.piggyback_pending() and (owed or not s.need_hello):
                self._run(s.op_commit_flush(), check=False)
            s.raise_wb_errors()
        except (LeaseExpired, WriteRefused, WritesLost) as exc:
            log.warning("kvshm client %s closed: %s", self.address, exc)
        except KvshmError as exc:
            if owed:
                log.warning("kvshm client %s closed: %d write(s) committed lazily may not "
                            "be stored: their COMMIT could not be sent (%s)",
                            self.address, owed, exc)
            else:
                log.debug("flush at close failed: %s", exc)
        self._closed = True
        with self._timer_lock:
            t, self._timer = self._timer, None
        if t is not None:
            t.cancel()
            if t is not threading.current_thread():
                t.join(5)
        if self._flusher is not None:
            self._flusher.stop()
        with self._chan.lock:
            s = self._session
            wb = s.wb
            if wb is not None and wb.held_rid:
                # a put that raced this close was held after the flush above (and the
                # place-flush thread is stopped): send it before the BYE
                try:
                    if s.need_hello:
                        s.wb_lost.extend(wb.held_keys)
                        wb.unhold()
                    else:
                        self._send_held_locked()
                except KvshmError as exc:
                    log.debug("held PLACE at close: %s", exc)
            s.close()
            bye = s.bye() if s.pid == os.getpid() else None
            if bye is not None:
                # best effort, a short wait: the server ends the session at once
                from kvshm.zmq_ctrl.ops_session import BYE_WAIT_S

                try:
                    self._chan.request(Op.BYE, bye[1], req_id=s.new_id(), epoch=bye[0],
                                       timeout=BYE_WAIT_S)
                except Exception as exc:
                    log.debug("BYE at close: %s", exc)
            self._chan.close()
            try:
                s.raise_wb_errors()         # (what the BYE's wait read, or could not send)
            except (WriteRefused, WritesLost) as exc:
                log.warning("kvshm client %s closed: %s", self.address, exc)

    def _forget_in_child(self) -> None:
        """close() in a forked child: the client is its parent's. The parent's threads
        may have held its locks at the fork (the place-flush thread sending, a call or
        a copy in flight) and nobody here releases them: take none, settle nothing,
        unmap nothing (the mappings end with this process); the parent's socket is
        never touched."""
        self._closed = True
        self._timer = None
        self._flusher = None
        self._chan.reset()          # (drops the parent's socket object, unclosed)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                if self._session.pid != os.getpid():
                    return          # a forked child's copy: see _forget_in_child
                self._session.close()
                self._chan.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"<kvshm.Client {self.address} transport={self.transport}>"


def _door_token(endpoint: str, token: bytes | None, token_file: str | None
                ) -> "bytes | Callable[[], bytes | None] | None":
    if token is not None:
        return token
    from kvshm.security import find_token

    find_token(endpoint, token_file)      # an explicit file that cannot be read: now

    def read() -> bytes | None:
        try:
            return find_token(endpoint, token_file)
        except ValueError:
            return None

    return read


def _operator_token(endpoint: str, token: bytes | None
                    ) -> "bytes | Callable[[], bytes | None]":
    if token is not None:
        return token
    from kvshm.security import find_operator_token

    return lambda: find_operator_token(endpoint)     # again at each HELLO (a restart)


def _curve_setup(server_key: bytes | str | None,
                 keypair: tuple[bytes, bytes] | str | None
                 ) -> Callable[[zmq.Socket], None] | None:
    if server_key is None:
        if keypair is not None:
            raise ValueError("curve_keypair needs curve_server_key")
        return None
    from kvshm.security import load_keypair, load_public_key

    server_key = load_public_key(server_key)
    if keypair is None:
        keypair = zmq.curve_keypair()
    elif isinstance(keypair, str):
        keypair = load_keypair(keypair)
    pub, sec = keypair

    def setup(s: zmq.Socket) -> None:
        s.curve_serverkey = server_key
        s.curve_publickey = pub
        s.curve_secretkey = sec

    return setup
