"""Type stubs of the compiled shared index (kvshm/_shmindex.pyx).

Extents are (first block, block count) runs; sizes in bytes; epochs as in HELLO.
"""

from collections.abc import Sequence
from typing import Any

from typing_extensions import Buffer, Self, final

from kvshm._pool import Pool

#: Most block runs one entry may have.
MAX_EXTENTS: int
#: Longest key the table holds (longer ones are asked of the server).
KEY_MAX: int
#: Bytes per slot.
SLOT_SIZE: int
#: Bytes of a slot shared by its key, checksum and runs.
SLOT_DATA: int
#: Largest value size a slot holds (1 TiB - 1); larger values are asked of the server.
SLOT_SIZE_MAX: int
#: Bytes of a wide record (an entry a slot cannot hold).
WIDE_SIZE: int
#: Slots a table starts with (it grows as GROWTH says, up to its capacity).
INITIAL_SLOTS: int
#: (at, by) in sixteenths: growth from at/16 full by by/16; refusals at (at + 1)/16.
GROWTH: tuple[int, int]
#: Environment variable "AT,BY": the growth of writers made without ``growth=``.
ENV_GROWTH: str
MIGRATE_STEP: int
RESERVE_STEP: int
#: Bytes of the index segment's header.
HEADER_SIZE: int
#: Records of the reads ring.
RING_RECORDS: int
ROOM_RETRY_S: float
#: Keys ahead of the one looked up whose slots a batch lookup prefetches.
PREFETCH_AHEAD: int
#: Keys a batch lookup answers under one look at the header's tables.
BATCH_CHUNK: int
BATCH_SEGMENT: int
BATCH_SEGMENT_BYTES: int
BATCH_THREADS_MIN: int
#: Set (not "" or "0") when a reader is made: its batch lookups go one key at a time.
ENV_NO_FAST_BATCH: str
ENV_BATCH_THREADS: str
#: A read the caller must ask of the server instead.
FALLBACK: int
#: A read that found nothing, and the store holds nothing for that key.
MISS: int
#: Byte offset and closed value of the header's state word.
STATE_OFFSET: int
STATE_CLOSED: int
#: The table layout this build writes and reads (5), and where the header holds it.
LAYOUT: int
LAYOUT_OFFSET: int
#: Byte offsets in a slot of its meta word (size in its low 40 bits, hash tag, key
#: length, state, flags, runs), of its key (then checksum, runs) and of the size's word.
SLOT_META_OFFSET: int
SLOT_KEY_OFFSET: int
SLOT_SIZE_OFFSET: int

def key_hash(key: bytes | str) -> int:
    """The table's 64-bit hash of ``key``."""
def default_batch_threads() -> int:
    """1 (ENV_BATCH_THREADS unset): more threads are opt-in."""
def batch_helper_stats() -> dict[str, Any]:
    """{"threads": helper threads made, "pieces": segment pieces they looked up,
    "by_helper": each helper's pieces (list of int, in the order made)}."""
def growth_policy(growth: tuple[int, int] | None = ...) -> tuple[int, int]:
    """The (at, by) an IndexWriter would take (None: ENV_GROWTH, else GROWTH); ValueError."""
def default_slots(num_blocks: int) -> int:
    """Capacity in slots: the next power of two >= 2 x ``num_blocks``."""

