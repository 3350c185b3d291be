"""Type stubs of the per-key loops of a batch in C (kvshm/_batch.pyx)."""

from collections.abc import Callable, Sequence
from typing import Any

def keys(ks: list[Any], limit: int) -> tuple[list[bytes], int] | None: ...
def value_views(bkeys: list[bytes], values: Sequence[Any], capacity: int, max_value: int,
                byte_view: Callable[..., memoryview], too_large: type[Exception]
                ) -> tuple[list[memoryview], list[int]]: ...
def pack_values(bkeys: list[bytes], values: Sequence[Any], capacity: int, max_value: int,
                byte_view: Callable[..., memoryview], too_large: type[Exception]
                ) -> tuple[list[int], list[Any], list[int]]: ...
def out_views(bkeys: list[bytes], outs: Sequence[Any],
              byte_view: Callable[..., memoryview]) -> list[memoryview]: ...
def check_outs(bkeys: list[bytes], outs: Sequence[Any],
               byte_view: Callable[..., memoryview]) -> None: ...
def plan(sizes: Sequence[int]) -> list[tuple[int, int]]: ...
def pack(views: Sequence[Any]) -> tuple[list[Any], list[int]]: ...
def unpack(frames: Sequence[Any], counts: Sequence[Any], sizes: Sequence[Any],
           slow: Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], list[Any]]
           ) -> list[Any]: ...
def fill(frames: Sequence[Any], counts: Sequence[Any], sizes: list[Any],
         outs: list[memoryview] | None) -> list[Any] | None: ...
def fill_outs(frames: Sequence[Any], counts: Sequence[Any], sizes: list[Any],
              outs: Sequence[Any]) -> bool: ...
def pack_request(version: int, op: int, req_id: int, epoch: int, body: Any) -> bytes | None:
    """msgpack.packb([version, op, req_id, epoch, body], use_bin_type=True) byte for byte
    for a plain body (str keys; None, bool, int, bytes, str or lists of them), else None."""
def scan_plain(buf: Any, pos: int, k: int) -> int:
    """End offset of k plain msgpack items (bin, int, nil, bool) from pos, or -1."""
def pack_fixints(v: list[Any], a: int, b: int) -> bytes | None:
    """msgpack.packb(v[a:b]) without its array header when each item is an int 0..127,
    else None."""
def all_bools(v: list[Any]) -> bool:
    """Whether every item of v is True or False (bool objects only)."""
def sizes_ok(sizes: list[Any], n: int, most: int) -> bool:
    """Whether sizes is n ints, each -2, -1 or in [0, most]."""
def places_ok(offsets: list[Any], sizes: list[Any], capacity: int) -> bool:
    """Whether each hit's place (an int offset, or byte extents) lies in the pool."""
