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
def wait_in(sock: zmq.Socket[Any] | int, fd: int = -1, mon: zmq.Socket[Any] | int | None = None,
            timeout_ms: int = -1) -> int: ...
def poll_in(sock: zmq.Socket[Any] | int, fd: int = -1, mon: zmq.Socket[Any] | int | None = None,
            timeout_ms: int = -1) -> int: ...

# the one-key request path (Channel.call1)
AGAIN: object
PUT1: int
GET1: int
GET1_INTO: int
EXISTS1: int
MAX_KEY1: int
MAX_VALUE1: int

class SendFailed(zmq.ZMQError):
    """libzmq refused a part of a one-key request."""

def encode1(op: int, req_id: int, epoch: int, key: builtins.bytes, size: int | None = None,
            checksum: int | None = None) -> builtins.bytes: ...
def send1(sock: zmq.Socket[Any] | int, op: int, req_id: int, epoch: int, key: builtins.bytes,
          value: Buffer | None = None, checksum: int | None = None,
          max_size: int = 65535) -> bool: ...
def recv1(sock: zmq.Socket[Any] | int, kind: int, req_id: int, out: Buffer | None = None,
          copy_threshold: int = 65536) -> Any: ...
def call1(sock: zmq.Socket[Any] | int, kind: int, op: int, req_id: int, epoch: int,
          key: builtins.bytes, value: Buffer | None, checksum: int | None, max_size: int,
          out: Buffer | None, copy_threshold: int = 65536) -> Any: ...
