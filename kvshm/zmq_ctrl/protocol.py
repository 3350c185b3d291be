"""The kvshm control protocol: message types, status codes, codec and limits.

Wire format (ZeroMQ multipart, DEALER client -> ROUTER server)::

    request:  [header, payload_0, payload_1, ...]
    reply:    [header, payload_0, payload_1, ...]

``header`` is one msgpack array (``use_bin_type=True``; no pickle anywhere):

    request header: [PROTOCOL_VERSION, op, req_id, epoch, body]
    reply header:   [PROTOCOL_VERSION, status, req_id, body]

* ``op`` is an :class:`Op`, ``status`` a :class:`Status`.
* ``req_id`` is chosen by the client (unique per client, increasing, never reused); the
  reply echoes it, so many requests can be in flight on one connection. Grants (pins and
  pending writes) are named by ``(session, req_id)``.
* HELLO opens a *session* (``session`` in its reply, issued by the server) for the
  client's ``nonce`` (8-64 random bytes, one per client object). It must carry the
  server's door ``token`` (bytes, read from the server's token file) unless the
  connection is CURVE-authenticated; otherwise it is answered ``Status.UNAUTHORIZED`` and
  no other request of that connection is served (``STALE_EPOCH``, "say HELLO"). A
  same-host client that attached the pool sends a second HELLO with ``proof: true``
  after it created and locked its liveness file (:mod:`kvshm.segments`); the reply's
  ``local`` says whether the server saw the proof. The HELLO reply names the pool with
  ``pool.token_digest``, never the pool's token itself.
* ``epoch`` is the server instance number the client learnt in HELLO. ALLOC, LOOKUP and
  COMMIT/RELEASE/ABORT lists are refused with ``Status.STALE_EPOCH`` when it does not
  match: the server restarted, and the offsets the client holds point into a dead
  segment. The client then says HELLO again and retries.
* ``body`` is a map with short string keys. Any request may carry the lists
  ``commit``, ``abort`` and ``release`` (request ids of earlier ALLOC/LOOKUP grants):
  they are applied before the request itself, so COMMIT and RELEASE can ride on the next
  request without a round trip of their own (docs/DESIGN.md, "One protocol, three movers").
* Payload frames carry value bytes for PUT (request) and GET (reply), in key order
  (hits only for GET). With ``sizes`` and ``counts`` in the body, a frame holds
  ``counts[i]`` consecutive values back to back (small values packed, large ones alone:
  :mod:`kvshm.zmq_ctrl.frames`); without ``counts``, one frame per value.

LIST pages through the keys (``prefix``, ``start``, ``limit``) for administration and
engines that ask for it; it is O(keys) on the server, not a data path.

Per-key results of batch operations are lists of :class:`Status` values; a miss or a
refused key never fails the whole batch.

Garbage collection: a request's decoded lists of at least :data:`UNTRACK_MIN` items that
hold only bytes, str, int, float, bool or None (a batch's keys and sizes) are taken off
the collector's lists (:func:`kvshm._gcutil.untrack_plain`: such a list can be in no
cycle), so no young collection while the request lives walks its items. The environment
variable ``KVSHM_UNTRACK=0`` (read at import) leaves them tracked, for A/B figures.
:class:`RequestDecoder` is in no reference cycle (its generator is not given the decoder):
a request decoded over turns is freed by reference counting once the decoder and the
request are dropped, never left for a young collection (tests/test_gc_cycles.py).
"""

from __future__ import annotations

import enum
import os
from typing import Any

import msgpack

from kvshm.limits import Limits  # re-exported: the wire users import it from here

try:    # batch requests' keys packed, EXISTS replies read, in C (the same bytes and values)
    from kvshm.zmq_ctrl import _batchq
except ImportError:     # pragma: no cover - the extension is not built
    _batchq = None  # type: ignore[assignment]
if os.environ.get("KVSHM_BATCHPATH", "1") == "0":    # the off switch (A/B figures)
    _batchq = None  # type: ignore[assignment]

#: Requests / replies of at least this many keys go through _batchq's C loops
_C_KEYS = 16

