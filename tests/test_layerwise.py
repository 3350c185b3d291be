"""Layer-wise prefill (LayerWriter) and background decode loads (prefetch) (issue 5)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvshm import AsyncClient, Client, KeyNotFound, ServerUnavailable
from kvshm.layerwise import LayerWriter, PrefetchHandle, prefetch, prefetch_pages
from servers import ServerProcess

LAYERS, PAGES = 8, 12
SHAPE = (2, 32, 16, 4, 32)          # kv_first, 32 pages of 16 tokens, 4 heads x 32


@pytest.fixture(scope="module")
def server():
    with ServerProcess(prealloc_size=0.125) as s:
        yield s


@pytest.fixture
def client(server):
    with Client(server.address, timeout=10) as c:
        c.purge()
        yield c
        st = c.stats(verify=True)
        assert st["pinned"] == 0 and st["pending"] == 0 and st["accounting_ok"]


def layer_keys(req="r0"):
    return [[f"{req}/L{layer}/p{j}" for j in range(PAGES)] for layer in range(LAYERS)]


def caches(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(LAYERS)]


class FakeClient:
    """Records put_batch calls; can block or fail a given layer (use the writer with
    lazy_commit=False: it then calls the public methods)."""

    def __init__(self, fail_layer=None, gate=None):
        self.calls = []
        self.fail_layer = fail_layer
        self.gate = gate

    def put_batch(self, keys, values):
        if self.gate is not None:
            assert self.gate.wait(10)
        layer = int(keys[0].split("/L")[1].split("/")[0])
        self.calls.append(layer)
        if layer == self.fail_layer:
            raise ServerUnavailable(f"layer {layer} failed")


# ----------------------------------------------------------------------------- LayerWriter


def test_layer_writer_pages_round_trip(client):
    kvs = caches(1)
    page_ids = list(range(3, 3 + PAGES))
    keys = layer_keys()
    with LayerWriter(client, keys) as w:
        for layer in range(LAYERS):
            fut = w.write(layer, kvs[layer], page_ids)
            assert fut is not None
    assert w.missing == []
    for layer in range(LAYERS):
        out = np.zeros(SHAPE, np.float16)
        assert client.get_pages_into(keys[layer], out, page_ids) == [True] * PAGES
        assert np.array_equal(out[:, page_ids], kvs[layer][:, page_ids])


@pytest.mark.parametrize("lazy", [True, False])
def test_layer_visibility(server, client, lazy):
    keys = layer_keys(f"vis{lazy}")
    with Client(server.address) as reader:
        w = LayerWriter(client, keys, lazy_commit=lazy)
        w.write(0, [b"a"] * PAGES).result(10)
        # eager: committed when the future is done; lazy: one layer later (or at wait)
        assert reader.exists_batch(keys[0]) == [not lazy] * PAGES
        for layer in range(1, LAYERS):
            w.write(layer, [b"a"] * PAGES).result(10)
        assert all(reader.exists_batch(keys[0]))
        w.wait()
        assert all(all(reader.exists_batch(k)) for k in keys)
        w.close()


def test_layer_writer_rows_and_lists(client):
    keys = layer_keys("rows")
    data = [np.full((PAGES, 1000), layer, np.uint8) for layer in range(LAYERS)]
    w = LayerWriter(client, keys)
    for layer in range(LAYERS):
        arg = data[layer] if layer % 2 else [bytes(r) for r in data[layer]]
        w.write(layer, arg)
    w.wait()
    w.close()
    assert client.get(keys[5][3]) == bytes([5]) * 1000
    assert client.get(keys[4][0]) == bytes([4]) * 1000


def test_write_returns_at_once():
    gate = threading.Event()
    fake = FakeClient(gate=gate)
    w = LayerWriter(fake, layer_keys(), lazy_commit=False)
    t0 = time.monotonic()
    for layer in range(LAYERS):
        w.write(layer, [b"x"] * PAGES)
    assert time.monotonic() - t0 < 0.5 and fake.calls == []   # nothing stored yet
    gate.set()
    w.wait(timeout=10)
    assert fake.calls == list(range(LAYERS))                  # in order, one worker
    w.close()


def test_wait_raises_the_first_error_after_all_writes():
    fake = FakeClient(fail_layer=2)
    w = LayerWriter(fake, layer_keys(), lazy_commit=False)
    for layer in range(LAYERS):
        w.write(layer, [b"x"] * PAGES)
    with pytest.raises(ServerUnavailable, match="layer 2 failed"):
        w.wait()
    assert fake.calls == list(range(LAYERS))
    w.close()
    with pytest.raises(Exception, match="closed"):
        w.write(0, [b"x"] * PAGES)


def test_context_manager_keeps_the_body_error():
    fake = FakeClient(fail_layer=0)
    with pytest.raises(RuntimeError, match="compute failed"):
        with LayerWriter(fake, layer_keys(), lazy_commit=False) as w:
            w.write(0, [b"x"] * PAGES)
            raise RuntimeError("compute failed")
    assert fake.calls == [0]      # the write in flight ended before the block was left


def test_writer_argument_errors(client):
    w = LayerWriter(client, layer_keys())
    with pytest.raises(ValueError, match="out of range"):
        w.write(LAYERS, [b"x"] * PAGES)
    with pytest.raises(ValueError, match="12 keys for this layer but 3 values"):
        w.write(0, [b"x"] * 3)
    with pytest.raises(ValueError, match="12 keys but 2 page ids"):
        w.write(0, caches()[0], [0, 1])
    with pytest.raises(IndexError):
        w.write(0, caches()[0], list(range(30, 30 + PAGES)))
    with pytest.raises(ValueError, match="contiguous"):
        w.write(0, caches()[0][:, ::2], list(range(PAGES)))
    w.write(0, [b"x"] * PAGES)
    with pytest.raises(ValueError, match="already"):
        w.write(0, [b"x"] * PAGES)
    with pytest.raises(ValueError, match="never written"):
        w.wait()
    w.wait(all_layers=False)
    w.close()


def test_async_client_is_refused(server):
    c = AsyncClient(server.address)
    try:
        with pytest.raises(TypeError, match="sync"):
            LayerWriter(c, layer_keys())
        with pytest.raises(TypeError, match="sync"):
            prefetch(c, ["a"], [bytearray(1)])
    finally:
        c._close_now()


# ----------------------------------------------------------------------------- prefetch


def test_prefetch_event_callback_result(client):
    keys = [f"pf{i}" for i in range(16)]
    vals = [np.full(50_000, i, np.uint8) for i in range(16)]
    client.put_batch(keys, vals)
    outs = [np.zeros(50_000, np.uint8) for _ in keys]
    seen = []
    done = threading.Event()
    h = prefetch(client, keys, outs)
    h.add_done_callback(lambda handle: (seen.append(handle), done.set()))
    assert isinstance(h, PrefetchHandle)
    assert h.event.wait(10) and done.wait(10)
    assert h.done() and h.wait(0) and seen == [h]
    assert h.result() == [50_000] * 16
    assert all(np.array_equal(o, v) for o, v in zip(outs, vals))
    late = []
    h.add_done_callback(late.append)             # already done: called at once
    assert late == [h]


def test_prefetch_missing_key_raises_on_the_waiting_side(client):
    client.put("have", b"h" * 10)
    h = prefetch(client, ["have", "lost"], [bytearray(10), bytearray(10)])
    with pytest.raises(KeyNotFound, match="1 of 2 keys not found: 'lost'") as ei:
        h.wait(10)
    assert ei.value.missing == ["lost"]
    with pytest.raises(KeyNotFound):
        h.result()
    h2 = prefetch(client, ["have", "lost"], [bytearray(10), bytearray(10)],
                  allow_missing=True)
    assert h2.result(10) == [10, -1]


def test_prefetch_error_is_not_lost():
    class Broken:
        def get_batch_into(self, keys, outs):
            raise ServerUnavailable("no reply from kvshm server at x within 1 s")

    h = prefetch(Broken(), ["a"], [bytearray(1)])
    assert h.event.wait(10)
    with pytest.raises(ServerUnavailable, match="no reply"):
        h.wait()
    assert isinstance(h.exception(), ServerUnavailable)


def test_prefetch_pages(client):
    kv = caches(3)[0]
    ids = [0, 5, 31]
    keys = [f"pp{p}" for p in ids]
    client.put_pages(keys, kv, ids)
    out = np.zeros_like(kv)
    h = prefetch_pages(client, keys, out, [2, 3, 4])
    assert h.wait(10) and h.result() == [True] * 3
    assert np.array_equal(out[:, [2, 3, 4]], kv[:, ids])
    with pytest.raises(IndexError):
        prefetch_pages(client, keys, out, [0, 1, 99])
    h = prefetch_pages(client, ["pp0", "nope"], out, [0, 1])
    with pytest.raises(KeyNotFound):
        h.result(10)
