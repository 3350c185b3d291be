"""Type stubs of the server's batch EXISTS / MATCH_PREFIX path (kvshm/zmq_ctrl/_batchq.pyx)."""

from collections.abc import Iterable
from typing import Any, final

SLICE_MULT: int
PARSE_MAX: int

def pack_keys_request(version: int, op: int, req_id: int, epoch: int,
                      keys: list[Any], start: int = 0, stop: int = -1) -> bytes | None: ...
def unpack_found_reply(frame: Any, version: int) -> tuple[int, int, dict[str, Any]] | None: ...

@final
class BatchQuery:
    """Serves plain batch EXISTS / MATCH_PREFIX of a ServiceLoop in C (see the module)."""

    counts: dict[int, int]
    declined: int
    c_slice: int

    def __init__(self, loop: Any, version: int, ops: Iterable[int], c_slice: int,
                 more: object) -> None: ...
    def handle(self, msg: list[Any], t0: float) -> bool: ...
