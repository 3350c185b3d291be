"""A store session and what it holds: grants (pending writes, pins) and a principal's
quota, as data (no store logic: :mod:`kvshm.store.sessions` keeps them). Apart from the
mixins so that :mod:`kvshm.store.parts` can name them without an import cycle."""

from __future__ import annotations

import os
import time
from typing import Any

from kvshm.index import Entry

__all__ = ["Session"]

#: A grant's list of entries (Entry or None: types the collector never tracks) of at
#: least this many is taken off the collector's lists (:func:`kvshm._gcutil.untrack_plain`),
#: so that no young collection walks a 100 k-key grant's entries while it lives;
#: ``KVSHM_UNTRACK=0`` (read at import) leaves them tracked, for A/B figures.
UNTRACK_MIN = 256
_untrack: Any = None
if os.environ.get("KVSHM_UNTRACK", "1") != "0":
    try:
        from kvshm._gcutil import untrack_plain as _untrack
    except ImportError:         # the extension not built: lists stay tracked
        _untrack = None


def _untrack_entries(entries: list[Any], start: int) -> None:
    if _untrack is not None and type(entries) is list and len(entries) >= UNTRACK_MIN:
        _untrack(entries, start)

# _Grant.kind
_ALLOC = 0
_PIN = 1


class _Grant:
    """One grant: ``entries[done:]`` are the entries it still holds (the first ``done``
    were settled by :meth:`_Sessions.settle_some`, which compacts the list once they are
    half of it, so settling a grant in many small parts moves each entry O(1) times).
    ``closing``: how a request being settled in slices settles it (:meth:`_Sessions.
    begin_settle`: "commit" or "abort"; None while none is)."""

    __slots__ = ("kind", "session", "rid", "entries", "deadline", "nbytes", "nblocks",
                 "held", "done", "closing")

    def __init__(self, kind: int, session: "Session", rid: int, entries: list[Entry],
                 deadline: float, nbytes: int, nblocks: int) -> None:
        self.kind = kind
        self.session = session
        self.rid = rid
        self.entries = entries
        _untrack_entries(entries, 0)
        self.deadline = deadline
        self.nbytes = nbytes        # value bytes (counters)
        self.nblocks = nblocks      # blocks held (limits)
        self.held = False        # lease ran out, but its live client may still copy
        self.done = 0            # entries at the front settled already (settle_some)
        self.closing: str | None = None  # "commit"/"abort" of a sliced settle (begin_settle)

    def count(self) -> int:
        """The entries it still holds."""
        return len(self.entries) - self.done

    def rest(self) -> list[Entry]:
        """The entries it still holds, as its list (the settled ones dropped first)."""
        if self.done:
            del self.entries[:self.done]
            self.done = 0
        return self.entries


class _Quota:
    """What one principal holds, all its sessions together (in blocks)."""

    __slots__ = ("pending", "pinned", "sending", "sessions")

    def __init__(self) -> None:
        self.pending = 0        # blocks of pending writes
        self.pinned = 0         # blocks pinned by LOOKUP grants
        self.sending = 0        # blocks pinned by GET replies not yet sent
        self.sessions = 0


class Session:
    """One HELLO's worth of state on the server: the grants it made, its principal.

    Made by :meth:`Store.open_session`. ``proof`` (None for a remote client) is its
    liveness proof: ``proof.alive()`` tells whether the process behind the session still
    holds it, ``proof.remove()`` clears it away once it is dead
    (:class:`kvshm.segments.Liveness`); ``id`` is issued by the server and ``nonce``
    chosen by the client (a new HELLO with the same nonce replaces the session:
    :meth:`Store.replace_session`). ``operator`` (False until the router says so) is True
    only for a session that proved it may run operator ops (DRAIN, PURGE, EVICT over the
    wire): a proof-holding local session of the server's own uid or root, or one that
    presented the server's operator token (:mod:`kvshm.security`).
    """

    __slots__ = ("id", "principal", "nonce", "proof", "grants", "quota", "closed",
                 "label", "local", "sending", "operator", "seen", "conn", "committed",
                 "successor", "bound", "__weakref__")

    def __init__(self, sid: int, principal: Any, nonce: bytes, proof: Any,
                 quota: _Quota, label: str = "") -> None:
        self.id = sid
        self.principal = principal
        self.nonce = nonce
        self.proof = proof
        self.local = proof is not None
        self.operator = False
        self.seen = time.perf_counter()   # its last request (the router stamps it)
        self.conn: Any = None             # the router's name of its connection
        #: the connection its HELLO came on (kvshm.zmq_ctrl.sessions.conn_key), or None:
        #: requests on any other connection are not this session's
        self.bound: Any = None
        self.sending = 0            # blocks of this session's GET replies not yet sent
        self.grants: dict[int, _Grant] = {}
        #: request ids of its most recently committed ALLOC grants, oldest first (at
        #: most RECENT_COMMITS): :meth:`_Sessions.committed_before`
        self.committed: dict[int, None] = {}
        self.quota = quota
        self.closed = False
        self.label = label
        #: the session that took this one's grants over (a new HELLO of the same
        #: client: :meth:`_Sessions.replace_session`), else None
        self.successor: Session | None = None

    def __repr__(self) -> str:
        return f"<Session {self.id} {self.label or self.principal!r}>"

    def live(self) -> "Session | None":
        """This session, or the open one that took its grants over (through any number
        of new HELLOs of the same client); None when it was closed for good."""
        s: Session | None = self
        while s is not None and s.closed:
            s = s.successor
        return s
