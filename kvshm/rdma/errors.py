"""Errors of the RDMA mover. All are :class:`kvshm.errors.TransportError` (an OSError)."""

from __future__ import annotations

from typing import Sequence

from kvshm.errors import TransportError
from kvshm.rdma.constants import wc_status_cause, wc_status_name

__all__ = ["RdmaError", "DeviceError", "MemlockError", "CompletionError", "PostError"]


class RdmaError(TransportError):
    """Something of the RDMA mover failed; the message names what and why."""


class DeviceError(RdmaError):
    """An RDMA device cannot be opened or used: no device, no such device, port down,
    no usable GID, pyverbs missing.

    Attributes
    ----------
    device : str or None
        The device name asked for (None: any device).
    cause : str
        Why, in words.
    """

    def __init__(self, device: str | None, cause: str) -> None:
        what = f"RDMA device {device}" if device else "RDMA"
        super().__init__(f"{what}: {cause}")
        self.device = device
        self.cause = cause

    def naming(self, device: str | None) -> "DeviceError":
        """This error, naming ``device`` when it named none."""
        if self.device is not None or device is None:
            return self
        return DeviceError(device, self.cause)


class MemlockError(RdmaError):
    """RLIMIT_MEMLOCK is too low to register (pin) the memory asked for."""


class PostError(RdmaError):
    """ibv_post_send refused a work request (queue full, bad request)."""


class CompletionError(RdmaError):
    """A work request completed with an error status.

    Attributes
    ----------
    key : bytes or None
        The key whose bytes the failed work request carried (the first one when it
        carried several).
    keys : list of bytes
        Every key of the failed work request.
    status : int
        The ``ibv_wc_status`` value; :attr:`status_name` is its ``IBV_WC_*`` name.
    op : str
        ``"RDMA WRITE"`` or ``"RDMA READ"``.
    vendor_err : int
        The provider's vendor error syndrome (0 when none).
    """

    def __init__(self, *, op: str, keys: Sequence[bytes], status: int, peer: str,
                 vendor_err: int = 0) -> None:
        self.op = op
        self.keys = list(keys)
        self.key = self.keys[0] if self.keys else None
        self.status = status
        self.status_name = wc_status_name(status)
        self.cause = wc_status_cause(status)
        self.vendor_err = vendor_err
        self.peer = peer
        more = f" (and {len(self.keys) - 1} more keys in the same work request)" \
            if len(self.keys) > 1 else ""
        vendor = f", vendor error 0x{vendor_err:x}" if vendor_err else ""
        super().__init__(
            f"{op} of key {self.key!r}{more} with the kvshm server at {peer} failed: "
            f"{self.status_name}, {self.cause}{vendor}. The RDMA connection was torn "
            "down; the next call re-establishes it")