__all__ = [
    "PROTOCOL_VERSION",
    "Op",
    "Status",
    "Limits",
    "DecodeError",
    "RequestDecoder",
    "grow_untracked",
    "ReplyEncoder",
    "encode_request",
    "decode_request",
    "encode_reply",
    "decode_reply",
    "STATUS_ERRORS",
    "error_for",
]

#: Bumped on any incompatible change of the header or a body.
#: 2: HELLO opens a session (nonce, door token, liveness proof); token_digest.
PROTOCOL_VERSION = 2


class Op(enum.IntEnum):
    """Request types."""

    HELLO = 1
    ALLOC = 2
    COMMIT = 3
    LOOKUP = 4
    RELEASE = 5
    PUT = 6
    GET = 7
    EXISTS = 8
    MATCH_PREFIX = 9
    DELETE = 10
    EVICT = 11
    STATS = 12
    PURGE = 13
    LIST = 14
    # cluster and handoff ops (kvshm.zmq_ctrl.ops_cluster); numbered apart
    CLUSTER_VIEW = 40
    PIN = 41
    RENEW = 42
    UNPIN = 43
    DRAIN = 44
    RESERVE = 50  # same-host write-behind (kvshm.zmq_ctrl.ops_local)
    PLACE = 51
    BYE = 52               # end this session now (kvshm.zmq_ctrl.ops_session)


class Status(enum.IntEnum):
    """Reply and per-key status codes."""

    OK = 0
    MALFORMED = 1          # the request could not be decoded or has wrong types
    UNKNOWN_OP = 2
    BAD_VERSION = 3        # protocol version mismatch
    STALE_EPOCH = 4        # the server restarted since this client's HELLO
    INVALID_KEY = 5        # empty, too long, or not bytes/str
    TOO_LARGE = 6          # value larger than the pool or the per-value limit
    POOL_FULL = 7          # nothing evictable left to make room
    NOT_FOUND = 8
    INVALID_REQUEST = 9    # batch too large, negative size, frame count mismatch, ...
    QUOTA_EXCEEDED = 10    # per-client pending-bytes or pin limit
    LEASE_EXPIRED = 11     # the grant named by a COMMIT no longer exists
    INTERNAL = 12          # a server bug; the server logs it and goes on
    UNSUPPORTED = 13       # the server does not offer what was asked (e.g. RDMA)
    CORRUPT = 14           # a stored checksum did not match
    UNAUTHORIZED = 15      # HELLO without the server's token (or CURVE key)


class DecodeError(ValueError):
    """A frame that does not decode to a well-formed header."""


_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack

#: A batch PUT's or ALLOC's header packed in C, the bytes msgpack makes
#: (:func:`kvshm._batch.pack_request`); the environment variable ``KVSHM_FAST_PACK=0``
#: (read at import) packs every header with msgpack, for A/B figures.
_pack_request: Any = None
if os.environ.get("KVSHM_FAST_PACK", "1") != "0":
    try:
        from kvshm._batch import pack_request as _pack_request
    except ImportError:         # the extension not built: msgpack packs them all
        _pack_request = None
#: Runs of plain items of a long request's arrays found in C
#: (:func:`kvshm._batch.scan_plain`) and decoded by one ``unpackb``; the environment
#: variable ``KVSHM_FAST_DECODE=0`` (read at import) decodes item by item, for A/B figures.
_scan_plain: Any = None
if os.environ.get("KVSHM_FAST_DECODE", "1") != "0":
    try:
        from kvshm._batch import scan_plain as _scan_plain
    except ImportError:
        _scan_plain = None
#: A long reply list of ints 0..127 (a batch's statuses) packed in C by
#: :func:`kvshm._batch.pack_fixints` (msgpack's bytes: one byte an item) inside
#: :class:`ReplyEncoder`; the environment variable ``KVSHM_FAST_REPLY=0`` (read at
#: import) packs them all with msgpack, for A/B figures.
_pack_fixints: Any = None
if os.environ.get("KVSHM_FAST_REPLY", "1") != "0":
    try:
        from kvshm._batch import pack_fixints as _pack_fixints
    except ImportError:
        _pack_fixints = None


