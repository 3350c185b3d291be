"""kvshm.zmq_ctrl._zmqc: direct libzmq sends and receives, against pyzmq on the other end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

import kvshm._bitmap
from kvshm.zmq_ctrl import _zmqc as Z


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def _recv(sock: zmq.Socket[Any], **kw: Any) -> list[Any]:
    """A whole message through _zmqc, waiting (the sockets above time out in 5 s)."""
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    m = Z.recv_multipart(sock, 0, **kw)
    assert m is not None
    return m


def test_round_trips_with_empty_and_large_frames(pair: Any) -> None:
    router, dealer = pair
    big = bytes(range(256)) * 4096             # 1 MiB
    parts = [b"", b"hdr", b"", big, bytearray(b"x" * 10), memoryview(b"abc")]
    assert Z.send_parts(dealer, parts) is True
    m = _recv(router)
    assert len(m) == 7
    ident, rest = m[0], m[1:]
    assert type(ident) is bytes
    assert [bytes(p) for p in rest] == [bytes(p) for p in parts]
    assert isinstance(rest[3], Z.Frame)        # >= copy_threshold: zero-copy
    assert rest[3].bytes == big and len(rest[3]) == len(big)
    assert rest[3].buffer.readonly and memoryview(rest[3]).nbytes == len(big)
    assert all(type(p) is bytes for i, p in enumerate(rest) if i != 3)
    # and back, received by pyzmq
    assert Z.send_parts(router, [ident, b"", b"rep", big]) is True
    assert dealer.recv_multipart() == [b"", b"rep", big]
    # pyzmq sends, _zmqc receives
    dealer.send_multipart([b"a", b"", b"c"])
    assert _recv(router)[1:] == [b"a", b"", b"c"]


def test_single_empty_frame_and_keep(pair: Any) -> None:
    router, dealer = pair
    Z.send_parts(dealer, [b""])
    m = _recv(router, keep=1)
    assert isinstance(m[1], Z.Frame) and m[1].bytes == b"" and len(m[1]) == 0
    assert m[1].get("Peer-Address") == "127.0.0.1"
    assert isinstance(m[1].get(zmq.SRCFD), int)
    with pytest.raises(zmq.ZMQError):
        m[1].get("No-Such-Property")


def test_copy_threshold(pair: Any) -> None:
    router, dealer = pair
    Z.send_parts(dealer, [b"1234", b"12"])
    m = _recv(router, copy_threshold=3)
    assert isinstance(m[1], Z.Frame) and type(m[2]) is bytes


def test_eagain(pair: Any) -> None:
    router, dealer = pair
    assert Z.recv_multipart(router) is None                 # DONTWAIT by default
    assert Z.recv_multipart(router, Z.DONTWAIT) is None
    router.setsockopt(zmq.RCVTIMEO, 10)
    with pytest.raises(zmq.Again):
        Z.recv_multipart(router, 0)
    ctx = zmq.Context.instance()
    lone = ctx.socket(zmq.DEALER)                          # no peer: cannot take a message
    try:
        assert Z.send_parts(lone, [b"a", b"b"], Z.DONTWAIT) is False
        lone.setsockopt(zmq.SNDTIMEO, 10)
        with pytest.raises(zmq.Again):
            Z.send_parts(lone, [b"a"])
    finally:
        lone.close(0)


def test_unroutable_and_closed(pair: Any) -> None:
    router, dealer = pair
    with pytest.raises(zmq.ZMQError) as ei:
        Z.send_parts(router, [b"nobody", b"x"])            # ROUTER_MANDATORY
    assert ei.value.errno == zmq.EHOSTUNREACH
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.close()
    with pytest.raises(zmq.ZMQError) as ei:
        Z.recv_multipart(s)
    assert ei.value.errno == zmq.ENOTSOCK
    with pytest.raises(zmq.ZMQError):
        Z.send_parts(s, [b"x"])
    with pytest.raises(ValueError):
        Z.send_parts(dealer, [])
    with pytest.raises(TypeError):
        Z.send_parts(dealer, [b"ok", 12])                  # not a buffer


def test_peer_gone(pair: Any) -> None:
    """A peer that went away: its routing id is unroutable once libzmq notices."""
    router, dealer = pair
    Z.send_parts(dealer, [b"hi"])
    ident = _recv(router)[0]
    dealer.close(0)
    for _ in range(2000):
        try:
            Z.send_parts(router, [ident, b"x"])
        except zmq.ZMQError as exc:
            assert exc.errno == zmq.EHOSTUNREACH
            break
        threading.Event().wait(0.005)
    else:
        pytest.fail("the closed peer stayed routable")


def test_blocking_recv_releases_the_gil(pair: Any) -> None:
    router, dealer = pair
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(_recv(router)))
    t.start()
    threading.Event().wait(0.05)
    Z.send_parts(dealer, [b"late"])                        # runs while the thread waits
    t.join(10)
    assert not t.is_alive() and got[0][1:] == [b"late"]


def test_tracked_zero_copy(pair: Any) -> None:
    router, dealer = pair
    Z.send_parts(dealer, [b"hi"])
    ident = _recv(router)[0]
    payload = bytearray(b"p" * 5000)
    tr = Z.send_parts(router, [ident, b"hdr", payload, memoryview(b"q" * 100000)],
                      track_from=2, copy_threshold=1000)
    assert isinstance(tr, Z.Tracker)
    assert dealer.recv_multipart() == [b"hdr", b"p" * 5000, b"q" * 100000]
    tr.wait(5)
    assert tr.done and tr.done
    payload.extend(b"!")                # no longer exported once done
    # nothing tracked: done at once
    tr2 = Z.send_parts(router, [ident, b"h"], track_from=2)
    assert isinstance(tr2, Z.Tracker) and tr2.done
    assert dealer.recv_multipart() == [b"h"]
    # small tracked parts are copied (pyzmq's copy_threshold): done at once
    small = bytearray(b"s" * 100)
    tr3 = Z.send_parts(router, [ident, small], track_from=1)
    assert isinstance(tr3, Z.Tracker) and tr3.done
    small.extend(b"!")
    assert dealer.recv_multipart() == [b"s" * 100]


def test_tracker_holds_the_buffer_until_sent(pair: Any) -> None:
    router, dealer = pair
    Z.send_parts(dealer, [b"hi"])
    ident = _recv(router)[0]
    buf = bytearray(b"z" * 4096)
    tr = Z.send_parts(router, [ident, buf], track_from=1, copy_threshold=0)
    assert isinstance(tr, Z.Tracker)
    if not tr.done:
        with pytest.raises(BufferError):
            buf.extend(b"!")            # exported to libzmq
    del tr                              # dropped before done: kept until libzmq is done
    assert dealer.recv_multipart() == [b"z" * 4096]
    t3 = Z.send_parts(router, [ident, b"x"], track_from=1)   # sweeps finished orphans
    assert dealer.recv_multipart() == [b"x"]
    assert isinstance(t3, Z.Tracker)
    t3.wait(5)


def test_probe_refuses_an_object_without_libzmq() -> None:
    with pytest.raises(ImportError):
        Z._probe("/nonexistent/libzmq-not-loaded.so")
    with pytest.raises(ImportError):
        Z._probe(kvshm._bitmap.__file__)      # loaded, but no libzmq below it
    import zmq.backend.cython._zmq as backend

    Z._probe(backend.__file__)                 # the one in use: fine, changes nothing


def test_socket_handle_as_int(pair: Any) -> None:
    router, dealer = pair
    assert Z.send_parts(dealer.underlying, [b"n"]) is True
    assert _recv(router)[1:] == [b"n"]


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("how", ["recv_multipart", "recv1"])
def test_a_signal_during_a_blocking_receive(pair: Any, how: str) -> None:
    """A signal during a blocking receive (EINTR from libzmq): a handler that raises
    ends the wait with its exception and leaves the socket usable; one that returns
    lets the wait go on, and the message that comes later is received whole (the one
    receive loop, ``_recv_msg``, of recv_multipart, _rest and recv1)."""
    import signal

    router, dealer = pair
    Z.send_parts(dealer, [b"hi"])
    ident = _recv(router)[0]
    dealer.setsockopt(zmq.RCVTIMEO, 5000)

    def recv() -> Any:
        if how == "recv1":
            return Z.recv1(dealer, Z.EXISTS1, 7)
        return Z.recv_multipart(dealer, 0)

    fired: list[int] = []
    second = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        fired.append(signum)
        if len(fired) == 1:
            raise _Interrupted()
        second.set()

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(_Interrupted):
            recv()                          # nothing sent: only the signal ends it
        t = threading.Thread(target=lambda: second.wait(10) and
                             Z.send_parts(router, [ident, b"late", b"two"]))
        t.start()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        got = recv()                        # the handler returns: the wait goes on
        t.join(10)
        assert len(fired) == 2 and [bytes(p) for p in got] == [b"late", b"two"]
        Z.send_parts(router, [ident, b"next"])
        assert [bytes(p) for p in recv()] == [b"next"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
