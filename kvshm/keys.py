"""Store keys from token ids: chained block hashes under a model/dtype/rank/layer namespace.

Inference engines cache KV per *block* of tokens, and a block's KV depends on every token
before it, so the field keys a block by a hash that covers its whole prefix: the hash of
block ``i`` is computed from the hash of block ``i - 1`` and the tokens of block ``i``
(vLLM's ``hash_block_tokens``, SGLang's ``get_hash_str``, LMCache's chunk hashes). Two
token lists then share key ``i`` exactly when they share their first ``(i + 1) *
block_size`` tokens, and a prefix match on keys (:meth:`kvshm.Client.match_prefix`) is a
prefix match on tokens.

Each engine integration uses the engine's own hashes (``kvshm.integrations``); this module
is for standalone users, examples and the demo.

The recipe (version 1), exactly
-------------------------------
Tokens are cut into blocks of ``block_size`` tokens; only full blocks get a key unless
``partial=True`` (then a shorter last block gets one too).

``token bytes``
    The block's token ids as little-endian signed 32-bit integers (``numpy "<i4"``),
    concatenated: ``4 * len(block)`` bytes. Ids must lie in ``[0, 2**31)``.
``root``
    ``H(b"kvshm.keys/v1")``, the parent of block 0 (or the ``parent`` argument, to continue
    a chain).
``block hash``
    ``h[i] = H(h[i-1] || token bytes of block i)``, ``||`` concatenation of bytes.
``H``
    ``algo="sha256"`` (default): SHA-256, 32-byte digest (collision resistant: safe when
    tenants share a store). ``algo="xxh3_128"``: xxHash XXH3 128-bit with seed 0,
    16-byte big-endian digest (``xxhash.xxh3_128(data).digest()``), faster, not safe
    against crafted collisions.
``namespace``
    ``"kvshm1|" + model + "|" + dtype + "|tp" + tp_rank + "of" + tp_size + "|" + layer +
    "|"``, UTF-8, where ``model`` is percent-encoded (``urllib.parse.quote(model,
    safe="")``, so it holds no ``|``), ``dtype`` is a name such as ``bfloat16`` (a torch
    or numpy dtype is turned into its name), ``layer`` is ``L<n>`` for one layer or
    ``Lall`` for a value that holds every layer, and ``algo`` is appended as ``algo=<name>|``
    when it is not sha256 (so the two algorithms never share keys).
``key``
    ``namespace + hex(h[i])`` as bytes (ASCII): for example
    ``b"kvshm1|Qwen%2FQwen3-8B|bfloat16|tp0of2|L3|5f1c...e2"`` (64 hex digits with sha256).

The hash chain does not depend on the namespace, so :func:`block_hashes` runs once per
request and :meth:`KeySpace.keys_from_hashes` makes the keys of every layer and rank from
it.

Examples
--------
>>> ks = KeySpace("my-model", "bfloat16", tp_rank=0, tp_size=1, block_size=4)
>>> keys = ks.keys(list(range(10)))          # 2 full blocks of 4 tokens; 2 left over
>>> len(keys), keys[0][:36], len(keys[0])
(2, b'kvshm1|my-model|bfloat16|tp0of1|Lall', 101)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence
from urllib.parse import quote

import numpy as np

__all__ = ["RECIPE_VERSION", "ALGOS", "root_hash", "block_hashes", "namespace",
           "KeySpace", "token_keys"]

#: Version of the recipe above; it is part of every namespace (``kvshm1|``).
RECIPE_VERSION = 1

_ROOT_LABEL = b"kvshm.keys/v1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128(data).digest()  # type: ignore[no-any-return]


#: Hash functions by name: digest of bytes.
ALGOS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256, "xxh3_128": _xxh3_128}


def _algo(name: str) -> Callable[[bytes], bytes]:
    try:
        return ALGOS[name]
    except KeyError:
        raise ValueError(f"algo must be one of {sorted(ALGOS)}, got {name!r}") from None


def root_hash(algo: str = "sha256") -> bytes:
    """The parent hash of block 0: ``H(b"kvshm.keys/v1")``."""
    return _algo(algo)(_ROOT_LABEL)


def _token_bytes(tokens: Any) -> bytes:
    """Token ids as little-endian int32 bytes, checked to lie in [0, 2**31)."""
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):      # torch tensor
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        arr = arr.reshape(-1) if arr.size else arr.reshape(0)
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= 2 ** 31:
        raise ValueError(f"token ids must lie in [0, 2**31), got a range of [{lo}, {hi}]")
    return arr.astype("<i4", copy=False).tobytes()


def block_hashes(tokens: Any, block_size: int, *, algo: str = "sha256",
                 partial: bool = False, parent: bytes | None = None) -> list[bytes]:
    """Chained hashes of the blocks of ``tokens`` (see the module docstring).

    Parameters
    ----------
    tokens : sequence of int, 1-D int array or CPU tensor
        Token ids, each in ``[0, 2**31)``.
    block_size : int
        Tokens per block (vLLM: 16; LMCache: 256; SGLang: its page size). > 0.
    algo : {"sha256", "xxh3_128"}
    partial : bool
        Also hash a last block shorter than ``block_size``.
    parent : bytes, optional
        Hash of the block before ``tokens[0]``, to continue a chain; default the root.

    Returns
    -------
    list of bytes
        One digest per block (32 bytes with sha256, 16 with xxh3_128), in token order.

    Raises
    ------
    ValueError
        ``block_size <= 0``, a token id out of range, an unknown ``algo``.
    TypeError
        Token ids that are not integers.
    """
    if type(block_size) is not int and not isinstance(block_size, np.integer):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    h = _algo(algo)
    data = _token_bytes(tokens)
    step = 4 * int(block_size)
    end = len(data) if partial else len(data) - len(data) % step
    prev = root_hash(algo) if parent is None else bytes(parent)
    out = []
    for off in range(0, end, step):
        prev = h(prev + data[off:off + step])
        out.append(prev)
    return out


def _dtype_name(dtype: Any) -> str:
    """``"bfloat16"`` for ``"bfloat16"``, ``torch.bfloat16``; ``"float16"`` for ``np.float16``."""
    if isinstance(dtype, str):
        s = dtype
    elif str(dtype).startswith("torch."):
        s = str(dtype)
    else:
        try:
            s = np.dtype(dtype).name
        except TypeError:
            s = str(dtype)
    s = s[len("torch."):] if s.startswith("torch.") else s
    if not s or "|" in s:
        raise ValueError(f"bad dtype name {s!r}")
    return s


def namespace(model: str, dtype: Any, tp_rank: int = 0, tp_size: int = 1,
              layer: int | None = None, algo: str = "sha256") -> bytes:
    """The namespace bytes that start every key (see the module docstring).

    Raises
    ------
    ValueError
        An empty model name, ``tp_rank`` outside ``[0, tp_size)``, a negative layer.
    """
    if not model:
        raise ValueError("model name must not be empty")
    if not 0 <= int(tp_rank) < int(tp_size):
        raise ValueError(f"tp_rank must lie in [0, tp_size), got {tp_rank} of {tp_size}")
    if layer is not None and int(layer) < 0:
        raise ValueError(f"layer must be >= 0 or None, got {layer}")
    _algo(algo)
    lay = "Lall" if layer is None else f"L{int(layer)}"
    ns = (f"kvshm{RECIPE_VERSION}|{quote(model, safe='')}|{_dtype_name(dtype)}|"
          f"tp{int(tp_rank)}of{int(tp_size)}|{lay}|")
    if algo != "sha256":
        ns += f"algo={algo}|"
    return ns.encode()


@dataclass(frozen=True)
class KeySpace:
    """Keys of one model, dtype, tensor-parallel rank and layer.

    Parameters
    ----------
    model : str
        Model name (any string; percent-encoded in the key).
    dtype : str, torch.dtype or numpy dtype
        KV dtype (``"bfloat16"``, ``torch.float16``, ...).
    tp_rank, tp_size : int
        Tensor-parallel rank of the process and number of ranks.
    layer : int or None
        Layer index, or None when one value holds every layer.
    block_size : int
        Tokens per block.
    algo : {"sha256", "xxh3_128"}
    """

    model: str
    dtype: Any
    tp_rank: int = 0
    tp_size: int = 1
    layer: int | None = None
    block_size: int = 256
    algo: str = "sha256"
    prefix: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", namespace(self.model, self.dtype, self.tp_rank,
                                                     self.tp_size, self.layer, self.algo))
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")

    def with_layer(self, layer: int | None) -> "KeySpace":
        """The same namespace for another layer."""
        return replace(self, layer=layer)

    def with_rank(self, tp_rank: int) -> "KeySpace":
        """The same namespace for another tensor-parallel rank."""
        return replace(self, tp_rank=tp_rank)

    def hashes(self, tokens: Any, *, partial: bool = False,
               parent: bytes | None = None) -> list[bytes]:
        """:func:`block_hashes` with this space's block size and algorithm."""
        return block_hashes(tokens, self.block_size, algo=self.algo, partial=partial,
                            parent=parent)

    def keys_from_hashes(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Keys for block hashes computed once (for example for every layer)."""
        p = self.prefix
        return [p + h.hex().encode() for h in hashes]

    def keys(self, tokens: Any, *, partial: bool = False,
             parent: bytes | None = None) -> list[bytes]:
        """One key per block of ``tokens`` (see :func:`block_hashes` for the arguments)."""
        return self.keys_from_hashes(self.hashes(tokens, partial=partial, parent=parent))


def token_keys(tokens: Any, *, model: str, dtype: Any, tp_rank: int = 0, tp_size: int = 1,
               layer: int | None = None, block_size: int = 256, algo: str = "sha256",
               partial: bool = False) -> list[bytes]:
    """Keys of the blocks of ``tokens``: ``KeySpace(...).keys(tokens)`` in one call."""
    return KeySpace(model, dtype, tp_rank, tp_size, layer, block_size, algo).keys(
        tokens, partial=partial)