@final
class IndexWriter:
    """The server's side: publishes entries, applies recorded reads."""

    name: str
    reads_name: str
    epoch: int
    rebuilds: int
    max_step: int
    max_step_s: float
    max_step_cpu_s: float
    steps: int
    steps_cpu_s: float
    sync_finishes: int
    skipped_records: int
    reads_applied: int
    @staticmethod
    def create(
        name: str,
        reads_name: str,
        nslots: int,
        *,
        epoch: int,
        block_size: int,
        num_blocks: int,
        token: bytes = ...,
        misses_final: bool = True,
        ring_records: int = ...,
        initial_slots: int = ...,
        migrate_step: int = ...,
        growth: tuple[int, int] | None = None,
    ) -> IndexWriter: ...
    @property
    def growth(self) -> tuple[int, int]: ...
    @property
    def nslots(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def live(self) -> int: ...
    @property
    def tombstones(self) -> int: ...
    @property
    def unpublished(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def info(self) -> dict[str, Any]:
        """``{"name", "reads", "epoch", "slots"}``: what HELLO tells clients."""
    def stats(self) -> dict[str, int]: ...
    def publish(
        self, key: bytes | str, size: int, extents: Sequence[tuple[int, int]],
        checksum: int | None = None,
    ) -> int:
        """The slot, or -1 when not published (too long, too many runs, table full)."""
    def publish_many(
        self, keys: Sequence[bytes | str], sizes: Sequence[int],
        extents: Sequence[Sequence[tuple[int, int]]],
        checksums: Sequence[int | None] | None = None,
    ) -> int:
        """:meth:`publish` of each, in order, slots prefetched ahead; how many were not
        published."""
    def publish_runs(self, keys: list[bytes], sizes: Any, starts: Any, counts: Any) -> int:
        """publish_many of one-run values without checksums from int64 buffers; how many
        were not published."""
    def unpublish(self, key: bytes | str) -> bool:
        """The slot's version has changed when this returns."""
    def contains_many(self, keys: Sequence[Any]) -> list[bool]:
        """Whether each key is in the table (not bytes: False), probes prefetched."""
    def clear(self) -> None: ...
    def set_misses_final(self, final: bool) -> None: ...
    def drain(self, stuck_after: float = 0.05) -> list[bytes]:
        """Keys read lock-free since the last call, oldest first."""
    def close(self) -> None: ...
    def unlink(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...

@final
class IndexReader:
    """A client's read-only view of the table, reading values through ``pool``."""

    name: str
    epoch: int
    max_key: int
    hits: int
    misses: int
    fallbacks: int
    retries: int
    #: batch lookups prefetch ahead (False: one key at a time; ENV_NO_FAST_BATCH)
    fast_batch: bool
    #: fewest keys of a batch lookup split over batch_threads (BATCH_THREADS_MIN)
    threads_min: int
    #: threads (1-8, the caller's included) of a large batch lookup (ENV_BATCH_THREADS)
    batch_threads: int
    def __init__(self, name: str, reads_name: str, pool: Pool, epoch: int,
                 max_key: int = ...) -> None: ...
    def close(self) -> None:
        """BufferError while a read runs in another thread."""
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def address(self) -> int: ...
    @property
    def usable(self) -> bool:
        """False once the server stopped or died."""
    @property
    def header(self) -> dict[str, Any]: ...
    def get(self, key: bytes | str) -> bytes | None | int:
        """The value, None for a miss, or FALLBACK."""
    def get_into(self, key: bytes | str, dst: Buffer) -> int:
        """Size copied, MISS or FALLBACK; ValueError when ``dst`` is too small."""
    def get_many_into(self, keys: Sequence[bytes | str], dsts: Sequence[Buffer]) -> list[int]: ...
    def get_many(self, keys: Sequence[bytes | str]) -> list[bytes | None | int]: ...
    def lookup(
        self, key: bytes | str
    ) -> tuple[tuple[int, int], int, tuple[tuple[int, int], ...], int | None] | None | int:
        """(token, size, extents, checksum), None for a miss, or FALLBACK."""
    def locate(
        self, keys: Sequence[bytes | str]
    ) -> tuple[list[int], list[int], list[tuple[int, int]]] | None:
        """(offsets, sizes, tokens) of single-run values (-1 for misses), or None."""
    def validate(self, tokens: Sequence[tuple[int, int]]) -> bool: ...
    def exists_batch(self, keys: Sequence[bytes | str]) -> list[bool] | None: ...
    def match_prefix(self, keys: Sequence[bytes | str]) -> int:
        """Leading keys present, or FALLBACK."""
