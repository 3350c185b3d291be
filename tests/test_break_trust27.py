"""Session 27's hostile review of sessions bound to their HELLO's connection, the client
reply hardening and the native listener as the default (docs/RELIABILITY.md, "Sessions
and routing ids"). Each test is a finding: it failed before its fix."""

from __future__ import annotations

import os

import pytest

from kvshm.zmq_ctrl.protocol import Op, Status
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
