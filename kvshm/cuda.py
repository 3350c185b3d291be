"""CUDA tensors <-> the shared-memory pool, by DMA.

The pool is registered with the CUDA runtime (``cudaHostRegister``, portable) the first
time a CUDA tensor is copied into or out of it; the copies are then
``cudaMemcpyAsync`` between device memory and page-locked host memory (a DMA, no staging
buffer) on the tensor's current stream, followed by one stream synchronize.
:func:`kvshm.paged.put_pages` and :func:`~kvshm.paged.get_pages_into` call this module
for CUDA tensors; nothing else in kvshm needs it.

.. warning::

   This path has NOT run on a GPU. It was written and reviewed on a machine without
   one; only the absent-CUDA behaviour and the pure offset computations
   (:func:`coalesce`, :func:`kvshm.paged.page_pieces`) are tested. Run
   ``tests/test_paged.py`` on a CUDA host before relying on it.

It uses torch (``torch.cuda.cudart()`` for ``cudaHostRegister``, ``Tensor.copy_`` for
the copies): a CUDA tensor implies torch. :func:`available` says whether it can run;
every other function raises :class:`CudaUnavailable` where it cannot.

Notes
-----
A registered range stays registered while the pool is mapped. When the client attaches a
new segment (the server restarted), the old range is unregistered before the new one is
registered. Registering pins the whole pool in RAM (it is pre-faulted already).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from kvshm.errors import KvshmError

__all__ = ["available", "CudaUnavailable", "register_pool", "unregister_pool",
           "copy_to_pool", "copy_from_pool", "coalesce"]

log = logging.getLogger(__name__)

#: cudaHostRegister flags (driver_types.h).
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2

_lock = threading.Lock()
# pool data address -> (the Pool registered there, size in bytes). Checked against the
# Pool object, not only the address: a new segment mapped where an old one was must be
# registered again, or the DMA would reach the old pages. (Pool takes no weak references;
# holding a closed Pool object costs nothing.)
_registered: dict[int, tuple[Any, int]] = {}


class CudaUnavailable(KvshmError, RuntimeError):
    """A CUDA copy was asked where torch with CUDA is not available."""


def available() -> bool:
    """True when torch is importable and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:   # a broken driver install: no CUDA
        return False


def _torch() -> Any:
    if not available():
        raise CudaUnavailable(
            "CUDA is not available here (torch with a CUDA device is needed to copy a "
            "CUDA tensor into or out of the pool)")
    import torch

    return torch


def _check_rc(rc: Any, what: str) -> None:
    code = int(getattr(rc, "value", rc))
    if code != 0:
        raise KvshmError(f"{what} failed: CUDA error {code}")


def register_pool(pool: Any) -> None:
    """Page-lock the pool's data area for DMA (``cudaHostRegister``); idempotent.

    Raises
    ------
    CudaUnavailable
        No CUDA here.
    KvshmError
        The CUDA runtime refused (the error code is in the message).
    """
    torch = _torch()
    addr, size = int(pool.address), int(pool.size)
    with _lock:
        old = _registered.get(addr)
        if old is not None and old[0] is pool and old[1] == size:
            return
        cudart = torch.cuda.cudart()
        if old is not None:       # a registration left by a segment mapped here before
            _check_rc(cudart.cudaHostUnregister(addr), "cudaHostUnregister")
            del _registered[addr]
        _check_rc(cudart.cudaHostRegister(addr, size, HOST_REGISTER_PORTABLE),
                  f"cudaHostRegister of pool {pool.name} ({size} bytes)")
        _registered[addr] = (pool, size)


def unregister_pool(pool: Any) -> None:
    """Undo :func:`register_pool` (call before the pool is closed); no-op if not
    registered."""
    addr = int(pool.address)
    with _lock:
        if addr not in _registered:
            return
        torch = _torch()
        _check_rc(torch.cuda.cudart().cudaHostUnregister(addr), "cudaHostUnregister")
        del _registered[addr]


