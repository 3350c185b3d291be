"""ZeroMQ control plane: the wire protocol, the server loop and the client channel."""

from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Limits, Op, Status

__all__ = ["PROTOCOL_VERSION", "Limits", "Op", "Status"]
