"""Two switches of a same-host client's put_batch, each compared on and off.
``PACKED_PUT`` (on by default, ``KVSHM_PACKED_PUT=0``): ALLOC + COMMIT with the values
packed and copied in C (no memoryview per value). Inline small puts (kvshm.client ``INLINE_PUT``, off by default,
``KVSHM_INLINE_PUT=1`` turns it on): a shm ``put_batch`` of small values goes as one
PUT carrying them (as over TCP) instead of ALLOC + copy + COMMIT. The same batches put
with the switch on and off store the same bytes and raise the same errors with the same
failed keys and statuses (but for the principal's pending held by other clients, which
the module docstring names); the paths taken are told apart by the server's ``commits``
counter (one per COMMITted ALLOC; a PUT makes none)."""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import pytest
from servers import ServerProcess

import kvshm
from kvshm import client as client_mod


def _values(n: int, seed: int) -> list[Any]:
    """``n`` values of 0..INLINE_PUT_MAX bytes, of the buffer kinds put_batch takes."""
    rnd = random.Random(seed)
    out: list[Any] = []
    for i in range(n):
        b = rnd.randbytes(rnd.randint(0, client_mod.INLINE_PUT_MAX))
        kind = i % 4
        out.append(b if kind == 0 else bytearray(b) if kind == 1 else
                   memoryview(b) if kind == 2 else np.frombuffer(b, dtype=np.uint8))
    return out


def _outcome(fn: Callable[[], Any]) -> tuple[str, str, dict[bytes, Any] | None]:
    try:
        fn()
    except Exception as exc:    # noqa: BLE001 - the class, message and failed keys
        return type(exc).__name__, str(exc), getattr(exc, "failed", None)
    return "ok", "", None


