"""A client DEALER gives up a TCP connect after CONNECT_TIMEOUT_MS and connects again.

On the cluster bed, after a partition healed, the peer's kernel dropped the first SYN of
the reconnection (TcpExt ListenDrops 1); the kernel sends a lost SYN again only after 1 s
(then 3 s, 7 s), so a call with a 1 s timeout met no reply and the member was marked
suspect though it was back (tests/test_cluster_bed.py::test_partition_longer_than_ttl_
then_heal failed about once in 12 runs). With the option set, libzmq abandons the connect
after CONNECT_TIMEOUT_MS and sends a new SYN RECONNECT_IVL later (measured on the bed: 6
of 30 heals had the SYN dropped, each read then took 0.61-0.70 s and hit).
"""

from __future__ import annotations

import asyncio

import zmq

from kvshm.zmq_ctrl import channel


def test_dealer_options_set_the_connect_timeout_and_a_new_routing_id() -> None:
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        ra, rb = channel.dealer_options(a), channel.dealer_options(b)
        assert a.getsockopt(zmq.CONNECT_TIMEOUT) == channel.CONNECT_TIMEOUT_MS > 0
        assert channel.CONNECT_TIMEOUT_MS < 1000     # below the kernel's first SYN retry
        assert a.getsockopt(zmq.LINGER) == 0 and a.getsockopt(zmq.IPV6) == 1
        assert a.getsockopt(zmq.ROUTING_ID) == ra and len(ra) == 16 and ra != rb
        a.close()
        b.close()
    finally:
        ctx.term()


def test_the_async_client_socket_has_it_too() -> None:
    from kvshm.aio import AsyncClient, _Conn
    from kvshm.errors import ServerUnavailable

    async def main() -> int:
        c = AsyncClient("127.0.0.1:1", transport="tcp", timeout=0.2)
        try:
            conn = _Conn(c, "tcp://127.0.0.1:1")      # no server there: nothing is sent
            try:
                return int(conn.sock.getsockopt(zmq.CONNECT_TIMEOUT))
            finally:
                conn.fail(ServerUnavailable, "test over")
        finally:
            await c.close()

    assert asyncio.run(main()) == channel.CONNECT_TIMEOUT_MS


def test_the_zmtp_transport_cuts_a_connect_at_the_same_time(monkeypatch) -> None:
    """The sync client's own ZMTP transport connects with a timeout of at most
    CONNECT_TIMEOUT_MS too (then tries again next slice)."""
    import socket

    import pytest

    from kvshm.errors import ServerUnavailable

    seen: list[float] = []

    def fake(addr, timeout=None, *a, **kw):      # a SYN that is never answered
        seen.append(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", fake)
    ch = channel.Channel("tcp://127.0.0.1:9", timeout=1.5)
    if not ch.zmtp:
        pytest.skip("the ZMTP transport is off (KVSHM_ZMTP=0)")
    try:
        with ch.lock, pytest.raises(ServerUnavailable):
            ch.request(1, {})
    finally:
        ch.close()
    assert len(seen) >= 2 and max(seen) <= channel.CONNECT_TIMEOUT_MS / 1000