def coalesce(pool_offsets: Any, sizes: Any, buf_offsets: Any
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge pieces that continue each other in the pool and in the buffer.

    Piece i+1 joins piece i when ``pool_offsets[i] + sizes[i] == pool_offsets[i+1]`` and
    ``buf_offsets[i] + sizes[i] == buf_offsets[i+1]``: one copy call instead of two
    (consecutive pages at consecutive pool offsets, in ``"blocks_first"`` layout).
    Returns the three int64 arrays of the merged pieces, in order.
    """
    po = np.asarray(pool_offsets, np.int64).reshape(-1)
    sz = np.asarray(sizes, np.int64).reshape(-1)
    bo = np.asarray(buf_offsets, np.int64).reshape(-1)
    if not (po.shape == sz.shape == bo.shape):
        raise ValueError("pool_offsets, sizes and buf_offsets differ in length")
    if po.size <= 1:
        return po.copy(), sz.copy(), bo.copy()
    joins = (po[:-1] + sz[:-1] == po[1:]) & (bo[:-1] + sz[:-1] == bo[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    ends = np.concatenate((starts[1:], [po.size]))
    csum = np.concatenate(([0], np.cumsum(sz)))
    return po[starts], csum[ends] - csum[starts], bo[starts]


def _pool_bytes(torch: Any, pool: Any) -> tuple[Any, memoryview]:
    view = pool.view(0, pool.size)   # counted: the pool cannot close while it lives
    return torch.frombuffer(view, dtype=torch.uint8), view


def _device_bytes(tensor: Any) -> Any:
    import torch

    if not tensor.is_contiguous():
        raise ValueError("a CUDA tensor must be contiguous to be copied into the pool")
    return tensor.detach().reshape(-1).view(torch.uint8)


def copy_to_pool(pool: Any, tensor: Any, pool_offsets: Any, sizes: Any,
                 src_offsets: Any) -> int:
    """Copy pieces of a CUDA ``tensor`` into the pool: piece i is ``sizes[i]`` bytes
    from tensor byte ``src_offsets[i]`` to pool ``pool_offsets[i]``.

    Returns the bytes copied, after the copies completed (stream synchronized).

    Raises
    ------
    CudaUnavailable
        No CUDA here.
    ValueError
        ``tensor`` is not a contiguous CUDA tensor.
    IndexError
        A piece outside the pool or the tensor (checked before any copy).
    """
    return _copy(pool, tensor, pool_offsets, sizes, src_offsets, to_pool=True)


def copy_from_pool(pool: Any, pool_offsets: Any, sizes: Any, tensor: Any,
                   dst_offsets: Any) -> int:
    """Copy pool pieces into a CUDA ``tensor``: piece i is ``sizes[i]`` bytes from pool
    ``pool_offsets[i]`` to tensor byte ``dst_offsets[i]``. Raises as
    :func:`copy_to_pool`; returns after the copies completed."""
    return _copy(pool, tensor, pool_offsets, sizes, dst_offsets, to_pool=False)


def _copy(pool: Any, tensor: Any, pool_offsets: Any, sizes: Any, tensor_offsets: Any, *,
          to_pool: bool) -> int:
    torch = _torch()
    what = "copy_to_pool" if to_pool else "copy_from_pool"
    if getattr(tensor, "device", None) is None or tensor.device.type != "cuda":
        raise ValueError(f"{what} takes a CUDA tensor")
    po, sz, bo = coalesce(pool_offsets, sizes, tensor_offsets)
    dev = _device_bytes(tensor)
    _check_pieces(po, sz, bo, pool.size, dev.numel())
    register_pool(pool)
    host, view = _pool_bytes(torch, pool)
    try:
        with torch.cuda.device(tensor.device):
            stream = torch.cuda.current_stream()
            for o, s, b in zip(po.tolist(), sz.tolist(), bo.tolist()):
                if to_pool:
                    host[o:o + s].copy_(dev[b:b + s], non_blocking=True)
                else:
                    dev[b:b + s].copy_(host[o:o + s], non_blocking=True)
            stream.synchronize()
    finally:
        del host
        try:
            view.release()
        except BufferError:   # torch still holds it: freed with the tensor
            pass
    return int(sz.sum())


def _check_pieces(po: np.ndarray, sz: np.ndarray, bo: np.ndarray, pool_size: int,
                  buf_size: int) -> None:
    if po.size == 0:
        return
    if (sz < 0).any():
        raise ValueError("negative piece size")
    if (po < 0).any() or (po + sz > pool_size).any():
        raise IndexError(f"a piece is outside the pool of {pool_size} bytes")
    if (bo < 0).any() or (bo + sz > buf_size).any():
        raise IndexError(f"a piece is outside the tensor of {buf_size} bytes")
