"""What a replay stores for one request of the trace: its keys, in order, and their sizes.

Two modes:

- **one-block** (no ``--chunk-tokens``): one entry of ``--block-bytes`` per hash id of the
  trace, every entry the same size. A store with exact LRU eviction must then give the
  exact LRU's hit rate: the replay checks that the two agree, and they do by
  construction (the same keys, the same sizes, one block each).
- **chunks** (``--chunk-tokens N``, N in 16, 64, 256, 512): sizes as a model's KV cache
  has them. ``--block-bytes`` is then the KV bytes of one 512-token trace block (so
  ``block_bytes / 512`` bytes a token); each block becomes ``512 / N`` chained keys of N
  tokens, as vLLM (pages of 16 tokens), SGLang and LMCache (chunks of 256) key them, and
  the last block of a request holds only ``input_length - 512 * (blocks - 1)`` tokens:
  its last chunk is partial (its own key, its own, smaller size). Here the store and an
  exact LRU of equal capacity may disagree (blocks rounding, fragmentation, batches), and
  the replay reports both by keys and by bytes; equality is not expected.

A chunk key is an int: ``((hash_id * 32 + j) << 10) | tail``, j the chunk of the block
(< 32 since N >= 16), ``tail`` the tokens of a partial last chunk (1..N-1; 0 for a full
chunk). Chunk j of block h stands for every token before it (hash ids are prefix
hashes), so the keys chain as the engines' do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Workload", "CHUNK_TOKENS", "WorkloadError", "TOKENS_PER_BLOCK"]

#: Tokens of one trace block (one hash id of the Mooncake traces).
TOKENS_PER_BLOCK = 512

#: Chunk sizes accepted by ``--chunk-tokens`` (tokens; each divides 512).
CHUNK_TOKENS = (16, 64, 256, 512)
_MAX_CHUNKS = TOKENS_PER_BLOCK // min(CHUNK_TOKENS)     # 32
_TAIL_BITS = 10                                         # tail tokens < 512 < 2**10


class WorkloadError(ValueError):
    """A request whose ``input_length`` does not fit its hash ids (names the request)."""


@dataclass(frozen=True)
class Workload:
    """Keys and sizes of the requests of a replay.

    Attributes
    ----------
    block_bytes : int
        One-block mode: bytes of every entry. Chunk mode: KV bytes of one 512-token
        trace block (a multiple of 4096: 8 bytes a token or more).
    chunk_tokens : int or None
        None: one-block mode; else tokens of one chunk (16, 64, 256 or 512).
    """

    block_bytes: int
    chunk_tokens: int | None = None

    @property
    def one_block(self) -> bool:
        """True in one-block mode (where the store must equal the exact LRU)."""
        return self.chunk_tokens is None

    @property
    def entry_bytes(self) -> int:
        """Bytes of a full entry (the largest value the replay writes)."""
        if self.chunk_tokens is None:
            return self.block_bytes
        return self.block_bytes * self.chunk_tokens // TOKENS_PER_BLOCK

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token (chunk mode)."""
        return self.block_bytes // TOKENS_PER_BLOCK

    def describe(self) -> str:
        if self.chunk_tokens is None:
            return f"one-block: one entry of {self.block_bytes} bytes per trace block"
        return (f"chunks of {self.chunk_tokens} tokens ({self.entry_bytes} bytes, "
                f"{self.token_bytes} bytes a token), last chunk of a request partial")

    def keys(self, ids: Sequence[int], input_length: int | None) -> tuple[list[int], int]:
        """The keys of a request with hash ids ``ids`` and ``input_length`` tokens (None:
        whole blocks), and the size in bytes of its last key (0 for no keys); every other
        key is :attr:`entry_bytes` long.

        Raises :class:`WorkloadError` in chunk mode when ``input_length`` does not fit
        ``ids`` (more than 512 per id, or not more than 512 per id but the last).
        """
        n = len(ids)
        if self.chunk_tokens is None:
            return list(ids), (self.block_bytes if n else 0)
        if n == 0:
            return [], 0
        T = TOKENS_PER_BLOCK
        N = self.chunk_tokens
        per = T // N
        tail_tokens = T if input_length is None else input_length - T * (n - 1)
        if not 0 < tail_tokens <= T:
            raise WorkloadError(f"input_length {input_length} does not fit {n} blocks of "
                                f"{T} tokens")
        keys = [((h * _MAX_CHUNKS + j) << _TAIL_BITS) for h in ids[:-1] for j in range(per)]
        h = ids[-1]
        full, part = divmod(tail_tokens, N)
        keys += [((h * _MAX_CHUNKS + j) << _TAIL_BITS) for j in range(full)]
        if part:
            keys.append(((h * _MAX_CHUNKS + full) << _TAIL_BITS) | part)
            return keys, part * self.token_bytes
        return keys, self.entry_bytes

    def size_of(self, key: int) -> int:
        """Bytes of the value of ``key``."""
        if self.chunk_tokens is None:
            return self.block_bytes
        tail = key & ((1 << _TAIL_BITS) - 1)
        return tail * self.token_bytes if tail else self.entry_bytes

    def prefix_bytes(self, nkeys: int, last: int, h: int) -> int:
        """Bytes of the first ``h`` keys of a request of ``nkeys`` keys whose last key
        has ``last`` bytes."""
        if h <= 0:
            return 0
        if h < nkeys:
            return h * self.entry_bytes
        return (nkeys - 1) * self.entry_bytes + last
