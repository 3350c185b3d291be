"""Sessions and admission: HELLO, who a peer is (proven), its session, the session table.

Sessions. HELLO opens a :class:`~kvshm.store.Session` of the store (its ``session`` id is
in the reply); every later request of that connection (ZeroMQ routing id) belongs to it,
and every handler gets ``(session, req_id, body, frames, on_sent)``; ``session.principal``
is who it is, proven, not claimed: the uid owning the client's liveness file (a
same-host client that attached the pool, :class:`kvshm.segments.Liveness`), the CURVE
key of an authenticated peer, or the holder of the server's door token. Without the
door token or a CURVE key a HELLO is refused and no other request is served. A new
HELLO with the same client ``nonce`` replaces the old session (its grants move over);
a session whose liveness proof is gone is closed and its grants reclaimed at once.

Bound to a connection. A session serves the connection its HELLO came on and no other
(``Session.bound``, :func:`~kvshm.zmq_ctrl.sends.conn_key` at HELLO,
:func:`~kvshm.zmq_ctrl.sends.bound_ok` at each request, here and in the C fast paths,
which decline to this path): once that connection ended, its routing id names no
session; a request claiming it on a new connection is answered "say HELLO"
(STALE_EPOCH) and the session's grants stay under it (its client's HELLO with the same
nonce takes them over; liveness or the idle expiry end it). Races, and which are closed:

- fd reuse (libzmq): the kernel gives a closed connection's fd number to the next
  socket. Closed: the request's ``ZMQ_SRCFD`` must be the bound fd *and* fstat of it must
  give the HELLO's ``(st_dev, st_ino)``; a socket's inode is its own while it is open,
  and a message libzmq read before its connection closed names a fd that is closed
  (fstat fails) or another socket by the time it is served.
- a monitor's DISCONNECTED read after the new connection's first request: closed by not
  depending on the monitor at all (the check is of the kernel's state at the request).
- native listener: each message carries the listener's connection object; a closed one
  is never the session's again (object identity, no system call).
- not closed (libzmq): the HELLO binds what its fd names when it is served; a HELLO whose
  connection ended after libzmq read it, its number taken by a new connection of a peer
  that knew the routing id in the meantime, binds that new connection.

Handshakes that failed (a CURVE key not allowed, no key) are counted as ``auth_refused``
and logged when the loop was made with ``log_handshakes``
(:meth:`~kvshm.zmq_ctrl.admission.AdmissionMixin._on_monitor`, which also holds the
connections not admitted yet: :mod:`kvshm.zmq_ctrl.admission`).
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

import zmq

from kvshm.segments import Liveness
from kvshm.store import Session
from kvshm.zmq_ctrl.handling import _Malformed
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.protocol import Status
from kvshm.zmq_ctrl.sends import bound_ok, conn_key

#: the loop's one logger: its records keep the name they had before the loop was
#: split into modules (as kvshm.store's modules share "kvshm.store")
log = logging.getLogger("kvshm.zmq_ctrl.router")


class SessionsMixin(LoopState):
    """Sessions of ServiceLoop (a mixin of it)."""

    def sessions(self) -> list[Session]:
        """The open sessions (a snapshot)."""
        return [s for s in self._order.values() if not s.closed]

    def end_session(self, sess: Session, why: str) -> int:
        """Close ``sess`` now (every grant settled: :meth:`Store.close_session`) and
        forget it: its routing id names no session any more. Returns the grants
        settled."""
        n = self.store.close_session(sess, why)
        self._order.pop(sess.id, None)
        if self._by_ident.get(sess.conn) is sess:
            del self._by_ident[sess.conn]
        if self._by_nonce.get(sess.nonce) is sess:
            del self._by_nonce[sess.nonce]
        return n

    def _forget_closed(self) -> None:
        for d in (self._by_ident, self._by_nonce):
            for k in [k for k, v in d.items() if v.closed]:
                del d[k]
        for sid in [sid for sid, v in self._order.items() if v.closed]:
            del self._order[sid]

    def _session_of(self, ident: bytes, src: Any = None) -> Session | None:
        """The session of a request of routing id ``ident`` whose header frame (or the
        connection :func:`~kvshm.zmq_ctrl.sends.conn_of` took) is ``src``: the one whose
        HELLO came on that same connection (:func:`~kvshm.zmq_ctrl.sends.bound_ok`), or
        None (answered "say HELLO"). A session bound to another connection is left as it
        is, grants and all, for its client's HELLO (same nonce) or its end."""
        sess = self._by_ident.get(ident)
        if sess is not None and sess.closed:
            del self._by_ident[ident]
            sess = None
        if sess is not None and sess.bound is not None and not bound_ok(sess.bound, src):
            sess = None
        if sess is None and self.door_token is None:
            # no door (a Store served in-process, tests): an implicit session per peer
            sess = self._open(ident, ("peer", ident), os.urandom(16), None, ident.hex())
            sess.operator = True
        return sess

    def _open(self, ident: bytes, principal: Any, nonce: bytes, proof: Any,
              label: str) -> Session:
        sess = self.store.open_session(principal, nonce=nonce, proof=proof, label=label)
        sess.conn = ident
        old = self._by_nonce.get(nonce)
        if old is not None:
            # the same client again (a new HELLO: reconnect, ping, a new mover): the old
            # session ends, its grants move over (that process may still be copying)
            self.store.replace_session(old, sess)
            self._order.pop(old.id, None)
            if self._by_ident.get(old.conn) is old:     # its old connection's name
                del self._by_ident[old.conn]
        prev = self._by_ident.get(ident)
        if prev is not None and prev is not old and not prev.grants:
            self.store.close_session(prev)         # another client on this routing id
            self._order.pop(prev.id, None)
            if self._by_nonce.get(prev.nonce) is prev:
                del self._by_nonce[prev.nonce]
        self._by_ident[ident] = sess
        self._by_nonce[nonce] = sess
        self._order[sess.id] = sess
        if len(self._order) > self.MAX_SESSIONS:
            self._trim_sessions()
        return sess

    def _trim_sessions(self) -> None:
        for sid, sess in list(self._order.items()):
            if len(self._order) <= self.MAX_SESSIONS * 3 // 4:
                break
            if not sess.grants:
                self.store.close_session(sess, "forgotten (too many sessions)")
                del self._order[sid]
        self._forget_closed()

    def _hello(self, ident: bytes, frame: zmq.Frame, body: dict[str, Any],
               current: Session | None, src: Any = None
               ) -> tuple[int, dict[str, Any], list[Any], Session | None]:
        """HELLO: who is this (proven), is it on this host (proven), open its session,
        bound to the connection the HELLO came on (``src``: its header frame or the
        :func:`~kvshm.zmq_ctrl.sends.conn_of` tuple taken when it came; ``frame`` when
        None): :meth:`_session_of` serves that session's requests on that connection
        only."""
        nonce = body.get("nonce")
        if type(nonce) is not bytes or not 8 <= len(nonce) <= 64:
            if self.door_token is not None or nonce is not None:
                raise _Malformed("HELLO needs a nonce of 8-64 bytes")
            nonce = os.urandom(16)      # no door: an old-style HELLO in tests
        principal: Any = None
        try:
            user = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError):
            user = ""
        if user and user != "anonymous":
            principal = ("curve", user)            # the CURVE key ZAP authenticated
        elif self.door_token is None:
            principal = ("peer", ident)
        else:
            tok = body.get("token")
            if type(tok) is bytes and hmac.compare_digest(tok, self.door_token):
                principal = ("door",)
        if principal is None:
            self._count_error("auth_refused")
            log.warning("HELLO from %s refused: no valid token", ident.hex())
            return Status.UNAUTHORIZED, {
                "error": "this server needs its token in HELLO (same-host clients read it "
                         "from the server's token file; see docs/RELIABILITY.md, 'Doors')"
            }, [], current
        proof = None
        if body.get("proof") is True:
            proof = Liveness.verify(self.store.pool.name, self.store.pool.token, nonce)
            if proof is not None and principal[0] != "curve":
                principal = ("uid", proof.uid)    # as the kernel recorded it
        local = proof is not None
        label = f"{principal[0]}:{principal[1] if len(principal) > 1 else ''}"
        if isinstance(principal[-1], bytes):
            label = f"{principal[0]}:{principal[-1].hex()[:12]}"
        sess = self._open(ident, principal, nonce, proof, label)
        sess.operator = self._is_operator(principal, proof, body)
        sess.bound = conn_key(frame if src is None else src, self._native)
        reply = dict(self.hello)
        reply["epoch"] = self.epoch
        reply["session"] = sess.id
        reply["local"] = local
        if self.hello_hook is not None:
            reply.update(self.hello_hook(sess, body))
        return Status.OK, reply, [], sess

    def _is_operator(self, principal: Any, proof: Any, body: dict[str, Any]) -> bool:
        """Operator ops (DRAIN, PURGE, EVICT): a proof-holding local session of this
        server's uid or root, a holder of the operator token, or anyone when there is
        no door (in-process)."""
        if self.door_token is None:
            return True
        if proof is not None and proof.uid in (os.geteuid(), 0):
            return True
        tok = body.get("operator_token")
        return (self.operator_token is not None and type(tok) is bytes
                and hmac.compare_digest(tok, self.operator_token))