@pytest.fixture(params=["INLINE_PUT", "PACKED_PUT"])
def switch(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


def _commits(switch: str, off: int, on: int, alloc: int, inline: int) -> None:
    """The COMMITs made: ``alloc`` both ways for PACKED_PUT (ALLOC either way); for
    INLINE_PUT ``alloc`` off and ``inline`` on."""
    assert (off, on) == ((alloc, inline) if switch == "INLINE_PUT" else (alloc, alloc))


def _both(monkeypatch: pytest.MonkeyPatch, c: kvshm.Client,
          run: Callable[[str], Any], switch: str = "INLINE_PUT"
          ) -> tuple[tuple[Any, int], tuple[Any, int]]:
    """``run(tag)`` with ``switch`` off then on (the other one off for INLINE_PUT, on
    for PACKED_PUT: what each is measured against): (its result, COMMITs made) each."""
    got = []
    for on in (False, True):
        monkeypatch.setattr(client_mod, "INLINE_PUT", on and switch == "INLINE_PUT")
        monkeypatch.setattr(client_mod, "PACKED_PUT", on or switch == "INLINE_PUT")
        before = c.stats()["commits"]
        r = run("on" if on else "off")
        got.append((r, c.stats()["commits"] - before))
    return got[0], got[1]


def test_same_bytes_both_ways(switch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    vals = _values(3000, 1)
    expect = [bytes(v) for v in vals]
    with ServerProcess("--block-size", "4", prealloc_size=1 / 16) as srv, \
            kvshm.Client(srv.address, transport="shm") as c:
        def run(tag: str) -> Any:
            keys = [f"{tag}-{i}" for i in range(len(vals))]
            c.put_batch(keys, vals)
            first = c.get_batch(keys)
            own = c.get(keys[5])                 # own write, read at once
            c.put_batch(keys, list(reversed(vals)))      # overwrite
            return first, own, c.get_batch(keys), c.exists_batch(keys)
        (off, off_commits), (on, on_commits) = _both(monkeypatch, c, run, switch)
        assert off == on
        assert off[0] == expect and off[1] == expect[5]
        assert off[2] == expect[::-1] and all(off[3])
        _commits(switch, off_commits, on_commits, 2, 0)   # ALLOC/COMMIT vs inline PUT
        assert c.stats(verify=True)["accounting_ok"]


def test_large_value_goes_the_alloc_way(switch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    big = b"B" * (client_mod.INLINE_PUT_MAX + 1)
    with ServerProcess("--block-size", "4", prealloc_size=1 / 16) as srv, \
            kvshm.Client(srv.address, transport="shm") as c:
        def run(tag: str) -> Any:
            keys = [f"{tag}-{i}" for i in range(4)]
            c.put_batch(keys, [b"a", big, b"c", bytearray(b"d")])   # a large one inside
            c.put_batch(keys[:1], [big])                            # a large first one
            return c.get_batch(keys)
        (off, off_commits), (on, on_commits) = _both(monkeypatch, c, run, switch)
        assert off == on == [big, big, b"c", b"d"]
        _commits(switch, off_commits, on_commits, 2, 2)


def test_client_errors_same(switch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 MiB pool: a 2 MiB value is over its capacity (ValueTooLarge, nothing stored);
    # a value that is no buffer: byte_view's TypeError; key and value counts differ
    with ServerProcess("--block-size", "4", prealloc_size=1 / 1024) as srv, \
            kvshm.Client(srv.address, transport="shm") as c:
        def run(tag: str) -> Any:
            keys = [f"{tag}-{i}" for i in range(6)]
            out = [_outcome(lambda: c.put_batch(keys, [b"a"] * 5 + [b"x" * (2 << 20)])),
                   _outcome(lambda: c.put_batch(keys, [b"a"] * 3 + [17] + [b"b"] * 2)),
                   _outcome(lambda: c.put_batch(keys, [b"a"] * 5)),
                   c.exists_batch(keys)]
            return [(o[0], o[1].replace(tag, "T"), o[2]) if isinstance(o, tuple) else o
                    for o in out]
        (off, _), (on, _) = _both(monkeypatch, c, run, switch)
        assert off == on
        assert [o[0] for o in off[:3]] == ["ValueTooLarge", "TypeError", "ValueError"]
        assert off[3] == [False] * 6


def test_pool_full_same_keys(switch: str, monkeypatch: pytest.MonkeyPatch,
                             no_local_reads: None) -> None:
    # 1 MiB pool of 4 KiB blocks (256); a holder pins 180 blocks of values (its pin
    # quota: 3/4 of the pool), so a batch of 100 small values (one block each) finds
    # room for 76: the same 24 keys fail
    bs = 4096
    with ServerProcess("--block-size", "4", prealloc_size=1 / 1024) as srv, \
            kvshm.Client(srv.address, transport="shm") as c, \
            kvshm.Client(srv.address, transport="shm") as holder:
        held = [f"held-{i}" for i in range(180)]
        c.put_batch(held, [bytes([i % 251]) * bs for i in range(180)])

        def run(tag: str) -> Any:
            keys = [f"{tag}-{i}" for i in range(100)]
            assert all(v is not None for v in holder.get_batch(held))     # pins them
            o = _outcome(lambda: c.put_batch(keys, [b"v" * 64] * 100))
            holder.flush()                                          # the pins go
            stored = c.exists_batch(keys)
            failed = {k.decode().split("-", 1)[1]: s for k, s in (o[2] or {}).items()}
            c.delete(keys)
            return o[0], failed, stored
        (off, off_commits), (on, on_commits) = _both(monkeypatch, c, run, switch)
        assert off == on
        assert off[0] == "PoolFull" and len(off[1]) == 24 and sum(off[2]) == 76
        _commits(switch, off_commits, on_commits, 1, 0)
        assert c.stats(verify=True)["accounting_ok"]


def test_quota_same_keys(switch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a pending limit of 16 blocks: a batch of 40 one-block values is more than ALLOC
    # grants (QuotaExceeded for 24 keys), and goes the ALLOC way either way (a PUT
    # would have stored all 40); one of 10 fits and goes inline when on
    with ServerProcess("--block-size", "4", "--max-client-pending", str(16 * 4096),
                       prealloc_size=1 / 64) as srv, \
            kvshm.Client(srv.address, transport="shm") as c:
        def run(tag: str) -> Any:
            big = [f"{tag}-b{i}" for i in range(40)]
            small = [f"{tag}-s{i}" for i in range(10)]
            o = _outcome(lambda: c.put_batch(big, [b"q" * 100] * 40))
            c.put_batch(small, [b"s" * 100] * 10)
            failed = sorted(k.decode().split("-", 1)[1] for k in (o[2] or {}))
            return o[0], failed, sum(c.exists_batch(big)), c.get_batch(small)
        (off, off_commits), (on, on_commits) = _both(monkeypatch, c, run, switch)
        assert off == on
        assert off[0] == "QuotaExceeded" and len(off[1]) == 24 and off[2] == 16
        _commits(switch, off_commits, on_commits, 2, 1)


def test_lazy_commit_and_old_server_stay_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_mod, "INLINE_PUT", True)
    with ServerProcess("--block-size", "4", prealloc_size=1 / 64) as srv, \
            kvshm.Client(srv.address, transport="shm", lazy_commit=True) as lazy, \
            kvshm.Client(srv.address, transport="shm") as c:
        lazy.put_batch(["l0", "l1"], [b"a", b"b"])
        lazy.flush()
        assert lazy.stats()["commits"] == 1
        assert lazy.get_batch(["l0", "l1"]) == [b"a", b"b"]
        c.put("warm", b"w")                     # HELLO done
        c._session.hello.pop("pending_limit")   # a server that does not announce it
        c.put_batch(["o0", "o1"], [b"c", b"d"])
        assert c.stats()["commits"] == 2
        assert c.get_batch(["o0", "o1"]) == [b"c", b"d"]


def test_packed_path_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """PACKED_PUT on: the shm put_batch's source is a _Packed (refused keys skipped);
    off: the views of _Buffers."""
    seen: list[str] = []
    for cls in (client_mod._Packed, client_mod._Buffers):
        orig = cls.to_pool
        monkeypatch.setattr(cls, "to_pool", lambda self, *a, _o=orig, _n=cls.__name__:
                            (seen.append(_n), _o(self, *a))[1])
    with ServerProcess("--block-size", "4", prealloc_size=1 / 64) as srv, \
            kvshm.Client(srv.address, transport="shm") as c:
        for on in (True, False):
            monkeypatch.setattr(client_mod, "PACKED_PUT", on)
            c.put_batch([b"p0", b"p1", b"p2"], [b"a" * 10, bytearray(b"b" * 5000), b""])
        assert seen == ["_Packed", "_Buffers"]
        assert c.get_batch([b"p0", b"p1", b"p2"]) == [b"a" * 10, b"b" * 5000, b""]
