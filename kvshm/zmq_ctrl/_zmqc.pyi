"""Type stubs of the direct libzmq calls (kvshm/zmq_ctrl/_zmqc.pyx)."""

import builtins
from collections.abc import Sequence
from typing import Any

import zmq
from typing_extensions import Buffer, final

DONTWAIT: int
SNDMORE: int

@final
class Frame:
    """A received part kept as its libzmq message (zero-copy, read-only buffer)."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    @property
    def bytes(self) -> builtins.bytes: ...
    @property
    def buffer(self) -> memoryview: ...
    def get(self, option: int | str | builtins.bytes) -> Any: ...

@final
class Tracker:
    """Whether libzmq is done with the zero-copy parts of one send_parts call."""

    @property
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = -1) -> None: ...

def recv_multipart(sock: zmq.Socket[Any] | int, flags: int = 1, copy_threshold: int = 65536,
                   keep: int = -1) -> list[bytes | Frame] | None: ...
def send_parts(sock: zmq.Socket[Any] | int, parts: Sequence[Buffer], flags: int = 0,
               track_from: int = -1, copy_threshold: int = 65536) -> bool | Tracker: ...
def _probe(path: str) -> None: ...
def sweep(timeout: float = 0.0) -> int: ...
def poll_in(sock: zmq.Socket[Any] | int, fd: int = -1, mon: zmq.Socket[Any] | int | None = None,
            timeout_ms: int = -1) -> int: ...
