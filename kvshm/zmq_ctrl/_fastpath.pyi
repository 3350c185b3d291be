"""Type stubs of the server's one-key fast path (kvshm/zmq_ctrl/_fastpath.pyx)."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, final

@final
class FastPath:
    """Serves plain one-key PUT/GET/EXISTS of a ServiceLoop in C (see the module)."""

    @property
    def counts(self) -> dict[int, int]: ...
    declined: int
    lean_turns: int
    serve_returns: int

    def __init__(self, loop: Any, version: int, buckets: Sequence[float], pack_below: int,
                 copy_below: int, ops: Iterable[int]) -> None: ...
    def handle(self, msg: list[Any], outq: list[Any]) -> bool: ...
    def drain(self, recv: Callable[..., list[Any] | None], sock: Any, outq: list[Any],
              handle: Callable[[list[Any]], None], most: int) -> int: ...
    def serve(self, sock: Any, wake_fd: int, mon: Any, due: float,
              poll: Callable[[Any, int, Any, int], int],
              recv: Callable[..., list[Any] | None],
              send: Callable[[Any, tuple[bytes, bytes]], Any],
              handle: Callable[[list[Any]], None], most: int) -> int: ...
