"""Byte views of caller buffers: anything with the buffer protocol, and torch tensors."""

from __future__ import annotations

from typing import Any

__all__ = ["byte_view", "nbytes"]


def _tensor_view(t: Any, writable: bool) -> memoryview:
    dev = getattr(t, "device", None)
    if dev is not None and dev.type == "meta":
        raise ValueError("a meta tensor has no data to store")
    if getattr(t, "is_sparse", False) or getattr(t, "layout", None) not in (None,) and \
            str(getattr(t, "layout", "")) not in ("torch.strided", ""):
        raise ValueError(f"a {t.layout} tensor has no single buffer; store t.to_dense()")
    if dev is not None and dev.type != "cpu":
        raise ValueError(f"a tensor on {dev} needs the CUDA path (kvshm.cuda); "
                         "this call takes CPU memory")
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous (call .contiguous() first)")
    import torch

    if getattr(t, "is_conj", lambda: False)() or getattr(t, "is_neg", lambda: False)():
        t = t.resolve_conj().resolve_neg()     # lazy views: materialize first
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def byte_view(obj: Any, *, writable: bool = False, what: str = "value") -> memoryview:
    """A 1-D unsigned-byte memoryview over ``obj`` without copying.

    Parameters
    ----------
    obj : bytes, bytearray, memoryview, numpy array, torch CPU tensor, ...
        Must be C-contiguous.
    writable : bool
        Require a writable buffer (an output).

    Raises
    ------
    TypeError
        Not a buffer or tensor, or read-only where ``writable``.
    ValueError
        Not contiguous, or a tensor on a GPU.
    """
    try:
        m = memoryview(obj)
    except TypeError:
        if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):
            m = _tensor_view(obj, writable)
        else:
            raise TypeError(f"{what} must be bytes-like (buffer protocol) or a torch CPU "
                            f"tensor, got {type(obj).__name__}") from None
    if writable and m.readonly:
        raise TypeError(f"{what} must be writable, got a read-only {type(obj).__name__}")
    if not m.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (a strided view or a transposed "
                         "array is not; copy it with numpy.ascontiguousarray first)")
    if m.ndim == 1 and m.format == "B":
        return m
    return m.cast("B")


def nbytes(obj: Any) -> int:
    """Length in bytes of a buffer or tensor."""
    try:
        return memoryview(obj).nbytes
    except TypeError:
        return byte_view(obj).nbytes