#: Decoded lists of at least this many plain items are untracked (the module's "Garbage
#: collection"); shorter ones are not worth the pass over their items.
UNTRACK_MIN = 256
_untrack: Any = None
if os.environ.get("KVSHM_UNTRACK", "1") != "0":
    try:
        from kvshm._gcutil import untrack_plain as _untrack
    except ImportError:
        _untrack = None


def _untrack_lists(body: dict[Any, Any]) -> None:
    """:func:`kvshm._gcutil.untrack_plain` on each long list value of a decoded body."""
    for v in body.values():
        if type(v) is list and len(v) >= UNTRACK_MIN:
            _untrack(v)


def grow_untracked(lst: list[Any], items: Any) -> None:
    """``lst.extend(items)``, ``lst`` kept off the collector's lists while every item is
    of an untracked type (a sliced request's reply lists of sizes, sums, counts, grown
    slice by slice: :func:`kvshm._gcutil.untrack_plain` checks only the new items)."""
    n0 = len(lst)
    lst.extend(items)
    if _untrack is not None and len(lst) >= UNTRACK_MIN:
        _untrack(lst, n0)


def encode_request(op: int, req_id: int, epoch: int, body: dict[str, Any]) -> bytes:
    """Header frame of a request (a batch PUT's or ALLOC's packed in C, the same bytes:
    :func:`kvshm._batch.pack_request`; a keys-only batch's by ``_batchq``)."""
    if (op == Op.PUT or op == Op.ALLOC) and _pack_request is not None:
        # (the C packer steps aside for a field that is not an int64: msgpack packs it)
        h = _pack_request(PROTOCOL_VERSION, int(op), req_id, epoch, body)
        if h is not None:
            return h  # type: ignore[no-any-return]
    if _batchq is not None and type(body) is dict and len(body) == 1:
        keys = body.get("keys")
        if type(keys) is list and len(keys) >= _C_KEYS:
            h = _batchq.pack_keys_request(PROTOCOL_VERSION, op, req_id, epoch, keys)
            if h is not None:
                return h  # type: ignore[no-any-return]
    return _packb([PROTOCOL_VERSION, int(op), req_id, epoch, body])


def encode_reply(status: int, req_id: int, body: dict[str, Any] | None = None) -> bytes:
    """Header frame of a reply."""
    return _packb([PROTOCOL_VERSION, int(status), req_id, body if body is not None else {}])


def _unpack(frame: bytes | memoryview) -> Any:
    try:
        # unpackb bounds every container by the frame length, so a hostile frame cannot
        # make the decoder allocate more than it sent.
        return msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types (ExtraData, ValueError, ...)
        raise DecodeError(f"undecodable header frame: {exc}") from None


def decode_request(frame: bytes | memoryview) -> tuple[int, int, int, int, dict[str, Any]]:
    """Split a request header into ``(version, op, req_id, epoch, body)``.

    The version is returned, not checked, so the server can answer BAD_VERSION with the
    request id. ``op`` is returned as a plain int (unknown values are the caller's to
    refuse).

    Raises
    ------
    DecodeError
        Not a 5-element msgpack array of (int, int, int, int, map).
    """
    h = _unpack(frame)
    if type(h) is list and len(h) == 5:         # the common case, checked at once
        version, op, req_id, epoch, body = h
        if (type(version) is int and type(op) is int and type(req_id) is int
                and type(epoch) is int and type(body) is dict):
            if _untrack is not None and len(frame) >= UNTRACK_MIN:
                _untrack_lists(body)
            return version, op, req_id, epoch, body
    if not isinstance(h, list) or len(h) != 5:
        raise DecodeError("request header must be a 5-element array")
    version, op, req_id, epoch, body = h
    for name, v in (("version", version), ("op", op), ("req_id", req_id), ("epoch", epoch)):
        if type(v) is not int:
            raise DecodeError(f"request header field {name} must be an int")
    if not isinstance(body, dict):
        raise DecodeError("request body must be a map")
    return version, op, req_id, epoch, body


