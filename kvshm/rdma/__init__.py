"""RDMA mover: one-sided RDMA WRITE/READ against the server's pool (pyverbs).

Modules, one concern each (pyverbs habits):

=============== ==========================================================================
``verbs``       the pyverbs loader and backend; the one place that maps pyverbs objects
``device``      open a device and port; choose the GID from the port's GID table
``qp``          QP information exchanged in HELLO; RESET -> INIT -> RTR -> RTS attributes
``wr``          work-request planning: split, gather, signal (pure)
``mr_cache``    caller buffers registered once, cached by address range
``memlock``     RLIMIT_MEMLOCK check
``server``      the server endpoint: PD, the pool's MR, CQ, one RC QP per client
``client``      the client link and :class:`RdmaMover`
=============== ==========================================================================

Importing this package does not import pyverbs; opening a device does. The session of
:mod:`kvshm.client` calls :func:`hello_fields` for the HELLO it sends and
:func:`client_mover` with the reply (see ``docs/RDMA.md`` for the handshake).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from kvshm.errors import TransportError
from kvshm.rdma.client import ClientLink, RdmaMover, RdmaOptions
from kvshm.rdma.errors import (CompletionError, DeviceError, MemlockError, PostError,
                               RdmaError)

__all__ = ["RdmaOptions", "RdmaMover", "ClientLink", "RdmaError", "DeviceError",
           "MemlockError", "CompletionError", "PostError", "hello_fields", "client_mover",
           "open_server_endpoint"]

log = logging.getLogger(__name__)


def _link(session: Any) -> ClientLink:
    link = getattr(session, "rdma", None)
    if link is None:
        ref = weakref.ref(session)

        def on_broken() -> None:
            s = ref()
            if s is not None:
                s.need_hello = True

        link = ClientLink(RdmaOptions.coerce(getattr(session, "rdma_options", None)),
                          on_broken)
        session.rdma = link
    return link


def hello_fields(session: Any) -> dict[str, Any]:
    """The ``rdma`` field of the HELLO body a client session sends, or ``{}``.

    ``transport="rdma"``: always a new QP (raises DeviceError etc. when this host cannot).
    ``transport="auto"``: only once the server offered RDMA (:func:`client_mover` of an
    earlier HELLO decided so) and while RDMA has not failed.
    """
    t = session.transport
    if t not in ("rdma", "auto"):
        return {}
    link = getattr(session, "rdma", None)
    if t == "auto" and (link is None or not link.wanted):
        return {}
    link = _link(session)
    try:
        return {"rdma": link.prepare()}
    except RdmaError as exc:
        if t == "rdma":
            raise
        link.give_up(exc)
        return {}


def client_mover(hello: dict[str, Any], address: str, *, required: bool,
                 session: Any = None) -> RdmaMover | None:
    """The RDMA mover for a server's HELLO reply, or None when RDMA is not used.

    Parameters
    ----------
    hello : dict
        The HELLO reply (its ``rdma`` field).
    address : str
        The server, for messages.
    required : bool
        ``transport="rdma"``: raise instead of returning None.
    session : kvshm.client._Session, optional
        The session whose :func:`hello_fields` offered a QP in this HELLO.

    Raises
    ------
    TransportError
        ``required`` and RDMA cannot be used; the message says why.
    """
    reply = hello.get("rdma")
    link = getattr(session, "rdma", None) if session is not None else None
    if link is not None and link.pending is not None:
        try:
            return link.connect(reply, address)
        except RdmaError as exc:
            if required:
                raise
            link.give_up(exc)
            return None
    if required:
        raise TransportError(f"transport='rdma' asked for {address}, but no RDMA QP was "
                             "offered in the HELLO (this client path does not call "
                             "kvshm.rdma.hello_fields)")
    # transport="auto", HELLO without a QP: try RDMA if the server offers it and this
    # host has a usable device; the client then says HELLO again with a QP.
    if session is None or not (isinstance(reply, dict) and reply.get("offer")):
        return None
    if link is not None and link.failed is not None:
        return None
    link = _link(session)
    try:
        link.open()
    except RdmaError as exc:
        link.give_up(exc)
        return None
    link.want()
    return None


def open_server_endpoint(dev_name: str, *, pool_bytes: int, ib_port: int = 1,
                         link_type: str | None = None, gid_index: int | None = None,
                         host: str | None = None, backend: Any = None) -> Any:
    """Open the server's RDMA endpoint (:class:`kvshm.rdma.server.ServerEndpoint`)."""
    from kvshm.rdma.server import ServerEndpoint

    return ServerEndpoint.open(dev_name, ib_port=ib_port, link_type=link_type,
                               gid_index=gid_index, pool_bytes=pool_bytes, host=host,
                               backend=backend)
