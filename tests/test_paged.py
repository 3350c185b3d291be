"""Paged KV tensors: put_pages / get_pages_into round trips, layouts, dtypes, errors;
the CUDA path's absent-CUDA behaviour and its pure offset functions (issue 5)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvshm
from kvshm import AsyncClient, Client, cuda
from kvshm.paged import PagedKV, page_pieces, resolve_layout
from servers import ServerProcess

BLOCK, HEADS, HEAD = 16, 4, 32      # a small vLLM-like page: [16 tokens, 4 heads, 32]
N = 24                              # pages per tensor


@pytest.fixture(scope="module")
def server():
    with ServerProcess(prealloc_size=0.125) as s:
        yield s


@pytest.fixture(params=["shm", "tcp"])
def client(server, request):
    with Client(server.address, transport=request.param, timeout=10) as c:
        c.purge()
        yield c
        st = c.stats(verify=True)
        assert st["pinned"] == 0 and st["pending"] == 0 and st["accounting_ok"]


def shape_of(layout, n=N):
    return (2, n, BLOCK, HEADS, HEAD) if layout == "kv_first" else (n, 2, BLOCK, HEADS, HEAD)


def np_kv(layout, dtype, seed=0, n=N):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape_of(layout, n)) * 50
    return a.astype(dtype)


def page(kv, layout, p):
    """Page p as [2, ...] (K, V) of a numpy array or tensor."""
    return kv[:, p] if layout == "kv_first" else kv[p]


LAYOUTS = ["kv_first", "blocks_first"]
NP_DTYPES = [np.float16, np.float32, np.int8]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: d.__name__)
def test_numpy_round_trip(client, layout, dtype):
    kv = np_kv(layout, dtype, seed=1)
    ids = [5, 0, 23, 11, 12, 13]
    keys = [f"np-{layout}-{dtype.__name__}-{p}" for p in ids]
    client.put_pages(keys, kv, ids)
    out = np.zeros_like(kv)
    assert client.get_pages_into(keys, out, ids) == [True] * len(ids)
    for p in range(N):
        want = page(kv, layout, p) if p in ids else 0
        got = page(out, layout, p)
        assert np.array_equal(got, np.broadcast_to(want, got.shape))
    # the stored value is K then V of the page, whatever the layout
    assert client.get(keys[0]) == np.ascontiguousarray(page(kv, layout, 5)).tobytes()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_torch_round_trip(client, layout, dtype):
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(2)
    kv = (torch.randn(shape_of(layout), generator=g) * 50).to(dt)
    ids = torch.tensor([3, 4, 17, 9])
    keys = [f"t-{layout}-{dtype}-{p}" for p in ids.tolist()]
    client.put_pages(keys, kv, ids)
    out = torch.zeros_like(kv)
    assert client.get_pages_into(keys, out, ids.tolist()) == [True] * 4
    for p in range(N):
        want = page(kv, layout, p) if p in ids.tolist() else torch.zeros_like(page(kv, layout, p))
        assert torch.equal(page(out, layout, p), want)


@pytest.mark.parametrize("src_layout", LAYOUTS)
def test_read_into_the_other_layout(client, src_layout):
    dst_layout = "blocks_first" if src_layout == "kv_first" else "kv_first"
    kv = np_kv(src_layout, np.float16, seed=3)
    ids = [1, 2, 20]
    keys = [f"x-{src_layout}-{p}" for p in ids]
    client.put_pages(keys, kv, ids)
    out = np.zeros(shape_of(dst_layout, 8), np.float16)
    assert client.get_pages_into(keys, out, [7, 0, 3]) == [True] * 3
    for p_src, p_dst in zip(ids, [7, 0, 3]):
        assert np.array_equal(page(out, dst_layout, p_dst), page(kv, src_layout, p_src))


def test_misses_leave_pages_untouched(client):
    kv = np_kv("kv_first", np.float32, seed=4)
    client.put_pages(["m-a", "m-b"], kv, [1, 2])
    out = np.full_like(kv, 7)
    assert client.get_pages_into(["m-a", "missing", "m-b"], out, [1, 5, 2]) == \
        [True, False, True]
    assert (page(out, "kv_first", 5) == 7).all()
    assert np.array_equal(page(out, "kv_first", 2), page(kv, "kv_first", 2))


def test_one_scatter_and_one_gather_call(server):
    """With the shm mover the selected pages move with one Pool.scatter / gather."""
    with Client(server.address, transport="shm") as c:
        mover = c._session.mover
        calls = []

        class Counting:
            def __init__(self, pool):
                self._pool = pool

            def __getattr__(self, name):
                attr = getattr(self._pool, name)
                if name in ("scatter", "gather", "write_many", "read_many_into"):
                    def counted(*a, **kw):
                        calls.append(name)
                        return attr(*a, **kw)
                    return counted
                return attr

        real = mover.pool
        mover.pool = Counting(real)
        try:
            kv = np_kv("kv_first", np.float16, seed=5)
            ids = list(range(0, N, 2))
            keys = [f"one-{p}" for p in ids]
            c.put_pages(keys, kv, ids)
            out = np.zeros_like(kv)
            c.get_pages_into(keys, out, ids)
        finally:
            mover.pool = real
        assert calls == ["scatter", "gather"]
        assert np.array_equal(out[:, ids], kv[:, ids])


def test_async_client_pages(server):
    async def main():
        async with AsyncClient(server.address, copy_threshold=0) as c:
            for layout in LAYOUTS:
                kv = np_kv(layout, np.float16, seed=6)
                ids = list(range(N))
                keys = [f"a-{layout}-{p}" for p in ids]
                await c.put_pages(keys, kv, ids)
                out = np.zeros_like(kv)
                assert await kvshm.paged.get_pages_into(c, keys, out, ids) == [True] * N
                assert np.array_equal(out, kv)
            assert (await c.stats())["pinned"] == 0

    asyncio.run(main())


# ----------------------------------------------------------------------------- errors


def test_non_contiguous_input_is_refused(client):
    kv = np_kv("kv_first", np.float16)
    with pytest.raises(ValueError, match="contiguous"):
        client.put_pages(["nc"], kv[:, ::2], [0])
    with pytest.raises(ValueError, match="contiguous"):
        client.put_pages(["nc"], np.swapaxes(kv, 0, 1), [0], layout="blocks_first")
    torch = pytest.importorskip("torch")
    t = torch.zeros(shape_of("blocks_first")).transpose(0, 1)   # [2, N, ...], not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        client.get_pages_into(["nc"], t, [0])


@pytest.mark.parametrize("bad", [N, 100, -1])
def test_page_ids_out_of_range(client, bad):
    kv = np_kv("blocks_first", np.float16)
    with pytest.raises(IndexError, match="out of range"):
        client.put_pages(["a", "b"], kv, [0, bad])
    with pytest.raises(IndexError, match="out of range"):
        client.get_pages_into(["a", "b"], kv, [bad, 0])


def test_argument_errors(client):
    kv = np_kv("kv_first", np.float16)
    with pytest.raises(ValueError, match="2 keys but 1 page ids"):
        client.put_pages(["a", "b"], kv, [0])
    with pytest.raises(TypeError, match="integers"):
        client.put_pages(["a"], kv, [0.5])
    with pytest.raises(ValueError, match="at least 3 dimensions"):
        client.put_pages(["a"], np.zeros((2, 4), np.float16), [0])
    with pytest.raises(ValueError, match="neither"):
        client.put_pages(["a"], np.zeros((3, 4, 5), np.float16), [0])
    with pytest.raises(ValueError, match="layout must be"):
        client.put_pages(["a"], kv, [0], layout="rows")
    with pytest.raises(TypeError, match="numpy array or a torch tensor"):
        client.put_pages(["a"], 42, [0])
    ro = np_kv("kv_first", np.float16)
    ro.setflags(write=False)
    with pytest.raises(TypeError, match="writable"):
        client.get_pages_into(["a"], ro, [0])


def test_ambiguous_shape_needs_a_layout(client):
    kv = np.arange(2 * 2 * 8, dtype=np.float32).reshape(2, 2, 8)
    with pytest.raises(ValueError, match="both"):
        client.put_pages(["amb"], kv, [1])
    client.put_pages(["amb"], kv, [1], layout="blocks_first")
    out = np.zeros_like(kv)
    assert client.get_pages_into(["amb"], out, [1], layout="blocks_first") == [True]
    assert np.array_equal(out[1], kv[1]) and not out[0].any()


def test_dtype_mismatch_on_get(client):
    kv16 = np_kv("kv_first", np.float16, seed=8)
    client.put_pages(["d0", "d1"], kv16, [0, 1])
    out32 = np.zeros(shape_of("kv_first"), np.float32)
    with pytest.raises(ValueError,
                       match=r"holds 8192 bytes but a page of this tensor .* is 16384 bytes"):
        client.get_pages_into(["d0", "d1"], out32, [0, 1])
    assert not out32.any()
    # the pins of the failed read are released (checked by the fixture too)
    assert client.stats()["pinned"] == 0


def test_resolve_layout():
    assert resolve_layout((2, 10, 16, 8, 128)) == "kv_first"
    assert resolve_layout((10, 2, 16, 8, 128)) == "blocks_first"
    with pytest.raises(ValueError):
        resolve_layout((2, 2, 16), "auto")
    with pytest.raises(ValueError, match="needs shape"):
        resolve_layout((10, 2, 16), "kv_first")
    v = PagedKV(np.zeros((2, 10, 16, 8, 128), np.float16))
    assert (v.num_blocks, v.half_bytes, v.page_bytes) == (10, 16 * 8 * 128 * 2, 65536)


# ----------------------------------------------------------------------------- pure functions


def test_page_pieces_kv_first():
    po, sz, bo = page_pieces("kv_first", 10, 100, [3, 0], [1000, 5000])
    assert po.tolist() == [1000, 1100, 5000, 5100]            # K at offset, V at + half
    assert sz.tolist() == [100] * 4
    assert bo.tolist() == [300, 1300, 0, 1000]                # K row p, V row 10 + p
    assert po.dtype == sz.dtype == bo.dtype == np.int64


def test_page_pieces_blocks_first():
    po, sz, bo = page_pieces("blocks_first", 10, 100, [3, 0], [1000, 5000])
    assert po.tolist() == [1000, 5000] and sz.tolist() == [200, 200]
    assert bo.tolist() == [600, 0]
    with pytest.raises(ValueError):
        page_pieces("blocks_first", 10, 100, [1, 2], [0])


def test_pieces_match_a_numpy_reference():
    """The pieces copy exactly what fancy indexing selects."""
    rng = np.random.default_rng(9)
    for layout in LAYOUTS:
        kv = rng.integers(0, 255, shape_of(layout, 6), dtype=np.uint8)
        v = PagedKV(kv)
        ids = [4, 1, 5]
        offsets = [i * v.page_bytes for i in range(3)]
        pool = np.zeros(3 * v.page_bytes, np.uint8)
        flat = kv.reshape(-1)
        for o, s, b in zip(*page_pieces(layout, v.num_blocks, v.half_bytes, ids, offsets)):
            pool[o:o + s] = flat[b:b + s]
        want = np.concatenate([np.ascontiguousarray(page(kv, layout, p)).reshape(-1)
                               for p in ids])
        assert np.array_equal(pool, want)


def test_coalesce():
    po, sz, bo = cuda.coalesce([0, 100, 300, 400], [100, 100, 100, 50], [0, 100, 200, 300])
    assert po.tolist() == [0, 300] and sz.tolist() == [200, 150] and bo.tolist() == [0, 200]
    po, sz, bo = cuda.coalesce([], [], [])
    assert po.size == 0
    po, sz, bo = cuda.coalesce([0, 100], [100, 100], [100, 0])     # buffer not in order
    assert po.tolist() == [0, 100]


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(cuda.available(), reason="checks the behaviour without CUDA")
def test_cuda_absent_is_a_clear_error(server):
    assert cuda.available() is False
    with Client(server.address, transport="shm") as c:
        pool = c._session.mover.pool
        with pytest.raises(cuda.CudaUnavailable, match="CUDA is not available"):
            cuda.register_pool(pool)
        with pytest.raises(cuda.CudaUnavailable):
            cuda.copy_to_pool(pool, object(), [0], [1], [0])
        with pytest.raises(cuda.CudaUnavailable):
            cuda.copy_from_pool(pool, [0], [1], object(), [0])
        cuda.unregister_pool(pool)                  # not registered: a no-op
    assert issubclass(cuda.CudaUnavailable, kvshm.KvshmError)


def test_meta_device_tensor_is_refused(client):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="CPU and CUDA"):
        client.put_pages(["m"], torch.empty(shape_of("kv_first"), device="meta"), [0])
