"""Payload frames of the TCP mover: large values alone, small values packed.

A PUT request and a GET reply carry their values in payload frames. A value of at least
:data:`PACK_BELOW` bytes travels alone in its own frame, zero-copy from the caller's
buffer (PUT) or from the pool (GET). Smaller values are packed back to back into frames
of up to :data:`PACK_FRAME_BYTES`: one copy, but one frame instead of hundreds, and a
ZeroMQ frame costs tens of microseconds of fixed work (measured: 256 frames of 64 KiB
move at 1.4 GB/s, the same 16 MiB as 4 frames at 2.5 GB/s and as one at 3.6 GB/s).

The body then says how: ``sizes`` (bytes of each value, in order) and ``counts`` (how
many consecutive values each frame holds). A frame's length is exactly the sum of its
values' sizes. The one exception: a GET reply sends a large value laid over several
block runs zero-copy as one frame per run, the first with a count of 1 and each further
one with a count of 0 (it continues the value of the frame before).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

__all__ = ["PACK_BELOW", "PACK_FRAME_BYTES", "FrameLayoutError", "pack", "unpack", "plan",
           "into", "placed"]

#: Values smaller than this (bytes) are packed; larger ones travel zero-copy alone.
PACK_BELOW = 256 << 10
#: A packed frame grows to at most this many bytes.
PACK_FRAME_BYTES = 8 << 20


class FrameLayoutError(ValueError):
    """Frames that do not match the sizes and counts given with them."""


def plan(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Group value indices into frames: a list of ``(first, count)``."""
    groups: list[tuple[int, int]] = []
    start = -1
    acc = 0
    for i, n in enumerate(sizes):
        if n >= PACK_BELOW:
            if start >= 0:
                groups.append((start, i - start))
                start = -1
            groups.append((i, 1))
            continue
        if start >= 0 and acc + n > PACK_FRAME_BYTES:
            groups.append((start, i - start))
            start = -1
        if start < 0:
            start, acc = i, 0
        acc += n
    if start >= 0:
        groups.append((start, len(sizes) - start))
    return groups


def pack(views: Sequence[memoryview]) -> tuple[list[Any], list[int]]:
    """Frames and per-frame counts for byte views (see the module docstring)."""
    frames: list[Any] = []
    counts: list[int] = []
    for first, count in plan([v.nbytes for v in views]):
        frames.append(views[first] if count == 1 else b"".join(views[first:first + count]))
        counts.append(count)
    return frames, counts


def unpack(frames: Sequence[Any], counts: Sequence[Any], sizes: Sequence[Any]
           ) -> list[Any]:
    """Views of each value in ``frames``: zero-copy, but a value sent in several frames
    (counts of 0 after a count of 1) is joined into one bytes object.

    Raises
    ------
    FrameLayoutError
        Counts or sizes that are not non-negative ints, or that do not add up to the
        frames' lengths.
    """
    if len(counts) != len(frames):
        raise FrameLayoutError(f"{len(frames)} payload frames but {len(counts)} counts")
    if any(type(c) is not int or c < 0 for c in counts):
        raise FrameLayoutError("counts must be ints >= 0")
    if sum(counts) != len(sizes):
        raise FrameLayoutError(f"counts add up to {sum(counts)} values, sizes give "
                               f"{len(sizes)}")
    if any(type(n) is not int or n < 0 for n in sizes):
        raise FrameLayoutError("sizes must be ints >= 0")
    out: list[Any] = []
    i = 0
    for fi, more, count in _groups(counts, len(frames)):
        buf = _bytes_view(frames[fi])
        if more > fi + 1:               # one value in frames fi .. more - 1
            parts = [buf] + [_bytes_view(f) for f in frames[fi + 1:more]]
            whole = b"".join(parts)
            if len(whole) != sizes[i]:
                raise FrameLayoutError(f"frames {fi}-{more - 1} hold {len(whole)} bytes, "
                                       f"their value {sizes[i]}")
            out.append(memoryview(whole))
            i += 1
            continue
        pos = 0
        for n in sizes[i:i + count]:
            out.append(buf[pos:pos + n])
            pos += n
        if pos != buf.nbytes:
            raise FrameLayoutError(f"frame {fi} holds {buf.nbytes} bytes, its {count} "
                                   f"values {pos}")
        i += count
    return out


def _groups(counts: Sequence[Any], nf: int) -> Iterator[tuple[int, int, int]]:
    """The walk of a payload's ``nf`` frames by ``counts`` (ints >= 0, checked by the
    caller) that :func:`unpack` and :func:`placed` share: ``(first, end, count)`` of
    each run of frames that holds ``count`` whole values (frames ``first .. end - 1``:
    one frame, or a value of one frame continued by frames of count 0).

    Raises FrameLayoutError (as the walk reaches it: a reply's errors are found in the
    order they were) for a count of 0 that continues no value of one frame."""
    if 0 not in counts:             # (the common case: each frame whole values, no walk)
        return zip(range(nf), range(1, nf + 1), counts)
    return _walk(counts, nf)


