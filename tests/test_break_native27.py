"""Hostile peers against the native listener's framing in C (kvshm/zmq_ctrl/_zmtpsrv.pyx,
the server's default listener since 0b68aac), a reviewer's findings kept as tests.

Findings (each test failed before its fix):

* one pipelining peer's parsed messages were served before any other connection's: a
  read parsed up to READY_MAX (1024) messages of one connection into the one FIFO the
  loop takes from, and recv_message parsed a connection's backlog before reading the
  others, so a bystander's request waited behind ~1,000 of a peer's (libzmq's ROUTER
  fair-queues its pipes a message at a time). Measured against a server: a peer that
  pipelines 4,000 GETs of a 1 MiB value and never reads held a bystander's single
  round trip 5.7 s under native (p99; libzmq ~0.11 s);
* the same peer made every request of its wait for its unread replies again
  (``_settle_own_sends``: up to 0.1 s each, the loop held): a bystander's p50 was
  ~100 ms under libzmq all the while (after both fixes: native p99 5.3 ms, libzmq
  p50 0.12 ms, load ~4).

Held (attacked, nothing found): frames of 65535-65537, 128 KiB and 256 KiB (+1) cut
at 1, 2, 8, 9, 100, 65535 bytes and one short of the end by peers that said HELLO (read
in place) and closed; a PING and an empty frame between a message's frames (the
message delivered whole, PONG with its context); a 2**63-byte command; clients
SIGKILLed mid-GET/PUT of 1-4 MiB values (RSS +3 MB, fds back); 100 HELLO'd peers
each declaring a 60 MiB frame and stalling after 100 KB (RSS +11 MB, back once
closed); EMFILE (the server's fd limit set to 20 over its use by prlimit, 200
connects): the bystander served, no busy loop, a new client served after.
"""

from __future__ import annotations

import time

import pytest

from test_native_listener import WAIT_S, Pump, _message

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pump():
    p = Pump()
    yield p
    p.close()


def _turn(pump: Pump, got: list[bytes], most: int = 256) -> None:
    """One turn of the server's loop: a wait, then at most ``most`` messages taken."""
    if pump.lst.poll_in(-1, None, 5) > 0:
        for _ in range(most):
            m = pump.lst.recv_message()
            if m is None:
                break
            got.append(bytes(m[0]) + b":" + bytes(m[1]))


def test_a_pipelining_peer_does_not_make_a_bystander_wait_behind_its_backlog(pump):
    """Peer A has 2,000 one-frame requests read; bystander B then sends one. B's comes
    within a few dozen of A's (before the fix: after the ~1,000 A's already parsed)."""
    a = pump.peer(identity=b"A")
    b = pump.peer(identity=b"B")
    n = 2000
    a.sendall(b"".join(_message(b"%d" % i) for i in range(n)))
    got: list[bytes] = []
    end = time.monotonic() + WAIT_S
    while not got:
        assert time.monotonic() < end, "nothing received from A"
        _turn(pump, got, most=1)
    b.sendall(_message(b"bystander"))
    before = len(got)
    while b"B:bystander" not in got:
        assert time.monotonic() < end, "the bystander's message never came"
        _turn(pump, got)
    ahead = got.index(b"B:bystander") - before
    assert ahead <= 64, f"{ahead} of A's messages were served before the bystander's"
    while len(got) < n + 1:     # and A's all come, in order
        assert time.monotonic() < end, f"{len(got)} of {n + 1}"
        _turn(pump, got)
    assert [g for g in got if g.startswith(b"A:")] == [b"A:%d" % i for i in range(n)]
    a.close()
    b.close()


class _StuckTracker:
    """A zero-copy reply's tracker that never completes (its peer does not read)."""

    def __init__(self, waits: list[float]) -> None:
        self.done = False
        self._waits = waits

    def wait(self, timeout: float) -> None:
        import zmq

        self._waits.append(timeout)     # (no sleep: the count is what is checked)
        raise zmq.NotDone()


def test_a_peer_that_never_reads_holds_the_loop_in_one_settle_not_one_a_request():
    """A session whose earlier GET replies are unread sends request after request (it
    pipelines and never reads): each of its requests waited up to 0.1 s for those
    replies (_settle_own_sends), the loop held and every other client behind it (a
    bystander's round trip ~0.1 s under libzmq, seconds under native). Once such a wait
    ran out, the next requests wait no more while that reply is still unsent."""
    import types

    from kvshm.zmq_ctrl.sends import SendsMixin

    waits: list[float] = []
    class _Sess:
        sending = 1

    sess = _Sess()
    loop = SendsMixin.__new__(SendsMixin)
    loop._unsettled = {}
    loop.store = types.SimpleNamespace(config=types.SimpleNamespace(lease_timeout=60.0),
                                       sent=lambda *a: None)
    t = _StuckTracker(waits)
    loop._sending = [(t, [], 1, sess, b"id", time.monotonic(), None)]
    for _ in range(50):
        loop._settle_own_sends(sess)
    assert len(waits) == 1, f"{len(waits)} waits for one unread reply"
    # a reply it does read lets the next settle wait again for a newer one
    t.done = True
    loop._sending.append((_StuckTracker(waits), [], 1, sess, b"id", time.monotonic(), None))
    loop._settle_own_sends(sess)
    assert len(waits) == 2
