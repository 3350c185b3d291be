"""A session is bound to the connection its HELLO came on (docs/RELIABILITY.md,
"Sessions and routing ids").

Before: a session was found by the ZeroMQ routing id alone, so once its client's
connection ended without BYE, a peer that claimed that routing id on a connection of its
own was served as that session (its grants, its pins, its operator rights) until the
session ended. Now any request on another connection is answered "say HELLO"
(STALE_EPOCH), the session's grants stay under it, and the client itself (same nonce,
a valid token) still takes them over with a HELLO.
"""

from __future__ import annotations

import os
import time

import msgpack
import pytest
import zmq

from kvshm import Client
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply
from servers import ServerProcess
from test_trust2 import _call, _dealer, _tokens

LISTENERS = ["libzmq", "native"]


def _served(s: zmq.Socket, op: int, body: dict, rid: int, epoch: int,
            within: float = 30.0) -> tuple[int, dict]:
    """Send until a reply comes: a connection claiming a routing id whose old connection
    libzmq has not let go of yet is not served at all (ROUTER_HANDOVER off), and the
    DEALER connects again by itself; waits on the reply, never on a fixed sleep."""
    end = time.monotonic() + within
    while True:
        s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, epoch, body], use_bin_type=True))
        if s.poll(500):
            st, _, rbody = decode_reply(s.recv_multipart()[0])
            return st, rbody
        assert time.monotonic() < end, f"no reply to op {op} within {within} s"


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_routing_id_claimed_after_its_connection_ended_names_no_session(listener):
    with ServerProcess(listener=listener) as srv, \
            Client(srv.address, transport="tcp") as admin:
        door, optok = _tokens(srv.address)
        admin.put("k", b"v" * 100)
        ident, nonce = os.urandom(16), os.urandom(16)
        victim = _dealer(srv.address, ident)
        thief = victim2 = None
        try:
            st, hello = _call(victim, Op.HELLO, {"nonce": nonce, "token": door,
                                                 "operator_token": optok}, 1, 0)
            assert st == Status.OK, hello
            ep = hello["epoch"]
            st, body = _call(victim, Op.LOOKUP, {"keys": [b"k"]}, 2, ep)
            assert st == Status.OK, body             # a pin held by the session
            victim.close()                           # gone without BYE
            thief = _dealer(srv.address, ident)
            st, body = _served(thief, Op.EXISTS, {"keys": [b"k"]}, 3, ep)
            assert st == Status.STALE_EPOCH and "HELLO" in body["error"], (st, body)
            st, body = _call(thief, Op.DELETE, {"keys": [b"k"]}, 4, ep)
            assert st == Status.STALE_EPOCH and "HELLO" in body["error"], (st, body)
            # an operator op of the session's is refused the same way
            st, body = _call(thief, Op.PURGE, {}, 5, ep)
            assert st == Status.STALE_EPOCH and "HELLO" in body["error"], (st, body)
            # nor may it settle the session's pin
            st, body = _call(thief, Op.EXISTS, {"keys": [b"k"], "release": [2]}, 6, ep)
            assert st == Status.STALE_EPOCH, (st, body)
            assert admin.get("k") == b"v" * 100
            # the client itself, on a new connection (new routing id, same nonce, its
            # token) takes its session's grants over: it releases the pin
            victim2 = _dealer(srv.address, os.urandom(16))
            st, hello2 = _call(victim2, Op.HELLO, {"nonce": nonce, "token": door}, 7, 0)
            assert st == Status.OK, hello2
            st, body = _call(victim2, Op.EXISTS, {"keys": [b"k"], "release": [2]}, 8, ep)
            assert st == Status.OK and body["found"] == [True], (st, body)
            assert "errors" not in body and "settle_errors" not in body, body
        finally:
            for s in (victim, thief, victim2):
                if s is not None:
                    s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize("zmtp", [True, False], ids=["zmtp", "libzmq"])
def test_a_client_whose_connection_was_cut_goes_on_with_a_hello(listener, zmtp,
                                                                 monkeypatch):
    """The client's own connection cut (a relay in between drops it): libzmq's DEALER
    connects again under the same routing id, which is not its session's connection,
    so its next request is told "say HELLO"; it says it (same nonce: its session's
    grants move over) and goes on. The ZMTP client (``channel.ZMTP``) sees the close
    before its next send and connects again under a new routing id, told "say HELLO"
    the same way (tests/test_zmtp_cut.py covers a cut while a call waits)."""
    import kvshm.zmq_ctrl.channel as channel
    from kvshm.security import find_token
    from kvshm.zmq_ctrl.channel import endpoint_of
    from test_break24 import _Proxy

    with ServerProcess(listener=listener) as srv:
        px = _Proxy(srv.address)
        monkeypatch.setattr(channel, "ZMTP", zmtp)
        c = Client(px.address, transport="tcp", timeout=20,
                   token=find_token(endpoint_of(srv.address)))
        try:
            c.put(b"k", b"v" * 100)
            assert c.get(b"k") == b"v" * 100
            px.cut()
            assert c.get(b"k") == b"v" * 100
            c.put(b"k2", b"w" * 100)
            assert c.get(b"k2") == b"w" * 100
            # its new connection was told to say HELLO (not served as its session)
            assert c.stats()["error_kinds"].get("no_session", 0) >= 1
            assert srv.alive()
        finally:
            c.close()
            px.close()


class _Frame:
    """A received frame as bound_ok reads it: ``get(zmq.SRCFD)``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def get(self, option: int) -> int:
        assert option == zmq.SRCFD
        return self.fd


def test_a_closed_connections_fd_number_given_to_a_later_socket_is_not_bound():
    """libzmq: the fd number is not the connection (the kernel gives it to the next
    socket once closed); the bound check asks fstat for the socket's inode."""
    import socket

    from kvshm.zmq_ctrl.sends import DEAD, bound_ok, conn_key

    a, b = socket.socketpair()
    fd = a.fileno()
    key = conn_key(_Frame(fd))
    assert key is not None and key[0] == fd and bound_ok(key, _Frame(fd))
    assert not bound_ok(key, _Frame(b.fileno()))        # another connection's fd
    a.close()
    assert not bound_ok(key, _Frame(fd))                # ended
    c, d = socket.socketpair()
    extra = None
    try:
        if c.fileno() != fd:                            # (the kernel's lowest free one
            os.dup2(c.fileno(), fd)                     # is usually fd itself)
            extra = fd
        # the number, another socket's
        assert not bound_ok(key, _Frame(fd))
        assert bound_ok(conn_key(_Frame(fd)), _Frame(fd))
    finally:
        if extra is not None:
            os.close(extra)
        for s in (b, c, d):
            s.close()
    assert conn_key(_Frame(-1)) is None                 # inproc: nothing to bind to
    assert conn_key(_Frame(fd)) == DEAD                 # a HELLO whose fd is closed
    assert not bound_ok(DEAD, _Frame(fd)) and not bound_ok(DEAD, _Frame(-1))