class RequestDecoder:
    """:func:`decode_request` a bounded number of msgpack items at a time, so that the
    server decodes a request of 100 k keys (~15-25 ms in one go) over several turns of its
    loop, serving other clients between. The same checks as :func:`decode_request` (and
    msgpack's ``unpackb``: map keys str or bytes, nothing after the header), raised as
    :class:`DecodeError`.

    ``step(budget)`` decodes about ``budget`` more items; it returns
    ``(version, op, req_id, epoch, body)`` once done, None before.
    """

    __slots__ = ("_gen",)

    def __init__(self, frame: Any) -> None:
        size = memoryview(frame).nbytes
        u = msgpack.Unpacker(raw=False, use_list=True, strict_map_key=True,
                             max_buffer_size=max(size, 1))
        u.feed(frame)
        # the walk is given what it reads, never the decoder: a generator holding its
        # decoder (``self``) while the decoder holds it is a reference cycle, which kept
        # each decoded request (its 100 k keys) alive until a young collection freed
        # them all at once (~20 requests, ~47 ms, issue 13); now it goes with the decoder
        self._gen = self._walk(u, size, frame)
        next(self._gen)             # to its first yield: step() sends the budgets

    def step(self, budget: int) -> tuple[int, int, int, int, dict[str, Any]] | None:
        try:
            return self._gen.send(budget)
        except StopIteration:       # pragma: no cover - the walk returns only by yield
            raise DecodeError("request header decoded twice") from None
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"undecodable header frame: {exc}") from None

    @staticmethod
    def _walk(u: Any, size: int, frame: Any) -> Any:
        budget = yield None
        left = budget
        try:
            n = u.read_array_header()
        except ValueError:
            raise DecodeError("request header must be a 5-element array") from None
        if n != 5:
            raise DecodeError("request header must be a 5-element array")
        head = [u.unpack() for _ in range(4)]
        try:
            nmap = u.read_map_header()
        except ValueError:
            body_is_map = False
        else:
            body_is_map = True
        if not body_is_map:
            u.unpack()              # the body, whatever it is: checked after the ints
            nmap = 0
        for name, v in zip(("version", "op", "req_id", "epoch"), head):
            if type(v) is not int:
                raise DecodeError(f"request header field {name} must be an int")
        if not body_is_map:
            raise DecodeError("request body must be a map")
        body: dict[Any, Any] = {}
        for _ in range(nmap):
            k = u.unpack()
            if type(k) is not str and type(k) is not bytes:
                raise DecodeError(f"undecodable header frame: {type(k).__name__} is not "
                                  "allowed for map key when strict_map_key=True")
            try:
                m = u.read_array_header()
            except ValueError:      # not an array: the value in one go
                body[k] = u.unpack()
                left -= 1
            else:
                lst: list[Any] = []
                app = lst.append
                unpack = u.unpack
                # untracked from the start (while it grows over turns, too), tracked
                # again should an item that is not plain come
                plain = _untrack is not None and m >= UNTRACK_MIN and _untrack(lst)
                while m > 0:
                    if left <= 0:
                        budget = yield None
                        left = budget
                    k2 = min(m, left)
                    if k2 >= 16 and _scan_plain is not None:
                        # a run of plain items (bins, ints: a batch's keys and sizes)
                        # decoded by one unpackb, the same objects as item by item
                        pos = u.tell()
                        end = _scan_plain(frame, pos, k2)
                        if end >= 0:
                            lst.extend(msgpack.unpackb(
                                (b"\xdd" + k2.to_bytes(4, "big")) + u.read_bytes(end - pos),
                                raw=False, use_list=True, strict_map_key=True))
                            m -= k2
                            left -= k2
                            continue
                    n0 = len(lst)
                    for _ in range(k2):
                        app(unpack())
                    if plain:
                        plain = _untrack(lst, n0)
                    m -= k2
                    left -= k2
                body[k] = lst
            if left <= 0:
                budget = yield None
                left = budget
        if u.tell() != size:
            raise DecodeError("undecodable header frame: unpack(b) received extra data.")
        version, op, req_id, epoch = head
        while True:
            yield (version, op, req_id, epoch, body)


