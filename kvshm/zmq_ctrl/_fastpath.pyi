"""Type stubs of the server's one-key fast path (kvshm/zmq_ctrl/_fastpath.pyx)."""

from collections.abc import Iterable, Sequence
from typing import Any, final

@final
class FastPath:
    """Serves plain one-key PUT/GET/EXISTS of a ServiceLoop in C (see the module)."""

    counts: dict[int, int]
    declined: int

    def __init__(self, loop: Any, version: int, buckets: Sequence[float], pack_below: int,
                 copy_below: int, ops: Iterable[int]) -> None: ...
    def handle(self, msg: list[Any], outq: list[Any]) -> bool: ...
