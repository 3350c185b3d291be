"""RDMA mover (pyverbs). Work in progress: see issue 6."""

from __future__ import annotations

from typing import Any

from kvshm.errors import TransportError


def client_mover(hello: dict[str, Any], address: str, *, required: bool) -> Any:
    """The RDMA mover for a server's HELLO, or None when RDMA cannot be used."""
    if required:
        raise TransportError(f"transport='rdma' asked for {address}, but this build has "
                             "no RDMA mover yet")
    return None
