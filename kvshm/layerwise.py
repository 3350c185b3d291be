"""Layer-wise transfer: prefill stores layer i while layer i+1 computes; decode loads a
request's KV in the background and says when all of it is there.

Prefill side, :class:`LayerWriter`::

    with LayerWriter(client, keys_per_layer) as w:
        for i, layer in enumerate(model.layers):
            kv = layer(hidden)                  # compute layer i
            w.write(i, kv_cache[i], page_ids)   # hand it over; returns at once
    # leaving the block waits for every layer and raises the first error

Decode side, :func:`prefetch` / :func:`prefetch_pages`::

    h = prefetch_pages(client, keys, kv_cache[i], page_ids)
    h.add_done_callback(lambda h: scheduler.ready(request_id))   # or h.event, h.wait()
    ...
    h.result()    # raises here what went wrong in the loading thread

Threads: a LayerWriter owns one worker thread, so layers are stored in order, one at a
time, with the sync :class:`~kvshm.Client`. Prefetches run on a small shared pool of
threads (or an executor you pass). The copies release the GIL (``Pool`` memcpy), and so do
numpy/torch kernels, so the caller's compute and the transfers overlap; the control round
trips (ZeroMQ, a few tens of microseconds of Python each) are the only part that
competes for the GIL.

Buffers handed to :meth:`LayerWriter.write` are read in the background: do not modify
them until that layer's future (returned by ``write``) is done, or :meth:`LayerWriter.wait`
returned. Buffers given to a prefetch must not be read before the handle is done.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any, Callable, Sequence

from kvshm.errors import KeyNotFound, KvshmError

__all__ = ["LayerWriter", "PrefetchHandle", "prefetch", "prefetch_pages"]

log = logging.getLogger(__name__)


def _sync_client(client: Any, what: str) -> None:
    from kvshm.aio import AsyncClient

    if isinstance(client, AsyncClient):
        raise TypeError(f"{what} takes a sync kvshm.Client (it runs it in a thread); with "
                        "an AsyncClient, start the calls as tasks instead")


def _rows(data: Any, n: int) -> Sequence[Any]:
    """``data`` as ``n`` values: a sequence of buffers, or the rows of an array/tensor."""
    if isinstance(data, (list, tuple)):
        if len(data) != n:
            raise ValueError(f"{n} keys for this layer but {len(data)} values")
        return data
    shape = getattr(data, "shape", None)
    if shape is None or len(shape) < 1:
        raise TypeError("a layer's data must be a sequence of buffers, or an array / tensor "
                        f"with one row per key, got {type(data).__name__}")
    if shape[0] != n:
        raise ValueError(f"{n} keys for this layer but the data has {shape[0]} rows "
                         f"(shape {tuple(shape)})")
    dev = getattr(data, "device", None)
    if dev is not None and getattr(dev, "type", "cpu") != "cpu":
        raise ValueError(f"rows of a tensor on {dev} cannot be stored as values; pass "
                         "the layer's paged KV tensor with page_ids (put_pages)")
    contiguous = (data.is_contiguous() if hasattr(data, "is_contiguous")
                  else data.flags.c_contiguous)
    if not contiguous:
        raise ValueError("a layer's data must be contiguous (rows are stored without a "
                         "copy); call .contiguous() / np.ascontiguousarray first")
    return [data[i] for i in range(n)]


def _cuda_event(data: Any) -> Any:
    """A CUDA event recorded now on the caller's current stream, for a CUDA tensor.

    (Not yet run on a GPU, as kvshm.cuda.)
    """
    dev = getattr(data, "device", None)
    if dev is None or getattr(dev, "type", "cpu") != "cuda":
        return None
    import torch

    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev))
    return ev


class LayerWriter:
    """Store a batch's KV cache layer by layer while the next layer computes.

    Parameters
    ----------
    client : kvshm.Client
        A sync client; the writer uses it from its own worker thread (a Client may be
        shared by threads).
    keys_per_layer : sequence of sequences of keys
        ``keys_per_layer[i]`` are the keys of layer ``i``: one per page (with
        ``page_ids``) or one per value.
    layout : {"auto", "kv_first", "blocks_first"}
        Layout of paged tensors given to :meth:`write` (see :mod:`kvshm.paged`).
    lazy_commit : bool
        True (default): a layer's COMMIT rides on the next layer's ALLOC, and
        :meth:`wait` sends the last one: one round trip per layer instead of two. A
        layer is then visible to readers one layer later, and all of them once
        :meth:`wait` returned. False: each layer is committed (visible) before its
        future is done.

    Notes
    -----
    One worker thread stores the layers in the order they are handed over. :meth:`wait`
    (or leaving the ``with`` block) waits for all of them and raises the first error.
    """

    def __init__(self, client: Any, keys_per_layer: Sequence[Sequence[Any]], *,
                 layout: str = "auto", lazy_commit: bool = True) -> None:
        _sync_client(client, "LayerWriter")
        self.client = client
        self.keys_per_layer = [list(k) for k in keys_per_layer]
        self.layout = layout
        self.lazy_commit = lazy_commit
        self._futures: dict[int, concurrent.futures.Future[None]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvshm-layer-writer")
        self._closed = False

    @property
    def num_layers(self) -> int:
        return len(self.keys_per_layer)

    @property
    def missing(self) -> list[int]:
        """Layers not handed over yet."""
        return [i for i in range(self.num_layers) if i not in self._futures]

    def write(self, layer: int, data: Any, page_ids: Any = None) -> concurrent.futures.Future[None]:
        """Hand over layer ``layer`` and return at once; the store happens in the
        background.

        Parameters
        ----------
        layer : int
            ``0 <= layer < num_layers``; each layer once.
        data
            With ``page_ids``: the layer's paged KV tensor (numpy array or torch tensor,
            see :func:`kvshm.paged.put_pages`); the pages ``page_ids`` are stored under
            the layer's keys. Without: the layer's values, a sequence of buffers or an
            array / tensor with one row per key.
        page_ids : sequence of int, optional

        Returns
        -------
        concurrent.futures.Future
            Done when this layer is in the store (committed, or with ``lazy_commit`` its
            COMMIT queued); its ``result()`` raises what failed.

        Raises
        ------
        ValueError
            A layer out of range or handed over twice, a count of values or page ids
            that is not the layer's number of keys, a non-contiguous array, a bad paged
            shape (checked here, before handing over).
        IndexError
            A page id out of range.
        KvshmError
            The writer is closed.
        """
        if self._closed:
            raise KvshmError("LayerWriter is closed")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range: {self.num_layers} layers")
        if layer in self._futures:
            raise ValueError(f"layer {layer} was handed over already")
        keys = self.keys_per_layer[layer]
        fn: Callable[[], None]
        if page_ids is not None:
            from kvshm.paged import PagedKV

            v = PagedKV(data, self.layout)        # shape, contiguity: fail here, not later
            ids = v.page_ids(page_ids)
            if ids.size != len(keys):
                raise ValueError(f"layer {layer} has {len(keys)} keys but {ids.size} "
                                 "page ids")
            layout = v.layout
            ready = _cuda_event(data)

            def fn() -> None:
                if ready is not None:
                    # the kernels that wrote this layer ran on the caller's stream; this
                    # thread copies on its own: wait for them first
                    ready.synchronize()
                if self.lazy_commit:
                    from kvshm.paged import op_put_pages

                    self.client.run_op(op_put_pages(self.client.session, keys, data, ids,
                                                  layout, lazy=True))
                else:
                    self.client.put_pages(keys, data, ids, layout=layout)
        else:
            values = _rows(data, len(keys))

            def fn() -> None:
                if self.lazy_commit:
                    self.client.run_op(self.client.session.op_put_batch(
                        keys, values, False, lazy=True))
                else:
                    self.client.put_batch(keys, values)
        fut = self._executor.submit(fn)
        self._futures[layer] = fut
        return fut

    def wait(self, timeout: float | None = None, *, all_layers: bool = True) -> None:
        """Wait until every layer handed over is stored; raise the first error.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait in all.
        all_layers : bool
            Also require that every layer was handed over (default).

        Raises
        ------
        Exception
            The first failed layer's error (in layer order), after all writes ended.
        LeaseExpired
            With ``lazy_commit``: a layer's COMMIT came too late (nothing stored for it).
        TimeoutError
            Not all done within ``timeout``.
        ValueError
            ``all_layers`` and some layers were never handed over.
        """
        futs = [self._futures[i] for i in sorted(self._futures)]
        done, not_done = concurrent.futures.wait(futs, timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} of {len(futs)} layer writes not done "
                               f"within {timeout} s")
        first = next((f.exception() for f in futs if f.exception() is not None), None)
        if self.lazy_commit and any(f.exception() is None for f in futs):
            try:
                self.client.flush()        # the last layers' queued COMMIT
            except Exception:
                if first is None:
                    raise
        if first is not None:
            raise first
        if all_layers and self.missing:
            raise ValueError(f"layers {self.missing} were never written")

    def close(self) -> None:
        """Wait for writes in flight (their buffers are in use), stop the worker.
        Errors are not raised here (see :meth:`wait`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        if self.lazy_commit and any(f.exception() is None for f in self._futures.values()):
            try:
                self.client.flush()        # best effort: queued COMMITs go now
            except Exception as exc:
                log.debug("flush at LayerWriter.close failed: %s", exc)

    def __enter__(self) -> "LayerWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        try:
            if exc_type is None:
                self.wait()
        finally:
            self.close()

    def __repr__(self) -> str:
        done = sum(1 for f in self._futures.values() if f.done())
        return (f"<kvshm.LayerWriter {self.num_layers} layers, {len(self._futures)} "
                f"handed over, {done} done>")


# --------------------------------------------------------------------------- decode side

_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _default_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="kvshm-prefetch")
        return _pool


