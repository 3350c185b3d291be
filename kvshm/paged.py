"""Pages of paged KV tensors in and out of the store, one key per page.

vLLM keeps the KV cache of one layer as a *paged* tensor: a page (vLLM's block) of
``block_size`` tokens holds a K half and a V half. Two layouts are in use:

``"kv_first"``
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (FlashAttention and most
    backends): the K halves of all pages come first, then the V halves, so the two halves
    of one page are *not* adjacent.
``"blocks_first"``
    ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (FlashInfer and others): a
    page is one contiguous run of bytes.

The trailing dimensions are not interpreted: any ``[2, num_blocks, *page]`` or
``[num_blocks, 2, *page]`` tensor of three or more dimensions works (an MLA cache with
no K/V split is simply a ``[num_blocks, ...]`` tensor: store its rows with
``put_batch``).

The value stored under a page's key is that page's K half followed by its V half,
``2 * prod(page) * itemsize`` bytes, whatever the layout: a page written from one layout
can be read into the other.

With the shared-memory mover the selected pages move in *one* :meth:`Pool.scatter
<kvshm.Pool.scatter>` or :meth:`Pool.gather <kvshm.Pool.gather>` call (the GIL released):
for ``"kv_first"`` each page is one stored value made of two pieces, K to the value's
offset and V to offset + half. Over TCP (or RDMA) the page bytes are first built in one
buffer (one extra copy); correct, slower.

CUDA tensors take the same calls: the pages go GPU <-> pool directly through
:mod:`kvshm.cuda` (the pool registered with the CUDA runtime). That path has NOT run on
a GPU yet (see :mod:`kvshm.cuda`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from kvshm.errors import ValueTooLarge
from kvshm.movers import ShmMover

__all__ = ["LAYOUTS", "put_pages", "get_pages_into", "op_put_pages", "op_get_pages_into",
           "resolve_layout", "page_pieces", "PagedKV"]

#: Accepted values of the ``layout`` argument.
LAYOUTS = ("auto", "kv_first", "blocks_first")


# --------------------------------------------------------------------------- pure helpers


def resolve_layout(shape: Sequence[int], layout: str = "auto") -> str:
    """``"kv_first"`` or ``"blocks_first"`` for a paged KV tensor of ``shape``.

    Raises
    ------
    ValueError
        Fewer than 3 dimensions, a layout name not in :data:`LAYOUTS`, a shape that does
        not have 2 where the layout puts K/V, or (``"auto"``) a shape where both leading
        dimensions are 2 or neither is.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    shape = tuple(int(d) for d in shape)
    if len(shape) < 3:
        raise ValueError(f"a paged KV tensor has at least 3 dimensions ([2, num_blocks, "
                         f"...] or [num_blocks, 2, ...]), got shape {shape}")
    if layout == "auto":
        if shape[0] == 2 and shape[1] != 2:
            return "kv_first"
        if shape[1] == 2 and shape[0] != 2:
            return "blocks_first"
        if shape[0] == 2:
            raise ValueError(f"shape {shape} fits both [2, num_blocks, ...] and "
                             "[num_blocks, 2, ...]: pass layout='kv_first' or "
                             "'blocks_first'")
        raise ValueError(f"shape {shape} is neither [2, num_blocks, ...] (kv_first) nor "
                         "[num_blocks, 2, ...] (blocks_first)")
    want = 0 if layout == "kv_first" else 1
    if shape[want] != 2:
        form = "[2, num_blocks, ...]" if want == 0 else "[num_blocks, 2, ...]"
        raise ValueError(f"layout {layout!r} needs shape {form}, got {shape}")
    return layout


