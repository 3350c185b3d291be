"""The server loop's write handlers: ALLOC, COMMIT, RELEASE, PUT, DELETE.

ALLOC grants room for keys (the client then writes the pool and COMMITs the grant);
COMMIT and RELEASE only carry settle lists (applied before any handler, by
:meth:`~kvshm.zmq_ctrl.dispatch.DispatchMixin._piggyback`); PUT stores values sent as
frames (packed small values unpacked by :mod:`kvshm.zmq_ctrl.frames`); DELETE removes
keys. A request of more than ``slice_keys`` keys raises :class:`_Sliced`
(:mod:`kvshm.zmq_ctrl.slices`), one that must wait for the tier :class:`_Defer`.
"""

from __future__ import annotations

from typing import Any

from kvshm._pool import PackedValues
from kvshm.store import Session
from kvshm.zmq_ctrl.frames import FrameLayoutError
from kvshm.zmq_ctrl.frames import unpack as unpack_frames
from kvshm.zmq_ctrl.handling import (
    _MORE,
    _attempt_now,
    _list,
    _Malformed,
    _Sliced,
    _wire_statuses,
)
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.protocol import Status

def _sums(body: dict[str, Any], keys: list[Any]) -> list[Any] | None:
    """The request's ``sums`` (xxh64 per key, or None): a list as long as ``keys``, else
    _Malformed."""
    sums = body.get("sums")
    if sums is not None and (not isinstance(sums, list) or len(sums) != len(keys)):
        raise _Malformed("sums must be a list as long as keys")
    return sums


class WriteOpsMixin(LoopState):
    """Write handlers of ServiceLoop (a mixin of it)."""

    def _on_alloc(self, session, req_id, body, frames, on_sent):
        keys = _list(body, "keys")
        sizes = _list(body, "sizes")
        if len(keys) != len(sizes):
            raise _Malformed("keys and sizes differ in length")
        sums = _sums(body, keys)
        self._check_batch(keys)
        store = self.store
        if len(keys) > self.slice_keys:
            self._alloc_in_slices(session, req_id, keys, sizes, sums)
        if store.tier is None:
            offsets, statuses = store.alloc_entries(session, req_id, keys, sizes,  # type: ignore[misc]
                                                    sums)
            return Status.OK, {"offsets": offsets, "st": _wire_statuses(statuses)}, []

        def attempt(force: bool) -> tuple[int, dict[str, Any], list[Any]] | None:
            r = store.alloc_entries(session, req_id, keys, sizes, sums, defer=not force,
                                    drop=force)
            if r is None:
                return None
            return Status.OK, {"offsets": r[0], "st": _wire_statuses(r[1])}, []

        return _attempt_now(attempt)

    def _alloc_in_slices(self, session: Session, req_id: int, keys: list[Any],
                         sizes: list[Any], sums: list[Any] | None) -> None:
        store = self.store
        S = max(1, self.slice_keys // 2)    # ~1 us a key: ~1 ms a slice, as the others
        n = len(keys)
        offsets: list[Any] = []
        statuses: list[int] = []

        def step(force: bool) -> Any:
            a = len(offsets)
            b = a + S
            tier = store.tier is not None
            r = store.alloc_entries(session, req_id, keys[a:b], sizes[a:b],
                                    None if sums is None else sums[a:b],
                                    defer=tier and not force, drop=tier and force,
                                    extend=a > 0)
            if r is None:
                return None
            offsets.extend(r[0])
            statuses.extend(r[1])
            if len(offsets) < n:
                return _MORE
            return Status.OK, {"offsets": offsets, "st": _wire_statuses(statuses)}, []

        raise _Sliced(step)

    def _on_commit(self, session, req_id, body, frames, on_sent):
        # the commit/abort lists were applied by _piggyback; report what failed
        return Status.OK, {}, []

    def _on_release(self, session, req_id, body, frames, on_sent):
        return Status.OK, {}, []

    def _on_put(self, session, req_id, body, frames, on_sent):
        keys = _list(body, "keys")
        counts = body.get("counts")
        if counts is not None:            # packed small values (kvshm.zmq_ctrl.frames)
            sizes = _list(body, "sizes")
            if not isinstance(counts, list) or len(sizes) != len(keys):
                raise _Malformed("counts must be a list, and sizes as long as keys")
            if (len(frames) == 1 and len(counts) == 1 and len(sizes) == 1
                    and type(frames[0]) is bytes and type(counts[0]) is int
                    and counts[0] == 1 and type(sizes[0]) is int
                    and sizes[0] == len(frames[0])):
                pass        # one value in one frame: what unpack_frames would give
            else:
                # a plain layout is read in place (no view per value); anything else
                # (and every error) goes the general way
                packed = PackedValues.of(frames, counts, sizes) if len(sizes) > 1 else None
                try:
                    frames = packed if packed is not None else unpack_frames(
                        frames, counts, sizes)
                except FrameLayoutError as exc:
                    return Status.INVALID_REQUEST, {"error": str(exc)}, []
        elif len(keys) != len(frames):
            return Status.INVALID_REQUEST, {
                "error": f"{len(keys)} keys but {len(frames)} value frames"}, []
        sums = _sums(body, keys)
        self._check_batch(keys)
        store = self.store
        if len(keys) > self.slice_keys:
            S = self.slice_keys
            st: list[int] = []

            def step(force: bool) -> Any:
                a = len(st)
                b = a + S
                tier = store.tier is not None
                r = store.put(keys[a:b], frames[a:b], None if sums is None else sums[a:b],
                              defer=tier and not force, drop=tier and force)
                if r is None:
                    return None
                st.extend(r)
                return _MORE if len(st) < len(keys) else (
                    Status.OK, {"st": _wire_statuses(st)}, [])

            raise _Sliced(step)
        if store.tier is None:
            return Status.OK, {"st": _wire_statuses(store.put(keys, frames, sums))}, []

        def attempt(force: bool) -> tuple[int, dict[str, Any], list[Any]] | None:
            st = store.put(keys, frames, sums, defer=not force, drop=force)
            return None if st is None else (Status.OK, {"st": _wire_statuses(st)}, [])

        return _attempt_now(attempt)

    def _on_delete(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        S = self.slice_keys
        if len(keys) > S:
            state = [0, 0]                      # next key, removed so far

            def step(force: bool) -> Any:
                a = state[0]
                state[1] += self.store.delete(keys[a:a + S])
                state[0] = a + S
                return _MORE if state[0] < len(keys) else (Status.OK, {"n": state[1]}, [])

            raise _Sliced(step)
        return Status.OK, {"n": self.store.delete(keys)}, []
