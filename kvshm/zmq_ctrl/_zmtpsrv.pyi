"""Type stubs of the native listener's compiled framing (kvshm/zmq_ctrl/_zmtpsrv.pyx)."""

from collections import deque
from collections.abc import Sequence
from typing import Any

from typing_extensions import Buffer, final

BIG: int
READY_MAX: int
CMDS_MAX: int
MSGS_TURN: int
FRAME_COST: int
READ_BYTES: int
GREETING: int
READY: int
OPEN: int
CLOSED: int

class ProtocolError(ValueError): ...

class Header(bytes):
    """A request's first frame and the facts of its connection (``get``)."""

    _conn: Conn
    def get(self, option: Any) -> Any: ...
    @property
    def conn(self) -> Conn: ...
    @property
    def buffer(self) -> memoryview: ...
    @property
    def bytes(self) -> bytes: ...  # type: ignore[override]

@final
class Tracker:
    """Whether the zero-copy parts of one send are written (``done``)."""

    done: bool
    _conn: Conn | None
    def __init__(self, conn: Conn | None = None) -> None: ...
    def wait(self, timeout: float | None = -1) -> None: ...

@final
class Wire:
    """What a listener's connections share: bounds (bytes), scratch, ready, backlog."""

    ready: deque[list[Any]]
    backlog: dict[int, Conn]
    max_frame_bytes: int
    max_message_bytes: int
    untrusted_message_bytes: int
    max_out_bytes: int
    max_out_messages: int
    def __init__(self, max_frame_bytes: int, max_message_bytes: int,
                 untrusted_message_bytes: int, max_out_bytes: int,
                 max_out_messages: int) -> None: ...

@final
class Conn:
    """One accepted connection of a listener: its framing state and queued output."""

    owner: Any
    sock: Any
    fd: int
    state: int
    ident: bytes
    frames: list[Any]
    held: int
    big: bytearray | None
    big_at: int
    big_more: bool
    out: deque[list[Any]]
    out_bytes: int
    out_msgs: int
    deadline: float
    trusted: bool
    peer: str
    stype: str
    writing: bool
    def __init__(self, owner: Any, wire: Wire, sock: Any, peer: str) -> None: ...
    @property
    def is_open(self) -> bool: ...
    @property
    def rbuf(self) -> bytes: ...
    def drop(self) -> None: ...
    def read(self) -> None: ...
    def parse(self) -> None: ...
    def queue(self, data: bytes) -> None: ...
    def send(self, parts: Sequence[Buffer], track_from: int = -1) -> Tracker | bool: ...
    def flush(self) -> None: ...
