"""Session 27's hostile review of sessions bound to their HELLO's connection, the client
reply hardening and the native listener as the default (docs/RELIABILITY.md, "Sessions
and routing ids"). Each test is a finding: it failed before its fix."""

from __future__ import annotations

import os

import msgpack
import pytest

from kvshm import Client
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply
from servers import ServerProcess
from test_trust2 import _call, _dealer, _tokens

LISTENERS = ["libzmq", "native"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listener", LISTENERS)
def test_a_hello_decoded_over_turns_binds_its_own_connection(listener):
    """A HELLO of 64 KiB or more (its header decoded a slice a turn: a long settle list
    of a client reconnecting, or any padding) is served with the connection taken when
    it came (a ``(fd, st_dev, st_ino)`` tuple), not its header frame. Under the native
    listener the session was bound to that tuple with no connection object, so no
    request of that very connection matched it: every one was answered "say HELLO",
    and the client's HELLO, as large again, bound the same way (a loop)."""
    with ServerProcess(listener=listener) as srv:
        door, _ = _tokens(srv.address)
        s = _dealer(srv.address, os.urandom(16))
        try:
            st, hello = _call(s, Op.HELLO, {"nonce": os.urandom(16), "token": door,
                                            "pad": b"x" * (80 << 10)}, 1, 0)
            assert st == Status.OK, hello
            ep = hello["epoch"]
            st, body = _call(s, Op.EXISTS, {"keys": [b"k"]}, 2, ep)
            assert st == Status.OK, (st, body)
            st, body = _call(s, Op.EXISTS, {"keys": [b"k%d" % i for i in range(6000)]},
                             3, ep)             # a large request of the session's too
            assert st == Status.OK and len(body["found"]) == 6000, (st, body)
            assert srv.alive()
        finally:
            s.close()


def _replies(s, within: float = 0.0) -> list[tuple[int, int, dict]]:
    out = []
    while s.poll(int(within * 1000)):
        st, rid, body = decode_reply(s.recv_multipart()[0])
        out.append((st, rid, body))
        within = 0.0
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listener", LISTENERS)
def test_a_deferred_reply_does_not_go_to_a_later_holder_of_the_routing_id(listener):
    """A reply served turns after its request came (a GET read in slices,
    ``--slice-keys 2``; parked requests the same) went to whatever connection held the
    request's routing id by then: the victim's connection gone, a thief that claimed its
    routing id got the victim's GET reply (offsets of its values in the pool, and the
    reads pinned for it). Now it goes only to the connection the request came on."""
    with ServerProcess("--slice-keys", "2", listener=listener) as srv, \
            Client(srv.address, transport="tcp") as admin:
        door, _ = _tokens(srv.address)
        admin.put(b"secret", b"s" * 100)
        ident = os.urandom(16)
        victim = _dealer(srv.address, ident)
        thief = None
        try:
            st, hello = _call(victim, Op.HELLO, {"nonce": os.urandom(16), "token": door},
                              1, 0)
            assert st == Status.OK, hello
            keys = [b"secret"] + [b"m%d" % i for i in range(30000)]
            victim.send(msgpack.packb([PROTOCOL_VERSION, Op.GET, 77, hello["epoch"],
                                       {"keys": keys}], use_bin_type=True))
            while admin.stats()["slices"]["sliced_requests"] < 1:
                pass                             # the server has it (LINGER 0 drops
            assert not victim.poll(0)            # unsent messages at close)
            victim.close()                       # gone while its GET is sliced
            thief = _dealer(srv.address, ident)
            got = []
            while True:                          # until no request is in slices
                got += _replies(thief)
                sl = admin.stats()["slices"]
                if sl["in_progress"] == 0 and sl["sliced_requests"] >= 1:
                    break
            got += _replies(thief, 0.5)
            assert not [g for g in got if g[1] == 77], got[:1]
            assert admin.get(b"secret") == b"s" * 100
            assert srv.alive()
        finally:
            victim.close()
            if thief is not None:
                thief.close()