def page_pieces(layout: str, num_blocks: int, half_bytes: int, page_ids: Any,
                pool_offsets: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte pieces that move pages ``page_ids`` of a paged tensor to or from the pool.

    Page ``page_ids[j]`` is stored at pool offset ``pool_offsets[j]`` as its K half
    followed by its V half (``2 * half_bytes`` bytes).

    Parameters
    ----------
    layout : {"kv_first", "blocks_first"}
    num_blocks : int
        Pages in the tensor.
    half_bytes : int
        Bytes of the K (or V) half of one page.
    page_ids, pool_offsets : sequences of int, same length

    Returns
    -------
    (pool_offsets, sizes, tensor_offsets) : three int64 arrays, one entry per piece
        Piece i is ``sizes[i]`` bytes at pool ``pool_offsets[i]`` and at tensor byte
        ``tensor_offsets[i]``. ``"kv_first"``: two pieces per page (K then V);
        ``"blocks_first"``: one piece per page. Ready for
        ``Pool.scatter(tensor, pool_offsets, sizes, tensor_offsets)`` and
        ``Pool.gather(pool_offsets, sizes, tensor, tensor_offsets)``.
    """
    ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
    po = np.asarray(pool_offsets, dtype=np.int64).reshape(-1)
    if ids.shape != po.shape:
        raise ValueError(f"{ids.size} page ids but {po.size} pool offsets")
    n = ids.size
    if layout == "blocks_first":
        page = 2 * half_bytes
        return (np.ascontiguousarray(po), np.full(n, page, np.int64), ids * page)
    if layout != "kv_first":
        raise ValueError(f"layout must be 'kv_first' or 'blocks_first', got {layout!r}")
    pool = np.empty(2 * n, np.int64)
    pool[0::2] = po
    pool[1::2] = po + half_bytes
    buf = np.empty(2 * n, np.int64)
    buf[0::2] = ids * half_bytes
    buf[1::2] = (ids + num_blocks) * half_bytes
    return pool, np.full(2 * n, half_bytes, np.int64), buf


def _page_rows(layout: str, num_blocks: int, ids: np.ndarray) -> np.ndarray:
    """Rows of the tensor's byte matrix (see PagedKV.rows) holding pages ``ids``, in order."""
    if layout == "blocks_first":
        return ids
    rows = np.empty(2 * ids.size, np.int64)
    rows[0::2] = ids
    rows[1::2] = ids + num_blocks
    return rows


# --------------------------------------------------------------------------- the tensor


def _is_torch(obj: Any) -> bool:
    return hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous") and \
        hasattr(obj, "element_size")


class PagedKV:
    """A checked paged KV tensor: layout, page size, and a byte view of its memory.

    Parameters
    ----------
    kv : numpy.ndarray or torch.Tensor (CPU or CUDA)
        ``[2, num_blocks, *page]`` or ``[num_blocks, 2, *page]``, C-contiguous, any
        numeric dtype. Other objects with the buffer protocol are taken as numpy arrays.
    layout : {"auto", "kv_first", "blocks_first"}
    writable : bool
        The pages will be written (get); a read-only array is refused.

    Raises
    ------
    ValueError
        Bad shape or layout (see :func:`resolve_layout`), not contiguous, a tensor on a
        device other than CPU or CUDA, empty pages.
    TypeError
        Not an array or tensor, an object dtype, or read-only where ``writable``.
    """

    def __init__(self, kv: Any, layout: str = "auto", *, writable: bool = False) -> None:
        self.obj = kv
        if _is_torch(kv):
            dev = kv.device.type
            if dev not in ("cpu", "cuda"):
                raise ValueError(f"kv is on {kv.device}; CPU and CUDA tensors are taken")
            if not kv.is_contiguous():
                raise ValueError(
                    "kv must be contiguous: a paged KV tensor that was sliced, transposed "
                    "or permuted has pages scattered in memory; pass the cache tensor "
                    "itself (or .contiguous(), which copies)")
            self.device = dev
            shape = tuple(kv.shape)
            itemsize = kv.element_size()
            self.dtype = str(kv.dtype).replace("torch.", "")
            if dev == "cpu":
                t = kv.detach()
                flat = t.reshape(-1).view(__import__("torch").uint8)
                self.flat: np.ndarray | None = flat.numpy()
            else:
                self.flat = None
        else:
            if not isinstance(kv, np.ndarray):
                try:
                    kv = np.asarray(memoryview(kv))
                except TypeError:
                    raise TypeError("kv must be a numpy array or a torch tensor, got "
                                    f"{type(kv).__name__}") from None
            if kv.dtype.hasobject:
                raise TypeError("kv must have a numeric dtype, not object")
            if not kv.flags.c_contiguous:
                raise ValueError(
                    "kv must be C-contiguous: a paged KV array that was sliced or "
                    "transposed has pages scattered in memory; pass the cache array "
                    "itself (or np.ascontiguousarray(kv), which copies)")
            if writable and not kv.flags.writeable:
                raise TypeError("kv must be writable to receive pages, got a read-only "
                                "array")
            self.device = "cpu"
            shape = kv.shape
            itemsize = kv.dtype.itemsize
            self.dtype = str(kv.dtype)
            self.flat = kv.reshape(-1).view(np.uint8)
        self.shape = tuple(int(d) for d in shape)
        self.layout = resolve_layout(self.shape, layout)
        self.num_blocks = self.shape[1] if self.layout == "kv_first" else self.shape[0]
        self.half_bytes = math.prod(self.shape[2:]) * itemsize
        if self.half_bytes == 0:
            raise ValueError(f"kv of shape {self.shape} has empty pages")
        self.page_bytes = 2 * self.half_bytes

    def page_ids(self, page_ids: Any) -> np.ndarray:
        """``page_ids`` as an int64 array, each checked against ``num_blocks``.

        Raises
        ------
        IndexError
            An id < 0 or >= num_blocks.
        TypeError
            Not integers.
        """
        if _is_torch(page_ids):
            page_ids = page_ids.detach().cpu().numpy()
        ids = np.asarray(page_ids)
        if ids.size == 0:
            return np.zeros(0, np.int64)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"page_ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        bad = (ids < 0) | (ids >= self.num_blocks)
        if bad.any():
            j = int(np.argmax(bad))
            raise IndexError(f"page id {int(ids[j])} (position {j}) is out of range for "
                             f"a tensor of {self.num_blocks} pages")
        return ids

    # byte matrix: kv_first -> [2 * num_blocks, half] (K rows then V rows);
    # blocks_first -> [num_blocks, page]
    def _rows_np(self) -> np.ndarray:
        assert self.flat is not None
        if self.layout == "kv_first":
            return self.flat.reshape(2 * self.num_blocks, self.half_bytes)
        return self.flat.reshape(self.num_blocks, self.page_bytes)

    def _rows_torch(self) -> Any:
        import torch

        t = self.obj.detach().reshape(-1).view(torch.uint8)
        if self.layout == "kv_first":
            return t.view(2 * self.num_blocks, self.half_bytes)
        return t.view(self.num_blocks, self.page_bytes)

    def gather_pages(self, ids: np.ndarray) -> np.ndarray:
        """A new ``[len(ids), page_bytes]`` uint8 array: the pages as stored values."""
        rows = _page_rows(self.layout, self.num_blocks, ids)
        if self.flat is not None:
            out = np.take(self._rows_np(), rows, axis=0)
        else:   # CUDA: gather on the device, then one copy to host memory
            import torch

            idx = torch.from_numpy(rows).to(self.obj.device)
            out = self._rows_torch().index_select(0, idx).cpu().numpy()
        return out.reshape(ids.size, self.page_bytes)

    def scatter_pages(self, ids: np.ndarray, data: np.ndarray) -> None:
        """Write ``data`` (``[len(ids), page_bytes]`` uint8, stored values) into pages."""
        rows = _page_rows(self.layout, self.num_blocks, ids)
        row_bytes = self.half_bytes if self.layout == "kv_first" else self.page_bytes
        data = data.reshape(rows.size, row_bytes)
        if self.flat is not None:
            self._rows_np()[rows] = data
        else:
            import torch

            dev = self.obj.device
            self._rows_torch()[torch.from_numpy(rows).to(dev)] = \
                torch.from_numpy(np.ascontiguousarray(data)).to(dev)


# --------------------------------------------------------------------------- sources


class _PageSource:
    """Pages of a tensor as the values of a put (see ``_Session.op_put_batch``)."""

    def __init__(self, kv: PagedKV, ids: np.ndarray, keys: list[bytes]) -> None:
        self.kv = kv
        self.ids = ids
        self.keys = keys
        self.sizes = [kv.page_bytes] * ids.size
        self._bufs: list[memoryview] | None = None

    def buffers(self) -> list[memoryview]:
        # TCP, RDMA and checksums: the pages built in one buffer (one copy)
        if self._bufs is None:
            data = self.kv.gather_pages(self.ids)
            self._bufs = [memoryview(row) for row in data]
        return self._bufs

    def to_pool(self, mover: Any, offsets: list[int], idx: list[int]) -> None:
        if isinstance(mover, ShmMover):
            kv = self.kv
            po, sz, bo = page_pieces(kv.layout, kv.num_blocks, kv.half_bytes,
                                     self.ids[idx], offsets)
            if kv.flat is None:
                from kvshm import cuda

                with mover.copying() as pool:
                    cuda.copy_to_pool(pool, kv.obj, po, sz, bo)
            else:
                with mover.copying() as pool:
                    pool.scatter(kv.flat, po, sz, bo)
            return
        bufs = self.buffers()
        mover.write(offsets, [bufs[i] for i in idx], [self.keys[i] for i in idx])


class _PageSink:
    """Hits of a lookup placed into pages of a tensor (see ``_Session.op_lookup_copy``)."""

    def __init__(self, kv: PagedKV, ids: np.ndarray, keys: list[bytes]) -> None:
        self.kv = kv
        self.ids = ids
        self.keys = keys

    def _check(self, i: int, size: int) -> None:
        kv = self.kv
        if size != kv.page_bytes:
            raise ValueError(
                f"key {self.keys[i]!r} holds {size} bytes but a page of this tensor "
                f"(shape {kv.shape}, dtype {kv.dtype}) is {kv.page_bytes} bytes: stored "
                "with another dtype, block size or head layout?")

    def from_pool(self, mover: Any, offsets: list[int], sizes: list[int],
                  idx: list[int]) -> None:
        for i, s in zip(idx, sizes):
            self._check(i, s)
        kv = self.kv
        ids = self.ids[idx]
        if isinstance(mover, ShmMover):
            po, sz, bo = page_pieces(kv.layout, kv.num_blocks, kv.half_bytes, ids, offsets)
            if kv.flat is None:
                from kvshm import cuda

                with mover.copying() as pool:
                    cuda.copy_from_pool(pool, po, sz, kv.obj, bo)
            else:
                with mover.copying() as pool:
                    pool.gather(po, sz, kv.flat, bo)
            return
        tmp = np.empty((len(idx), kv.page_bytes), np.uint8)
        mover.read_into(offsets, sizes, list(tmp), [self.keys[i] for i in idx])
        kv.scatter_pages(ids, tmp)

    def from_frame(self, i: int, buf: Any) -> None:
        m = memoryview(buf).cast("B")
        self._check(i, m.nbytes)
        self.kv.scatter_pages(self.ids[i:i + 1], np.frombuffer(m, np.uint8))


# --------------------------------------------------------------------------- operations


def _prepare(session: Any, keys: Sequence[Any], kv: Any, page_ids: Any, layout: str,
             writable: bool) -> tuple[list[bytes], PagedKV, np.ndarray]:
    v = PagedKV(kv, layout, writable=writable)
    ids = v.page_ids(page_ids)
    bkeys = session.keys(keys)
    if len(bkeys) != ids.size:
        raise ValueError(f"{len(bkeys)} keys but {ids.size} page ids")
    return bkeys, v, ids


def op_put_pages(session: Any, keys: Sequence[Any], kv: Any, page_ids: Any,
                 layout: str = "auto", lazy: bool | None = None) -> Any:
    """The put of :func:`put_pages` as a session operation (a generator that a Client or
    an AsyncClient drives). ``lazy``: let COMMIT ride on the next request (default: the
    client's ``lazy_commit``)."""
    bkeys, v, ids = _prepare(session, keys, kv, page_ids, layout, False)
    if not bkeys:
        return None
    limit = session.limits.max_value_bytes or session.capacity
    if session.capacity and v.page_bytes > limit:
        raise ValueTooLarge(f"a page of {v.page_bytes} bytes exceeds the server's limit of "
                            f"{limit} bytes per value")
    return (yield from session.op_put_batch(bkeys, (), False,
                                            source=_PageSource(v, ids, bkeys), lazy=lazy))


def op_get_pages_into(session: Any, keys: Sequence[Any], kv: Any, page_ids: Any,
                      layout: str = "auto") -> Any:
    """The read of :func:`get_pages_into` as a session operation."""
    bkeys, v, ids = _prepare(session, keys, kv, page_ids, layout, True)
    if not bkeys:
        return []
    sizes, _ = yield from session.op_lookup_copy(bkeys, None, False,
                                                 sink=_PageSink(v, ids, bkeys))
    return [s >= 0 for s in sizes]


def put_pages(client: Any, keys: Sequence[Any], kv: Any, page_ids: Any, *,
              layout: str = "auto") -> Any:
    """Store pages ``page_ids`` of the paged KV tensor ``kv``, page ``page_ids[i]`` under
    ``keys[i]``.

    Each value is the page's K half followed by its V half
    (``2 * block_size * num_kv_heads * head_size * itemsize`` bytes for vLLM's layouts).
    With the shared-memory mover the pages go into the pool in one scatter call, the GIL
    released; over TCP or RDMA the page bytes are built first (one extra copy).

    Parameters
    ----------
    client : Client or AsyncClient
        With an AsyncClient this returns a coroutine (or use ``AsyncClient.put_pages``).
    keys : sequence of str or bytes
        One key per page.
    kv : numpy.ndarray or torch.Tensor
        ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (``"kv_first"``) or
        ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (``"blocks_first"``);
        any number of trailing dimensions >= 1; any numeric dtype (fp16, bf16, fp32,
        int8, fp8, ...); C-contiguous. A torch tensor may be on a CUDA device (then the
        copy is GPU -> pool, see :mod:`kvshm.cuda`).
    page_ids : sequence of int, int array or tensor
        Pages to store, ``0 <= id < num_blocks``.
    layout : {"auto", "kv_first", "blocks_first"}
        ``"auto"`` tells the layouts apart by which leading dimension is 2 (and raises
        when both are).

    Raises
    ------
    ValueError
        A shape that is not a paged layout (or is ambiguous), a non-contiguous tensor
        (a slice or a transpose of the cache: pass the cache itself), ``len(keys) !=
        len(page_ids)``.
    IndexError
        A page id outside ``[0, num_blocks)``.
    TypeError
        ``kv`` is not an array or tensor, or ``page_ids`` are not integers.
    ValueTooLarge, PoolFull, InvalidKey, ServerUnavailable
        As :meth:`Client.put_batch <kvshm.Client.put_batch>` (pages that could be placed
        are stored even when others fail).
    """
    return client.run_op(op_put_pages(client.session, keys, kv, page_ids, layout))


def get_pages_into(client: Any, keys: Sequence[Any], kv: Any, page_ids: Any, *,
                   layout: str = "auto") -> Any:
    """Fill pages ``page_ids`` of the paged KV tensor ``kv`` from ``keys``.

    The inverse of :func:`put_pages`: the value of ``keys[i]`` lands in page
    ``page_ids[i]`` (K half, V half). With the shared-memory mover all hits move in one
    gather call, the GIL released. A miss leaves its page untouched.

    Parameters
    ----------
    client, keys, page_ids, layout
        As :func:`put_pages`.
    kv : numpy.ndarray or torch.Tensor, writable
        As :func:`put_pages`. The layout may differ from the one the pages were stored
        from; the page size in bytes (shape of a page times itemsize) must match.

    Returns
    -------
    list of bool
        Whether each key was found (its page filled). With an AsyncClient, a coroutine
        that returns it.

    Raises
    ------
    ValueError
        As :func:`put_pages`; also a stored value whose size is not this tensor's page
        size (written with another dtype, block size or head layout). Pages of the keys
        before it may have been filled.
    IndexError
        A page id outside ``[0, num_blocks)``.
    TypeError
        As :func:`put_pages`, or a read-only array.
    """
    return client.run_op(op_get_pages_into(client.session, keys, kv, page_ids, layout))
