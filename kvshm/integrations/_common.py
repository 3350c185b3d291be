"""What the engine integrations share: a client that survives server restarts, and
self-describing values (a small header, then the raw KV bytes) moved with one copy.

Nothing here imports an engine or torch.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar
from urllib.parse import quote

from kvshm._shmindex import KEY_MAX as LOCAL_KEY_MAX
from kvshm.errors import KvshmError, ServerUnavailable, TransportError, ValueTooLarge

__all__ = ["ResilientClient", "key_field", "layout_field", "ChunkHeader", "pack_header",
           "parse_header", "header_length", "HEADER_PROBE", "put_pieces", "get_pieces_into",
           "put_framed", "get_framed", "normalize_address", "as_bool", "raw_view"]

log = logging.getLogger(__name__)

T = TypeVar("T")


#: What starts a key field written by :func:`key_field` in its escaped form. ``quote``
#: never writes it (``%`` is always followed by two hex digits there), nor ``"%h"``.
ESCAPED = "%~"


def key_field(s: str, sep: str = "|") -> str:
    """One field of a key whose fields are joined with ``sep`` (one or more separator
    characters): ``s`` as it is (today's keys byte for byte) unless it contains one of
    them or starts with :data:`ESCAPED`; then
    :data:`ESCAPED` + ``urllib.parse.quote(s, safe="")``, which holds no separator (no
    ``"|"``, ``"@"``, ``"%"`` but its own escapes, ``"/"``).

    Injective: two strings never give the same field (the escaped forms all start with
    :data:`ESCAPED`, the others never do, and ``quote`` is injective), and no field
    holds ``sep``, so the fields of a key split on ``sep`` again and two different
    configurations never share a key. A field already ``quote``'d (the model name)
    comes back unchanged.
    """
    if not any(c in s for c in sep) and not s.startswith(ESCAPED):
        return s
    return ESCAPED + quote(s, safe="")


def layout_field(name: str, canonical: bool = False, replicated: bool = False) -> str:
    """The layout field of a key: the engine's layout ``name`` (:func:`key_field`, with
    ``"+"`` a separator too), then ``"+canonical"`` and ``"+replicated"`` when those
    are on. A name as it is unless it holds ``"|"`` or ``"+"`` (today's keys byte for
    byte), so that a layout literally named ``"X+canonical"`` never shares the key of
    layout ``"X"`` with canonical rows: the field is injective in its three inputs."""
    out = key_field(name, "|+")
    if canonical:
        out += "+canonical"
    if replicated:
        out += "+replicated"
    return out


def compact_fields(fields: list[str], name_at: int, raw_len: int,
                   key_max: int = LOCAL_KEY_MAX) -> tuple[str, bool]:
    """The namespace ``"|".join(fields) + "|"`` of keys that end in a raw id of
    ``raw_len`` bytes, and whether the id goes in hex (True) or unpadded base64url.

    When the readable form (the fields as given, the id in hex) is longer than ``key_max``
    bytes (kvshm._shmindex.KEY_MAX: the shared-memory index does not publish longer keys,
    so each lookup of one would be a server round trip), ``fields[name_at]`` (a name as
    ``urllib.parse.quote(name, safe="")`` writes it) becomes ``"%h"`` + the base32 of its
    16-byte BLAKE2b and the id goes in base64url. ``quote`` never writes ``"%h"``, so the
    two forms never meet; neither writes ``"|"``, so the fields still split on it. The
    other fields are :func:`key_field`'s (no ``"|"`` either).
    """
    ns = "|".join(fields) + "|"
    if len(ns.encode()) + 2 * raw_len <= key_max:
        return ns, True
    out = list(fields)
    digest = hashlib.blake2b(fields[name_at].encode(), digest_size=16).digest()
    out[name_at] = "%h" + base64.b32encode(digest).decode().rstrip("=").lower()
    ns = "|".join(out) + "|"
    n = len(ns.encode()) + -(-raw_len * 4 // 3)
    if n > key_max:
        log.warning("keys of %d bytes exceed the %d that same-host clients read locally; "
                    "their lookups ask the server", n, key_max)
    return ns, False


def compact_key(namespace: bytes, hex_ids: bool, raw: bytes) -> bytes:
    """The key of id ``raw`` in a namespace of :func:`compact_fields`."""
    return namespace + (raw.hex().encode() if hex_ids
                        else base64.urlsafe_b64encode(raw).rstrip(b"="))


def normalize_address(url: str) -> str:
    """``kvshm://host:port``, ``tcp://host:port``, ``host:port`` or ``ipc://path`` as a
    :class:`kvshm.Client` address."""
    url = str(url).strip()
    if url.startswith("kvshm://"):
        url = url[len("kvshm://"):]
    return url.rstrip("/")


def as_bool(v: Any) -> bool:
    """A config value as a bool (``"0"``, ``"false"``, ``"no"``, ``""`` are False)."""
    if isinstance(v, str):
        return v.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(v)


_ctypes_arrays: dict[int, Any] = {}


def raw_view(ptr: int, size: int) -> memoryview:
    """A writable 1-D byte memoryview of ``size`` bytes at address ``ptr`` (host memory
    the caller owns and keeps alive: an engine's host KV pool)."""
    import ctypes

    t = _ctypes_arrays.get(size)
    if t is None:                  # one array type per size (sizes repeat: pages)
        t = _ctypes_arrays[size] = ctypes.c_ubyte * size
    return memoryview(t.from_address(ptr)).cast("B")


# --------------------------------------------------------------------------- the client


class ResilientClient:
    """A :class:`kvshm.Client` made on first use, that fails fast while the server is down.

    Engines build their storage plugins once, often before the kvshm server is up, and
    some (LMCache) swallow an exception from the plugin's constructor for good. So nothing
    here connects in ``__init__``. An engine must never stall per request on a missing
    server, so an unreachable server costs one short wait, then immediate failures
    (the engine's misses) until it answers again:

    - the first call, and the first call after a failure, first probe the server: a
      HELLO from a separate, short-lived client that waits at most ``probe_timeout``;
    - after a probe or a call found the server gone (no answer within its timeout),
      every call raises :class:`~kvshm.errors.ServerUnavailable` at once, while one
      background thread probes again every ``retry_interval`` seconds; when a probe is
      answered, calls go to the server again. A restarted server is found again by the
      client itself (it says HELLO again and maps the new segment).

    A server that dies in the middle of a call costs that call its ``timeout`` once.

    Thread-safe: the kvshm client serializes requests and copies in parallel.

    Parameters
    ----------
    address : str
        See :func:`normalize_address`.
    transport, timeout
        As :class:`kvshm.Client` (``timeout``: seconds per reply of a real call).
    retry_interval : float
        Seconds between background probes while the server is down.
    probe_timeout : float
        Seconds a probe waits for HELLO (default ``min(timeout, 0.5)``).
    label : str
        Names the owner in log lines.
    token_file : str, optional
        The server's door token file (:class:`kvshm.Client`'s ``token_file``; default: a
        same-host server's own, or ``$KVSHM_TOKEN_FILE``).
    """

    def __init__(self, address: str, *, transport: str = "auto", timeout: float = 5.0,
                 retry_interval: float = 1.0, probe_timeout: float | None = None,
                 label: str = "kvshm", token_file: str | None = None) -> None:
        self.address = normalize_address(address)
        self.transport = transport
        self.timeout = float(timeout)
        self.retry_interval = float(retry_interval)
        self.probe_timeout = float(min(self.timeout, 0.5) if probe_timeout is None
                                   else probe_timeout)
        self.label = label
        self.token_file = token_file or None
        self._client: Any = None
        self._lock = threading.Lock()
        self._state = threading.Condition(threading.Lock())
        self._known_up = False       # a probe or a call got an answer since the last failure
        self._down = False           # the server did not answer; the prober runs
        self._prober: threading.Thread | None = None
        self._closed = False

    def client(self) -> Any:
        """The kvshm client (made on first use; no request is sent here)."""
        c = self._client
        if c is not None:
            return c
        with self._lock:
            if self._closed:
                raise KvshmError(f"{self.label}: closed")
            if self._client is None:
                from kvshm.client import Client

                self._client = Client(self.address, transport=self.transport,
                                      timeout=self.timeout, connect=False,
                                      token_file=self.token_file)
            return self._client

    def _probe(self) -> bool:
        """One HELLO from a separate client that waits ``probe_timeout`` at most (with
        the TCP mover: a probe maps no pool)."""
        from kvshm.client import Client

        try:
            Client(self.address, transport="tcp", timeout=self.probe_timeout,
                   token_file=self.token_file).close()
        except (ServerUnavailable, TransportError):
            return False
        except KvshmError as exc:       # it answered (refused us, say): not down
            log.debug("%s: probe of %s: %s", self.label, self.address, exc)
        return True

    def _mark_down(self, exc: BaseException) -> None:
        with self._state:
            self._known_up = False
            if self._down or self._closed:
                return
            self._down = True
            log.warning("%s: kvshm server at %s unavailable (%s); calls fail at once, "
                        "probing every %.1f s until it answers", self.label, self.address,
                        exc, self.retry_interval)
            t = threading.Thread(target=self._probe_loop, name="kvshm-probe", daemon=True)
            self._prober = t
            t.start()

    def _probe_loop(self) -> None:
        while True:
            with self._state:
                self._state.wait_for(lambda: self._closed, timeout=self.retry_interval)
                if self._closed:
                    return
            if self._probe():
                with self._state:
                    self._down = False
                    self._known_up = True
                    self._prober = None
                log.warning("%s: kvshm server at %s answers again", self.label, self.address)
                return

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)``, failing at once while the server is known to be down.

        Raises
        ------
        ServerUnavailable
            The server did not answer now (a probe or this call), or is known not to
            have answered the last probe.
        """
        if self._closed:
            raise ServerUnavailable(f"{self.label}: the connection to kvshm at "
                                    f"{self.address} is closed")
        if self._down:
            raise ServerUnavailable(f"{self.label}: kvshm server at {self.address} did not "
                                    f"answer; probing again every {self.retry_interval:.1f} s")
        if not self._known_up:
            if not self._probe():
                exc = ServerUnavailable(f"{self.label}: kvshm server at {self.address} did "
                                        f"not answer HELLO within {self.probe_timeout} s")
                self._mark_down(exc)
                raise exc
            self._known_up = True
        try:
            return fn(self.client())
        except (ServerUnavailable, TransportError) as exc:
            self._mark_down(exc)
            raise

    @property
    def up(self) -> bool:
        """False while calls fail at once (the server did not answer the last probe)."""
        return not self._down

    def close(self) -> None:
        """Stop probing and close the kvshm client (idempotent)."""
        with self._state:
            self._closed = True
            self._state.notify_all()
            t = self._prober
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.probe_timeout + 1.0)
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            c.close()


# --------------------------------------------------------------------------- values

# A value is a header followed by the payload (raw KV bytes). The header, little-endian:
#   0  4s  magic b"KVH1"
#   4  B   version (1)
#   5  B   fmt: an engine-defined format code (LMCache: MemoryFormat value)
#   6  B   ngroups: number of (dtype, shape) pairs that follow
#   7  B   0
#   8  I   header length in bytes (this prefix, the groups, zero padding to 64n)
#  12  I   0
#  16  Q   payload length in bytes
#  24  per group: B dtype-name length, the ASCII dtype name ("bfloat16"),
#      B ndim, then ndim x Q dims
# The payload starts at the header length (a multiple of 64 bytes).
_MAGIC = b"KVH1"
_VERSION = 1
_PREFIX = struct.Struct("<4sBBBBIIQ")
_ALIGN = 64
#: Bytes read first to parse a header (enough for a few groups of 4-D shapes).
HEADER_PROBE = 256


@dataclass(frozen=True)
class ChunkHeader:
    """What travels in front of the payload: format, per-group dtype names and shapes."""

    fmt: int
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    payload_len: int
    header_len: int = 0


def pack_header(fmt: int, dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                payload_len: int) -> bytes:
    """The header bytes for a payload of ``payload_len`` bytes (a multiple of 64 long).

    Raises
    ------
    ValueError
        Mismatched lengths, more than 255 groups or dims, a dtype name longer than 255.
    """
    if len(dtypes) != len(shapes) or not 0 < len(dtypes) < 256:
        raise ValueError(f"need 1..255 groups with one dtype and one shape each, got "
                         f"{len(dtypes)} dtypes and {len(shapes)} shapes")
    body = bytearray()
    for d, s in zip(dtypes, shapes):
        name = str(d).encode("ascii")
        if not 0 < len(name) < 256 or len(s) > 255:
            raise ValueError(f"bad group: dtype {d!r}, shape {tuple(s)}")
        body += struct.pack("<B", len(name)) + name + struct.pack("<B", len(s))
        body += struct.pack(f"<{len(s)}Q", *(int(x) for x in s))
    n = _PREFIX.size + len(body)
    total = (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return (_PREFIX.pack(_MAGIC, _VERSION, int(fmt), len(dtypes), 0, total, 0,
                         int(payload_len)) + bytes(body) + bytes(total - n))


def header_length(buf: Any) -> int:
    """The header length that a value starting with ``buf`` declares.

    Raises
    ------
    ValueError
        Not a kvshm chunk header (bad magic or version, too short).
    """
    m = memoryview(buf).cast("B")
    if m.nbytes < _PREFIX.size:
        raise ValueError(f"value of {m.nbytes} bytes is too short for a header")
    magic, ver, _fmt, _ng, _r, hlen, _r2, _plen = _PREFIX.unpack_from(m, 0)
    if magic != _MAGIC or ver != _VERSION:
        raise ValueError(f"not a kvshm chunk value (magic {bytes(magic)!r}, version {ver})")
    return int(hlen)


def parse_header(buf: Any) -> ChunkHeader:
    """Parse a header from the start of ``buf`` (which must hold all of it).

    Raises
    ------
    ValueError
        Bad magic or version, or a truncated or malformed header.
    """
    m = memoryview(buf).cast("B")
    hlen = header_length(m)
    if hlen > m.nbytes or hlen < _PREFIX.size:
        raise ValueError(f"header declares {hlen} bytes; {m.nbytes} available")
    _magic, _ver, fmt, ng, _r, _hl, _r2, plen = _PREFIX.unpack_from(m, 0)
    off = _PREFIX.size
    dtypes, shapes = [], []
    try:
        for _ in range(ng):
            n = m[off]
            dtypes.append(bytes(m[off + 1:off + 1 + n]).decode("ascii"))
            off += 1 + n
            nd = m[off]
            off += 1
            shapes.append(tuple(struct.unpack_from(f"<{nd}Q", m, off)))
            off += 8 * nd
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed kvshm chunk header: {exc}") from None
    if off > hlen:
        raise ValueError("malformed kvshm chunk header: groups run past its length")
    return ChunkHeader(int(fmt), tuple(dtypes), tuple(shapes), int(plen), hlen)


# --------------------------------------------------------------------------- moves


class _PiecesSource:
    """Each value written as several pieces, in order, into one pool entry (one copy of
    each piece); over TCP each value is joined into one buffer first (an extra copy)."""

    def __init__(self, keys: list[bytes], pieces: Sequence[Sequence[Any]]) -> None:
        self.keys = keys
        self.pieces = pieces
        self.sizes = [sum(memoryview(p).nbytes for p in ps) for ps in pieces]
        self._bufs: list[Any] | None = None

    def buffers(self) -> list[Any]:
        if self._bufs is None:
            self._bufs = [memoryview(b"".join(ps)) for ps in self.pieces]
        return self._bufs

    def to_pool(self, mover: Any, offsets: list[int], idx: list[int]) -> None:
        offs: list[int] = []
        vals: list[Any] = []
        ks: list[bytes] = []
        for i, o in zip(idx, offsets):
            k = self.keys[i]
            for p in self.pieces[i]:
                n = memoryview(p).nbytes
                if n:
                    offs.append(o)
                    vals.append(p)
                    ks.append(k)
                o += n
        if offs:
            mover.write(offs, vals, ks)


def put_pieces(client: Any, keys: Sequence[Any], pieces: Sequence[Sequence[Any]]) -> None:
    """Store the concatenation of ``pieces[i]`` (byte buffers) under ``keys[i]``, with one
    ALLOC and one COMMIT for all keys.

    With the shared-memory (or RDMA) mover each piece is copied once, straight into the
    pool: nothing is joined first. The buffers must stay unchanged until this returns.

    Raises
    ------
    As :meth:`kvshm.Client.put_batch` (``ValueTooLarge`` for a value over the limit).
    """
    s = client.session

    def op() -> Any:
        bkeys = s.keys(keys)
        if len(pieces) != len(bkeys):
            raise ValueError(f"{len(bkeys)} keys but {len(pieces)} values")
        if not bkeys:
            return None
        src = _PiecesSource(bkeys, pieces)
        limit = s.limits.max_value_bytes or s.capacity
        for k, n in zip(bkeys, src.sizes):
            if limit and n > limit:
                raise ValueTooLarge(f"value for key {k!r} is {n} bytes; the server takes "
                                    f"at most {limit}")
        return (yield from s.op_put_batch(bkeys, (), False, source=src))

    client.run_op(op())


def put_framed(client: Any, keys: Sequence[Any], headers: Sequence[bytes],
               payloads: Sequence[memoryview]) -> None:
    """Store ``headers[i] + payloads[i]`` under ``keys[i]`` (see :func:`put_pieces`: the
    payload is copied once, straight into the pool)."""
    if len(headers) != len(payloads):
        raise ValueError(f"{len(headers)} headers but {len(payloads)} payloads")
    put_pieces(client, keys, [(h, p) for h, p in zip(headers, payloads)])


class _PrefixGate:
    """Prefix semantics for hits that arrive one by one over TCP: with ``prefix``, only
    the leading run of keys is taken; a gap (a miss, a refused value) ends it."""

    prefix: bool
    _next: int
    _stopped: bool

    def _in_prefix(self, i: int) -> bool:
        if not self.prefix:
            return True
        if self._stopped or i != self._next:
            self._stopped = True
            return False
        self._next = i + 1
        return True


class _PiecesSink(_PrefixGate):
    """Hits of a lookup copied into several destination pieces per key."""

    def __init__(self, keys: list[bytes], outs: Sequence[Sequence[memoryview]],
                 prefix: bool) -> None:
        self.keys = keys
        self.outs = outs
        self.want = [sum(o.nbytes for o in os_) for os_ in outs]
        self.prefix = prefix
        self.found = [False] * len(keys)
        self._next = 0
        self._stopped = False

    def _size_ok(self, i: int, size: int) -> bool:
        if size == self.want[i]:
            return True
        log.warning("key %r holds %d bytes where %d were expected (another model, dtype, "
                    "page size or layout?); taken as a miss", self.keys[i], size, self.want[i])
        return False

    def from_pool(self, mover: Any, offsets: list[int], sizes: list[int],
                  idx: list[int]) -> None:
        offs: list[int] = []
        lens: list[int] = []
        views: list[memoryview] = []
        ks: list[bytes] = []
        for n, (i, o, s) in enumerate(zip(idx, offsets, sizes)):
            if self.prefix and i != n:
                break
            if not self._size_ok(i, s):
                if self.prefix:
                    break
                continue
            for v in self.outs[i]:
                if v.nbytes:
                    offs.append(o)
                    lens.append(v.nbytes)
                    views.append(v)
                    ks.append(self.keys[i])
                o += v.nbytes
            self.found[i] = True
        if offs:
            mover.read_into(offs, lens, views, ks)

    def from_frame(self, i: int, buf: Any) -> None:
        if not self._in_prefix(i):
            return
        m = memoryview(buf).cast("B")
        if not self._size_ok(i, m.nbytes):
            self._stopped = True
            return
        o = 0
        for v in self.outs[i]:
            v[:] = m[o:o + v.nbytes]
            o += v.nbytes
        self.found[i] = True


def get_pieces_into(client: Any, keys: Sequence[Any], outs: Sequence[Sequence[memoryview]],
                    *, prefix: bool = False) -> list[bool]:
    """Copy the value of ``keys[i]`` into the pieces ``outs[i]`` (writable 1-D byte views,
    filled in order), with one LOOKUP for all keys; with the shared-memory mover each piece
    is one copy straight out of the pool.

    A value whose size is not the total size of its pieces counts as a miss (logged).

    Parameters
    ----------
    prefix : bool
        Stop at the first miss: nothing after it is copied.

    Returns
    -------
    list of bool
        Whether each key was found (and its pieces filled).
    """
    s = client.session
    if len(outs) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(outs)} destinations")

    def op() -> Any:
        bkeys = s.keys(keys)
        sink = _PiecesSink(bkeys, outs, prefix)
        if bkeys:
            yield from s.op_lookup_copy(bkeys, None, False, sink=sink)
        return sink.found

    return client.run_op(op())  # type: ignore[no-any-return]


# allocate(header, index) -> (owner object, writable 1-D byte view of >= payload bytes),
# or None when no memory is free now
Allocator = Callable[[ChunkHeader, int], "tuple[Any, memoryview] | None"]


class _FramedSink(_PrefixGate):
    """Hits of a lookup: parse each header, allocate the destination, copy the payload
    once from the pool into it."""

    def __init__(self, keys: list[bytes], allocate: Allocator,
                 release: Callable[[Any], None], prefix: bool) -> None:
        self.keys = keys
        self.allocate = allocate
        self.release = release
        self.prefix = prefix
        self.objs: list[Any] = [None] * len(keys)
        self.deferred: list[int] = []      # hits left out because allocate returned None
        self.bad: list[int] = []           # hits whose value is not a chunk value
        self._next = 0
        self._stopped = False

    def release_all(self) -> None:
        for i, o in enumerate(self.objs):
            if o is not None:
                self.objs[i] = None
                self.release(o)

    def _header(self, i: int, head: Any, size: int) -> ChunkHeader | None:
        try:
            h = parse_header(head)
        except ValueError as exc:
            log.warning("key %r: %s; taken as a miss", self.keys[i], exc)
            self.bad.append(i)
            return None
        if h.header_len + h.payload_len != size:
            log.warning("key %r: header says %d + %d bytes, the value is %d; taken as a "
                        "miss", self.keys[i], h.header_len, h.payload_len, size)
            self.bad.append(i)
            return None
        return h

    def _alloc(self, i: int, h: ChunkHeader) -> memoryview | None:
        got = self.allocate(h, i)
        if got is None:
            self.deferred.append(i)
            return None
        obj, view = got
        self.objs[i] = obj
        if view.nbytes < h.payload_len:
            raise ValueError(f"key {self.keys[i]!r}: destination of {view.nbytes} bytes for "
                             f"a payload of {h.payload_len}")
        return view

    def from_pool(self, mover: Any, offsets: list[int], sizes: list[int],
                  idx: list[int]) -> None:
        try:
            self._from_pool(mover, offsets, sizes, idx)
        except BaseException:
            self.release_all()
            raise

    def _from_pool(self, mover: Any, offsets: list[int], sizes: list[int],
                   idx: list[int]) -> None:
        if self.prefix:       # only the leading run of hits matters
            n = 0
            while n < len(idx) and idx[n] == n:
                n += 1
            idx, offsets, sizes = idx[:n], offsets[:n], sizes[:n]
        if not idx:
            return
        ks = [self.keys[i] for i in idx]
        heads = mover.read_bytes(offsets, [min(s, HEADER_PROBE) for s in sizes], ks)
        for j, (i, o, s) in enumerate(zip(idx, offsets, sizes)):
            try:
                hl = header_length(heads[j])
            except ValueError:
                continue        # reported by _header below
            if HEADER_PROBE < hl <= s:
                heads[j] = mover.read_bytes([o], [hl], [self.keys[i]])[0]
        p_off: list[int] = []
        p_len: list[int] = []
        p_out: list[memoryview] = []
        p_key: list[bytes] = []
        for j, (i, o, s) in enumerate(zip(idx, offsets, sizes)):
            h = self._header(i, heads[j], s)
            view = self._alloc(i, h) if h is not None else None
            if view is None:
                if self.prefix:
                    break
                continue
            p_off.append(o + h.header_len)     # type: ignore[union-attr]
            p_len.append(h.payload_len)        # type: ignore[union-attr]
            p_out.append(view)
            p_key.append(self.keys[i])
        if p_off:
            mover.read_into(p_off, p_len, p_out, p_key)

    def from_frame(self, i: int, buf: Any) -> None:
        try:
            self._from_frame(i, buf)
        except BaseException:
            self.release_all()
            raise

    def _from_frame(self, i: int, buf: Any) -> None:
        if not self._in_prefix(i):
            return
        m = memoryview(buf).cast("B")
        h = self._header(i, m, m.nbytes)
        view = self._alloc(i, h) if h is not None else None
        if view is None:
            self._stopped = True
            return
        view[:h.payload_len] = m[h.header_len:h.header_len + h.payload_len]  # type: ignore[union-attr]


def get_framed(client: Any, keys: Sequence[Any], allocate: Allocator,
               release: Callable[[Any], None], *, prefix: bool = False,
               alloc_wait: float = 0.0) -> list[Any]:
    """Read chunk values into destinations that ``allocate`` makes from each header.

    One LOOKUP for all keys; with the shared-memory mover each payload is copied once,
    pool -> destination, while the entries are pinned. ``allocate(header, i)`` must not
    block (it runs while entries are pinned); when it returns None (no memory free now),
    the key is tried again, after the pins are released, until ``alloc_wait`` seconds
    have passed, then counted as a miss.

    Parameters
    ----------
    prefix : bool
        Only the leading run matters: stop at the first miss (nothing after it is copied
        or allocated).

    Returns
    -------
    list
        The owner object per key (None for a miss). The caller owns them.

    Raises
    ------
    As :meth:`kvshm.Client.get_batch` (destinations allocated so far are released first).
    """
    s = client.session
    bkeys = list(keys)
    out: list[Any] = [None] * len(bkeys)
    todo = list(range(len(bkeys)))
    deadline = time.monotonic() + alloc_wait
    while todo:
        sink = _FramedSink([bkeys[i] for i in todo], allocate, release, prefix)

        def op(sink: _FramedSink = sink) -> Any:
            ks = s.keys(sink.keys)
            sink.keys = ks
            if not ks:
                return None
            return (yield from s.op_lookup_copy(ks, None, False, sink=sink))

        try:
            client.run_op(op())
        except BaseException:
            sink.release_all()
            for o in out:
                if o is not None:
                    release(o)
            raise
        for j, o in enumerate(sink.objs):
            out[todo[j]] = o
        if not sink.deferred or time.monotonic() >= deadline:
            break
        first = min(sink.deferred)
        if prefix:      # everything from the first deferred key on is read again
            for j in range(first, len(todo)):
                if sink.objs[j] is not None:
                    release(sink.objs[j])
                    out[todo[j]] = None
            todo = todo[first:]
        else:
            todo = [todo[j] for j in sorted(sink.deferred)]
        time.sleep(0.01)
    if prefix:          # the leading run only
        for i, o in enumerate(out):
            if o is None:
                for j in range(i + 1, len(out)):
                    if out[j] is not None:
                        release(out[j])
                        out[j] = None
                break
    return out