class PrefetchHandle:
    """A load running in a background thread; future-like.

    Attributes
    ----------
    event : threading.Event
        Set when the load ended (every block in, or an error).
    keys : list
        The keys loaded.
    future : concurrent.futures.Future
        The underlying future (``asyncio.wrap_future(h.future)`` to await it).
    """

    def __init__(self, future: concurrent.futures.Future[Any], keys: Sequence[Any]) -> None:
        self.future = future
        self.keys = list(keys)
        self.event = threading.Event()
        future.add_done_callback(lambda _f: self.event.set())

    def done(self) -> bool:
        """True once the load ended (successfully or not)."""
        return self.future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the load ended; True then, False if ``timeout`` s passed first.

        Raises the load's error (KeyNotFound for missing keys, ServerUnavailable, ...).
        """
        if not self.event.wait(timeout):
            return False
        self.future.result()
        return True

    def result(self, timeout: float | None = None) -> Any:
        """What the load returned (sizes, or found flags for pages); raises its error,
        or TimeoutError after ``timeout`` seconds."""
        return self.future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.future.exception(timeout)

    def add_done_callback(self, fn: Callable[["PrefetchHandle"], Any]) -> None:
        """Call ``fn(handle)`` when the load ends: in the loading thread, or at once if it
        has ended. Keep it short (tell the scheduler); an exception in it is logged."""
        self.future.add_done_callback(lambda _f: fn(self))

    def cancel(self) -> bool:
        """Cancel a load that has not started; False once it runs (it then completes)."""
        return self.future.cancel()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<kvshm.PrefetchHandle {len(self.keys)} keys {state}>"


def _missing(keys: Sequence[Any], found: Sequence[bool]) -> None:
    missing = [k for k, f in zip(keys, found) if not f]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        exc = KeyNotFound(f"prefetch: {len(missing)} of {len(keys)} keys not found: "
                          f"{missing[0]!r}{more}")
        exc.missing = missing  # type: ignore[attr-defined]
        raise exc


def prefetch(client: Any, keys: Sequence[Any], outs: Sequence[Any], *,
             allow_missing: bool = False,
             executor: concurrent.futures.Executor | None = None) -> PrefetchHandle:
    """Load ``keys`` into ``outs`` (caller-owned buffers) in a background thread.

    Parameters
    ----------
    client : kvshm.Client
    keys : sequence of keys
    outs : sequence of writable buffers / CPU tensors, one per key
    allow_missing : bool
        False (default): a missing key is an error (KeyNotFound with a ``missing``
        attribute, raised by ``wait``/``result``). True: the result has -1 for it.
    executor : concurrent.futures.Executor, optional
        Where the load runs; default a shared pool of 4 threads.

    Returns
    -------
    PrefetchHandle
        ``result()`` is the list of sizes in bytes (as ``Client.get_batch_into``).
    """
    _sync_client(client, "prefetch")
    keys = list(keys)
    outs = list(outs)
    if len(outs) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")

    def load() -> list[int]:
        sizes: list[int] = client.get_batch_into(keys, outs)
        if not allow_missing:
            _missing(keys, [s >= 0 for s in sizes])
        return sizes

    return PrefetchHandle((executor or _default_executor()).submit(load), keys)


def prefetch_pages(client: Any, keys: Sequence[Any], kv: Any, page_ids: Any, *,
                   layout: str = "auto", allow_missing: bool = False,
                   executor: concurrent.futures.Executor | None = None) -> PrefetchHandle:
    """Load pages into a paged KV tensor in a background thread (see
    :func:`kvshm.paged.get_pages_into` for ``kv``, ``page_ids`` and ``layout``).

    The shape, layout and page ids are checked here (ValueError / IndexError at once);
    transfer errors and missing keys come from ``wait``/``result``, whose value is the
    list of found flags.
    """
    _sync_client(client, "prefetch_pages")
    from kvshm.paged import PagedKV

    keys = list(keys)
    v = PagedKV(kv, layout, writable=True)
    ids = v.page_ids(page_ids)
    if ids.size != len(keys):
        raise ValueError(f"{len(keys)} keys but {ids.size} page ids")
    lay = v.layout

    def load() -> list[bool]:
        found: list[bool] = client.get_pages_into(keys, kv, ids, layout=lay)
        if not allow_missing:
            _missing(keys, found)
        return found

    return PrefetchHandle((executor or _default_executor()).submit(load), keys)