def _walk(counts: Sequence[Any], nf: int) -> Iterator[tuple[int, int, int]]:
    """:func:`_groups` of counts with a 0 in them (a value continued over frames)."""
    fi = 0
    while fi < nf:
        count = counts[fi]
        if count == 0:
            raise FrameLayoutError(f"frame {fi} continues a value, but the frame before "
                                   "does not hold exactly one")
        more = fi + 1
        while more < nf and counts[more] == 0:
            more += 1
        if more > fi + 1 and count != 1:
            raise FrameLayoutError(f"frame {fi + 1} continues a value, but frame {fi} "
                                   f"holds {count}")
        yield fi, more, count
        fi = more


def into(outs: Sequence[Any], view: Callable[[Any], Any] | None = None
         ) -> Callable[[int, dict[str, Any]], Any]:
    """``into`` for :meth:`kvshm.zmq_ctrl.channel.Channel.request` of a batch GET whose
    values go into ``outs`` (one buffer per key): for an OK reply whose ``sizes`` is a
    list of one entry per key (none -2, refused), ``(outs, sizes, view, counts)``: the
    payload (the hits' values, in order) goes into ``outs[i][:sizes[i]]`` for each hit
    (a negative size, a miss, takes no bytes; ``view(o)``: a buffer over an output
    without the buffer protocol, a torch tensor), each payload frame only when its
    length is the one ``counts`` and ``sizes`` give it (checked before a byte of it is
    written: a reply whose layout does not match its sizes writes nothing past the last
    frame that fits; :meth:`kvshm.zmq_ctrl._zmtp.Conn.recv`); anything else None (the
    reply is received as usual)."""
    def plan(status: int, body: dict[str, Any]) -> Any:
        sizes = body.get("sizes")
        if status != 0 or type(sizes) is not list or len(sizes) != len(outs) \
                or -2 in sizes:         # (-2: refused, QuotaExceeded; nothing placed)
            return None
        counts = body.get("counts")
        if type(counts) is not list:
            return None                 # (no layout to check the frames by)
        return outs, sizes, view, counts
    return plan


def placed(frames: Sequence[Any], counts: Sequence[Any], sizes: Sequence[Any]) -> bool:
    """Whether a GET reply's payload was placed in the caller's buffers (:func:`into`):
    True when its frames are all ints (the lengths of frames placed) that match
    ``counts`` and ``sizes`` as :func:`unpack` wants them; False when none is an int
    (the frames are here: the usual path takes them). ``sizes``: one per key, negative
    for a miss.

    Raises
    ------
    FrameLayoutError
        Frames placed (or some of them) that do not match counts and sizes: the values
        in the buffers are not to be trusted (as :func:`unpack` raises for such a reply).
    """
    n_int = 0
    for f in frames:
        if type(f) is int:
            n_int += 1
    if not n_int:
        return False
    if n_int != len(frames):
        raise FrameLayoutError(f"{len(frames) - n_int} of {len(frames)} payload frames do "
                               "not fit the sizes given")
    if len(counts) != len(frames):
        raise FrameLayoutError(f"{len(frames)} payload frames but {len(counts)} counts")
    if any(type(c) is not int or c < 0 for c in counts):
        raise FrameLayoutError("counts must be ints >= 0")
    hit = [n for n in sizes if n >= 0]   # (ints: into placed nothing otherwise)
    if sum(counts) != len(hit):
        raise FrameLayoutError(f"counts add up to {sum(counts)} values, sizes give "
                               f"{len(hit)}")
    i = 0
    for fi, more, count in _groups(counts, len(frames)):
        got = sum(frames[fi:more])
        want = sum(hit[i:i + count])
        if got != want:
            raise FrameLayoutError(f"frames {fi}-{more - 1} hold {got} bytes, their "
                                   f"{count} values {want}")
        i += count
    return True


def _bytes_view(f: Any) -> memoryview:
    buf = memoryview(f)
    if buf.ndim != 1 or buf.itemsize != 1:
        buf = buf.cast("B")
    return buf


try:
    from kvshm import _batch     # the same loops in C
except ImportError:              # not built: the Python versions above
    _batch = None  # type: ignore[assignment]

if _batch is not None:
    _py_plan, _py_pack, _py_unpack = plan, pack, unpack
    plan = _batch.plan  # noqa: F811
    pack = _batch.pack  # noqa: F811

    def unpack(frames: Sequence[Any], counts: Sequence[Any],  # type: ignore[no-redef]
               sizes: Sequence[Any]) -> list[Any]:
        return _batch.unpack(frames, counts, sizes, _py_unpack)  # type: ignore[no-any-return]

    unpack.__doc__ = _py_unpack.__doc__