class ReplyEncoder:
    """:func:`encode_reply` a bounded number of items at a time (the lists of a reply of
    100 k keys take ~5-10 ms in one go): byte for byte the same header. The body's lists
    are packed in chunks (each chunk packed as an array by msgpack, its array header
    dropped), the rest in one go.

    ``step(budget)`` packs about ``budget`` more list items; returns the header once done,
    None before.
    """

    __slots__ = ("_gen",)

    def __init__(self, status: int, req_id: int, body: dict[str, Any]) -> None:
        self._gen = self._walk(int(status), req_id, body)
        next(self._gen)

    def step(self, budget: int) -> bytes | None:
        r: bytes | None = self._gen.send(budget)
        return r

    @staticmethod
    def _walk(status: int, req_id: int, body: dict[str, Any]) -> Any:
        pk = msgpack.Packer(use_bin_type=True, autoreset=True)
        out = [pk.pack_array_header(4), pk.pack(PROTOCOL_VERSION), pk.pack(status),
               pk.pack(req_id), pk.pack_map_header(len(body))]
        budget = yield None
        left = budget
        for k, v in body.items():
            out.append(pk.pack(k))
            if type(v) is not list:
                out.append(pk.pack(v))
                continue
            n = len(v)
            out.append(pk.pack_array_header(n))
            a = 0
            while a < n:
                if left <= 0:
                    budget = yield None
                    left = budget
                b = min(n, a + left, a + 0xFFFF)
                m = b - a
                chunk = _pack_fixints(v, a, b) if _pack_fixints is not None else None
                if chunk is not None:       # small ints: the same bytes, one C loop
                    out.append(chunk)
                else:
                    chunk = pk.pack(v[a:b])     # drop the chunk's own array header
                    out.append(chunk[1 if m <= 15 else 3:])
                left -= m
                a = b
        header = b"".join(out)
        while True:
            yield header


def decode_reply(frame: bytes | memoryview) -> tuple[int, int, dict[str, Any]]:
    """Split a reply header into ``(status, req_id, body)``.

    Raises
    ------
    DecodeError
        Malformed header or another protocol version.
    """
    if _batchq is not None and len(frame) > 64:
        r = _batchq.unpack_found_reply(frame, PROTOCOL_VERSION)
        if r is not None:
            return r  # type: ignore[no-any-return]
    h = _unpack(frame)
    if not isinstance(h, list) or len(h) != 4:
        raise DecodeError("reply header must be a 4-element array")
    version, status, req_id, body = h
    if version != PROTOCOL_VERSION:
        raise DecodeError(f"server speaks protocol {version}, this client {PROTOCOL_VERSION}")
    if type(status) is not int or type(req_id) is not int or not isinstance(body, dict):
        raise DecodeError("reply header has wrong field types")
    return status, req_id, body


def _errors() -> dict[int, type[Exception]]:
    from kvshm import errors as e

    return {
        Status.MALFORMED: e.InvalidRequest,
        Status.UNKNOWN_OP: e.InvalidRequest,
        Status.BAD_VERSION: e.ProtocolError,
        Status.STALE_EPOCH: e.ProtocolError,
        Status.INVALID_KEY: e.InvalidKey,
        Status.TOO_LARGE: e.ValueTooLarge,
        Status.POOL_FULL: e.PoolFull,
        Status.NOT_FOUND: e.KeyNotFound,
        Status.INVALID_REQUEST: e.InvalidRequest,
        Status.QUOTA_EXCEEDED: e.QuotaExceeded,
        Status.LEASE_EXPIRED: e.LeaseExpired,
        Status.INTERNAL: e.KvshmError,
        Status.UNSUPPORTED: e.TransportError,
        Status.CORRUPT: e.CorruptValue,
        Status.UNAUTHORIZED: e.AuthenticationFailed,
    }


STATUS_ERRORS = _errors()


def error_for(status: int, message: str) -> Exception:
    """The exception a client raises for a non-OK status."""
    cls = STATUS_ERRORS.get(status)
    if cls is None:
        from kvshm.errors import ProtocolError

        return ProtocolError(f"unknown status {status}: {message}")
    return cls(message)
