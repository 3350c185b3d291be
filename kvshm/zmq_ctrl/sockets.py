"""The server's ROUTER socket: its options (:func:`make_router`) and binding (:func:`bind`).

:class:`~kvshm.zmq_ctrl.router.ServiceLoop` makes its socket here unless it is given one
(:mod:`kvshm.server` makes it first, to bind several endpoints); both names are
importable from :mod:`kvshm.zmq_ctrl.router` as before.
"""

from __future__ import annotations

from typing import Callable

import zmq

def make_router(ctx: zmq.Context, socket_setup: Callable[[zmq.Socket], None] | None = None,
                max_frame_bytes: int = -1, ipv6: bool = False) -> zmq.Socket:
    """The server's ROUTER socket with its options set, not bound yet (``ipv6``: to bind
    an IPv6 address)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # No handover: a second connection claiming a connected peer's routing id is not
    # served (libzmq leaves it unidentified), so it can neither act on that peer's
    # session nor get its replies (docs/RELIABILITY.md, "Sessions and routing ids");
    # clients take a new routing id for each connection.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    if max_frame_bytes > 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if socket_setup is not None:
        socket_setup(sock)
    return sock


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint``; returns the bound address (the port chosen for port 0).

    Raises
    ------
    OSError
        The address is taken or cannot be bound, with the endpoint in the message.
    """
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"cannot bind {endpoint}: {exc.strerror}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
