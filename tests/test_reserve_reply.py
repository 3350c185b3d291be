"""A write-behind client whose RESERVE reply is garbled or hostile keeps working.

The replies are made bad in the client (``decode_reply`` patched where the client reads
them: a reply of the server that cannot be decoded, or one that decodes to a body the
server never sends), the server is real. Each failed on main (b21225c) before its fix:

* a RESERVE sent ahead whose reply could not be decoded was dropped by
  ``Channel.drain``: its in-flight marker (``_WriteBehind.reserve_rid``) stayed set for
  good, so no RESERVE was ever sent again and every later put waited REFILL_WAIT_S for
  it and then took ALLOC/COMMIT (400 puts of 64 KiB: 17.5 s, none written behind);
* a RESERVE reply whose runs were malformed (``[[0]]``, ``"abc"``, names) raised
  IndexError/TypeError/ValueError out of the reply reader (the put of another key, or the
  AsyncClient's reader task, which then died: every later call waited its timeout);
  runs outside the pool or overlapping blocks already held were taken as reserved.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest

import kvshm.aio as kaio
from kvshm import Client
from kvshm.aio import AsyncClient
from kvshm.errors import KvshmError, ProtocolError, WritesLost
from kvshm.zmq_ctrl import channel as chmod
from kvshm.zmq_ctrl.protocol import DecodeError
from servers import ServerProcess

pytestmark = pytest.mark.timeout(120)

KiB = 1024


@pytest.fixture(scope="module")
def srv():
    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


def _is_reserve_reply(body: dict[str, Any]) -> bool:
    return set(body) == {"gen", "runs", "held"}       # kvshm.zmq_ctrl.ops_local


def _bad_reserve_reply(monkeypatch: pytest.MonkeyPatch, module: Any,
                       make: Callable[[dict[str, Any]], dict[str, Any] | None],
                       only: Callable[[int], bool] = lambda rid: True) -> list[int]:
    """Patch ``module.decode_reply`` so that the first RESERVE reply whose request id
    passes ``only`` is garbled (``make`` returns None: DecodeError) or replaced by
    ``make(body)``. Returns the list of request ids so treated."""
    real = module.decode_reply
    done: list[int] = []

    def decode(buf: Any) -> tuple[int, int, dict[str, Any]]:
        st, rid, body = real(buf)
        if not done and st == 0 and _is_reserve_reply(body) and only(rid):
            done.append(rid)
            bad = make(body)
            if bad is None:
                raise DecodeError("garbled on purpose (test)")
            return st, rid, bad
        return st, rid, body

    monkeypatch.setattr(module, "decode_reply", decode)
    return done


def _val(i: int, n: int = 64 * KiB) -> bytes:
    return bytes([i % 251]) * n


def _puts(c: Client, first: int, n: int) -> list[tuple[int, str]]:
    errors = []
    for i in range(first, first + n):
        try:
            c.put(f"rr{i}", _val(i))
        except KvshmError as exc:
            errors.append((i, f"{type(exc).__name__}: {exc}"))
    return errors


def _flush(c: Client) -> None:
    try:
        c.flush()
    except WritesLost:
        pass                # (writes in flight when the connection was reset)


def _check_after(c: Client, srv: Any, first: int) -> None:
    """The client writes behind again: every put from ``first`` on took the
    write-behind path, a RESERVE was answered since, all are stored."""
    # (the first: a HELLO where one is due, a RESERVE where nothing is reserved)
    assert _puts(c, first, 1) == []
    wb = c.session.wb           # (a reconnect's HELLOs make a new one)
    assert wb is not None
    n = 3 * wb.want             # the reservation runs dry (and is refilled) 3 times
    p0 = wb.puts
    assert _puts(c, first + 1, n - 1) == []
    assert wb.puts - p0 == n - 1, "every put written behind (none on ALLOC/COMMIT)"
    c.flush()
    assert not wb.reserve_rid
    with Client(srv.address) as other:
        keys = [f"rr{i}" for i in range(first, first + n)]
        assert other.get_batch(keys) == [_val(i) for i in range(first, first + n)]
        c.delete(keys)
        s = other.stats(verify=True)
        assert s["accounting_ok"] and s["reservations"]["accounting_ok"], s


def test_garbled_reply_of_a_reserve_sent_ahead(srv, monkeypatch):
    """The reply of the RESERVE sent ahead cannot be decoded: the call that read it
    raises ProtocolError (the connection is reset: which request it answered is
    unknown); the client then writes behind again."""
    with Client(srv.address, write_behind=True, timeout=10) as c:
        c.put("rr-warm", b"w")
        c.flush()
        wb = c.session.wb
        assert wb is not None and wb.gen
        done = _bad_reserve_reply(monkeypatch, chmod, lambda body: None,
                                  only=lambda rid: rid == wb.reserve_rid)
        errors = _puts(c, 0, 2 * wb.want)
        assert len(done) == 1, "a RESERVE was sent ahead and its reply read"
        # the call that read it raises ProtocolError; or, when a HELLO's drain read it
        # (a HELLO came due meanwhile: Client._hello_locked drains replies in flight
        # first and takes a bad one as the reset it is), the writes it left unanswered
        # are reported lost instead (seen once in a CI rehearsal at load ~5)
        assert errors, errors
        assert "ProtocolError: bad reply" in errors[0][1] or (
            "WritesLost" in errors[0][1] and len(errors) == 1), errors
        # a write in flight on the reset connection is reported lost, once
        assert all("WritesLost" in e for _, e in errors[1:]) and len(errors) <= 2, errors
        _flush(c)
        assert not wb.reserve_rid, "the in-flight marker is cleared"
        _check_after(c, srv, 10_000)
        c.delete("rr-warm")


HOSTILE: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "run_short": lambda b: {**b, "runs": [[0]]},
    "runs_not_list": lambda b: {**b, "runs": "abc"},
    "runs_dict": lambda b: {**b, "runs": {"a": 1}},
    "run_not_ints": lambda b: {**b, "runs": [["a", 1]]},
    "run_float": lambda b: {**b, "runs": [[1.5, 2]]},
    "run_bool": lambda b: {**b, "runs": [[True, 1]]},
    "run_negative_first": lambda b: {**b, "runs": [[-1, 4]]},
    "run_empty": lambda b: {**b, "runs": [[0, 0]]},
    "run_negative_count": lambda b: {**b, "runs": [[0, -3]]},
    "run_past_the_pool": lambda b: {**b, "runs": [[0, 1 << 40]]},
    "run_after_the_pool": lambda b: {**b, "runs": [[1 << 30, 1]]},
    "runs_overlap": lambda b: {**b, "runs": [[0, 4], [2, 4]]},
    "gen_str": lambda b: {**b, "gen": "x"},
    "gen_none": lambda b: {**b, "gen": None},
    "gen_zero": lambda b: {**b, "gen": 0},
    "gen_negative": lambda b: {**b, "gen": -5},
    "gen_huge": lambda b: {**b, "gen": 1 << 70},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_reply_of_a_reserve_sent_ahead(srv, monkeypatch, case):
    """A RESERVE sent ahead is answered with a body the server never sends: nothing
    raises out of the reply reader; the reservation is dropped (the next RESERVE resets
    it) and the client writes behind again; every put is stored."""
    with Client(srv.address, write_behind=True, timeout=10) as c:
        c.put("rr-warm", b"w")
        c.flush()
        wb = c.session.wb
        assert wb is not None and wb.gen
        done = _bad_reserve_reply(monkeypatch, chmod, HOSTILE[case],
                                  only=lambda rid: rid == wb.reserve_rid)
        assert _puts(c, 0, 2 * wb.want) == []
        assert len(done) == 1, "a RESERVE was sent ahead and its reply read"
        c.flush()
        assert not wb.reserve_rid
        with Client(srv.address) as other:
            keys = [f"rr{i}" for i in range(2 * wb.want)]
            assert other.get_batch(keys) == [_val(i) for i in range(2 * wb.want)]
            c.delete(keys)
        _check_after(c, srv, 10_000)
        c.delete("rr-warm")


@pytest.mark.parametrize("case", ["garbled", "run_short", "run_past_the_pool",
                                  "runs_overlap", "gen_str"])
def test_bad_reply_of_the_reserve_a_put_waits_for(srv, monkeypatch, case):
    """The first put's RESERVE (reset, waited for) gets a bad reply: that put raises
    ProtocolError, nothing of the reply is used, the next put reserves again."""
    with Client(srv.address, write_behind=True, timeout=10) as c:
        wb = c.session.wb
        assert wb is not None and not wb.gen
        done = _bad_reserve_reply(monkeypatch, chmod,
                                  (lambda b: None) if case == "garbled" else HOSTILE[case])
        with pytest.raises(ProtocolError, match="bad reply|bad RESERVE reply"):
            c.put("rr-first", _val(1))
        assert len(done) == 1
        assert not wb.reserving and not wb.reserve_rid and not wb.runs
        _check_after(c, srv, 20_000)
        assert not c.exists("rr-first")


@pytest.mark.parametrize("case", ["run_short", "runs_not_list", "gen_str",
                                  "run_past_the_pool"])
def test_async_client_survives_a_hostile_reserve_reply(srv, monkeypatch, case):
    """The AsyncClient's reader task hands the reply of a RESERVE sent ahead to the
    session: a hostile body must not end that task (every later call then waited for
    its timeout)."""
    async def main() -> None:
        async with AsyncClient(srv.address, write_behind=True, timeout=5) as c:
            await c.put("rr-awarm", b"w")
            await c.flush()
            wb = c._session.wb
            assert wb is not None and wb.gen
            done = _bad_reserve_reply(monkeypatch, kaio, HOSTILE[case],
                                      only=lambda rid: rid == wb.reserve_rid)
            n = 2 * wb.want
            for i in range(n):
                await c.put(f"rra{i}", _val(i))
            await c.flush()
            assert len(done) == 1
            assert not wb.reserve_rid
            got = await c.get_batch([f"rra{i}" for i in range(n)])
            assert got == [_val(i) for i in range(n)]
            await c.delete([f"rra{i}" for i in range(n)] + ["rr-awarm"])

    asyncio.run(main())
