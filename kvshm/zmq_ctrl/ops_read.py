"""The server loop's read handlers: LOOKUP, GET, EXISTS, MATCH_PREFIX.

LOOKUP grants reads of keys' bytes in the pool (same-host clients read them in place, then
RELEASE the grant); GET sends the bytes as frames, large values zero-copy (pinned until
sent, :mod:`kvshm.zmq_ctrl.sends`), small ones packed into one copy, within the
principal's send budget. With a tier, a read first promotes what lives only below (the
request parked until it is in the pool). A request of more than ``slice_keys`` keys is
served in slices (:mod:`kvshm.zmq_ctrl.slices`).
"""

from __future__ import annotations

from typing import Any, Callable

from kvshm import _index
from kvshm.store import QUOTA_REFUSED, Session
from kvshm.zmq_ctrl.frames import PACK_BELOW, PACK_FRAME_BYTES
from kvshm.zmq_ctrl.frames import plan as plan_frames
from kvshm.zmq_ctrl.handling import _MORE, _attempt_now, _Sliced
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.protocol import Status, grow_untracked

class ReadOpsMixin(LoopState):
    """Read handlers of ServiceLoop (a mixin of it)."""

    def _on_lookup(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        if len(keys) > self.slice_keys:
            offsets: list[Any] = []
            sizes: list[int] = []
            sums: list[Any] = []

            def part(a: int, b: int, hold: Any) -> Any:
                o, sz, sm = self.store.lookup(session, req_id, keys[a:b], hold,
                                              extend=a > 0)
                grow_untracked(offsets, o)
                grow_untracked(sizes, sz)
                grow_untracked(sums, sm)

            def reply() -> tuple[int, dict[str, Any], list[Any]]:
                rbody: dict[str, Any] = {"offsets": offsets, "sizes": sizes}
                if any(x is not None for x in sums):
                    rbody["sums"] = sums
                return Status.OK, rbody, []

            self._read_in_slices(keys, part, reply)
        return self._read(keys, lambda hold: self._lookup_reply(session, req_id, keys, hold))

    def _read_in_slices(self, keys: list[Any], part: Callable[[int, int, Any], Any],
                        reply: Callable[[], tuple[int, dict[str, Any], list[Any]]],
                        cleanup: Callable[[], None] | None = None) -> None:
        """Serve a read of many keys in slices: ``part(a, b, hold)`` answers keys
        ``a:b`` (after the tier promoted what lives only below), ``reply()`` the whole."""
        store = self.store
        S = self.slice_keys
        n = len(keys)
        state: list[Any] = [0, None]            # next key, the slice's ReadHold

        def step(force: bool) -> Any:
            a = state[0]
            b = min(n, a + S)
            hold = None
            if store.tier is not None:
                hold = state[1]
                if hold is None:
                    hold = state[1] = store.read_hold()
                if not store.prepare_read(keys[a:b], hold, force):
                    return None
            try:
                part(a, b, hold)
            finally:
                if hold is not None:
                    store.release_hold(hold)
                    state[1] = None
            state[0] = b
            return _MORE if b < n else reply()

        def abandon() -> None:
            if state[1] is not None:
                store.release_hold(state[1])
                state[1] = None
            if cleanup is not None:
                cleanup()

        raise _Sliced(step, abandon)

    def _lookup_reply(self, session: Session, req_id: int, keys: list[Any], hold: Any
                      ) -> tuple[int, dict[str, Any], list[Any]]:
        offsets, sizes, sums = self.store.lookup(session, req_id, keys, hold)
        rbody: dict[str, Any] = {"offsets": offsets, "sizes": sizes}
        if any(s is not None for s in sums):
            rbody["sums"] = sums
        return Status.OK, rbody, []

    def _on_get(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        if len(keys) > self.slice_keys:
            if self._sending:
                self._settle_own_sends(session)
            copy_over = not session.sending     # decided once, as for one request
            sizes: list[int] = []
            counts: list[int] = []
            sums: list[Any] = []
            out: list[Any] = []

            def part(a: int, b: int, hold: Any) -> None:
                sz, cn, sm, fr = self._get_part(keys[a:b], on_sent, hold, session,
                                                copy_over)
                grow_untracked(sizes, sz)
                grow_untracked(counts, cn)
                grow_untracked(sums, sm)
                out.extend(fr)

            def reply() -> tuple[int, dict[str, Any], list[Any]]:
                rbody: dict[str, Any] = {"sizes": sizes, "counts": counts}
                if sums.count(None) != len(sums):       # some key has a checksum
                    rbody["sums"] = sums
                return Status.OK, rbody, out

            def cleanup() -> None:
                # abandoned before its reply: what its slices pinned or counted goes
                self.store.sent(session, sum(x for x in on_sent if isinstance(x, int)),
                                [e for e in on_sent if not isinstance(e, int)])
                on_sent.clear()
                out.clear()

            self._read_in_slices(keys, part, reply, cleanup)
        return self._read(keys, lambda hold: self._get_reply(keys, on_sent, hold, session))

    def _read(self, keys: list[Any], reply: Callable[[Any], tuple[int, dict[str, Any],
                                                                  list[Any]]]
              ) -> tuple[int, dict[str, Any], list[Any]]:
        """Answer a read with ``reply(hold)``; with a tier, first promote what lives only
        below (the request is parked until it is in the pool)."""
        store = self.store
        if store.tier is None:
            return reply(None)
        hold = store.read_hold()

        def attempt(force: bool) -> tuple[int, dict[str, Any], list[Any]] | None:
            if not store.prepare_read(keys, hold, force):
                return None
            try:
                return reply(hold)
            finally:
                store.release_hold(hold)

        return _attempt_now(attempt, lambda: store.release_hold(hold))

    def _get_reply(self, keys: list[Any], on_sent: list[Any], hold: Any, session: Session
                   ) -> tuple[int, dict[str, Any], list[Any]]:
        """GET: the hits' bytes as frames, large ones zero-copy (pinned until sent),
        small ones packed into one copy. Every block queued (pinned or copied) counts
        against the principal until the frame is sent; hits beyond its budget are
        refused (size QUOTA_REFUSED), so a peer that does not read cannot pin the pool
        nor grow this process."""
        if self._sending:
            self._settle_own_sends(session)
        sizes, counts, sums, out = self._get_part(keys, on_sent, hold, session,
                                                  not session.sending)
        rbody: dict[str, Any] = {"sizes": sizes, "counts": counts}
        if sums.count(None) != len(sums):       # some key has a checksum
            rbody["sums"] = sums
        return Status.OK, rbody, out

    def _get_part(self, keys: list[Any], on_sent: list[Any], hold: Any, session: Session,
                  copy_over: bool) -> tuple[list[int], list[int], list[Any], list[Any]]:
        """The hits of ``keys`` as GET frames (see :meth:`_get_reply`): sizes, counts,
        checksums and frames; what it pinned or queued is added to ``on_sent``."""
        store = self.store
        entries, sums = store.pin_for_send(keys, hold)
        if len(entries) == 1 and copy_over:
            # one key (the common request): what the general path below gives, shorter
            e = entries[0]
            if e is None:
                return [-1], [], sums, []
            if e.size < PACK_BELOW and e.nruns == 1:
                bs = store.block_size
                data = store.pool.read_bytes(e.start * bs, e.size)
                store.unpin(entries)
                queued = -(-e.size // bs)
                if queued:
                    store.sending(session, queued)
                    on_sent.append(queued)
                return [e.size], [1], sums, [data]
        if copy_over:
            # every hit small and in one run (a batch of small values): the general
            # path's frames and counts, planned and copied in C
            fast = _index.small_frames(entries, store.block_size, PACK_BELOW,
                                       PACK_FRAME_BYTES)
            if fast is not None:
                sizes, hits, offs, lens, counts, queued = fast
                out = store.pool.read_groups(offs, lens, counts) if hits else []
                store.unpin(hits)
                if queued:
                    store.sending(session, queued)
                    on_sent.append(queued)
                return sizes, counts, sums, out
        sizes = [e.size if e is not None else -1 for e in entries]
        budget = store.send_budget(session)
        cap = self.send_cap_blocks - session.quota.sending
        budget = cap if budget is None else min(budget, cap)
        # A session with nothing unsent always gets its whole reply (``copy_over``): hits
        # beyond the zero-copy budget are copied (server memory bounded by one reply per
        # reading session), so every reader makes progress whatever its principal's other
        # connections hold. One with replies queued and unread gets only the budget.
        refused = []
        if not copy_over and any(e is not None for e in entries):
            for i, e in enumerate(entries):
                if e is None:
                    continue
                if e.nblocks > budget:
                    refused.append(e)
                    entries[i] = None
                    sizes[i] = QUOTA_REFUSED
                    sums[i] = None
                else:
                    budget -= e.nblocks
        if refused:
            store.counters["quota_refusals"] += len(refused)
            store.unpin(refused)
        hits = [e for e in entries if e is not None]
        out: list[Any] = []
        counts: list[int] = []
        small: list[Any] = []
        bs = store.block_size
        queued = 0
        for first, count in plan_frames([e.size for e in hits]):
            group = hits[first:first + count]
            e = group[0]
            if count == 1 and e.size >= PACK_BELOW and (not copy_over or e.nblocks <= budget):
                # zero-copy, pinned until sent; a value of several runs in one frame per
                # run, the runs after the first with a count of 0 (frames.unpack)
                if e.nruns == 1:
                    out.append(store.view(e))
                    counts.append(1)
                else:
                    views = store.views(e)
                    out.extend(views)
                    counts.extend([1] + [0] * (len(views) - 1))
                on_sent.append(e)
                queued += e.nblocks
                budget -= e.nblocks
                continue
            if count == 1 and e.size >= PACK_BELOW:
                # over the budget: a copy (one frame), counted until sent as the others
                n = e.size
                queued += e.nblocks
            else:                                           # small values: one packed copy
                n = sum(g.size for g in group)
                queued += -(-n // bs)
            if count == 1 and e.nruns == 1:      # one value, one run: one copy
                out.append(store.pool.read_bytes(e.start * bs, e.size))
                small.append(e)
                counts.append(1)
                continue
            buf = bytearray(n)
            offs: list[int] = []
            lens: list[int] = []
            for g in group:
                if g.nruns == 1:
                    offs.append(g.start * bs)
                    lens.append(g.size)
                else:
                    for o, k in g.byte_extents(bs):
                        offs.append(o)
                        lens.append(k)
            store.pool.gather(offs, lens, buf)
            out.append(buf)
            small.extend(group)
            counts.append(count)
        store.unpin(small)
        if queued:
            store.sending(session, queued)
            on_sent.append(queued)
        return sizes, counts, sums, out

    def _on_exists(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        S = self.slice_keys
        if len(keys) > S:
            found: list[bool] = []

            def step(force: bool) -> Any:
                a = len(found)
                found.extend(self.store.exists(keys[a:a + S]))
                return _MORE if len(found) < len(keys) else (Status.OK, {"found": found}, [])

            raise _Sliced(step)
        return Status.OK, {"found": self.store.exists(keys)}, []

    def _on_match_prefix(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        S = self.slice_keys
        if len(keys) > S:
            at = [0]

            def step(force: bool) -> Any:
                a = at[0]
                part = keys[a:a + S]
                m = self.store.match_prefix(part)
                at[0] = a + m
                if m < len(part) or at[0] == len(keys):
                    return Status.OK, {"n": at[0]}, []
                return _MORE

            raise _Sliced(step)
        return Status.OK, {"n": self.store.match_prefix(keys)}, []
