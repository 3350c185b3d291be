"""Write-behind puts that find the reservation dry (issue 13.2): they wait for the
RESERVE already asked for instead of taking the general path's ALLOC and COMMIT round
trips; without a RESERVE in flight they take the general path at once."""

from __future__ import annotations

import kvshm.client as kc
from kvshm import Client
from kvshm.zmq_ctrl.protocol import Op
from servers import ServerProcess


def _dry(c: Client) -> None:
    """Take every block the reservation holds (as puts would)."""
    wb = c._session.wb
    assert wb.take((wb.free,)) is not None
    wb.copy_done()
    assert wb.free == 0


def _ask_refill(c: Client) -> int:
    """Send a RESERVE ahead as _put_behind does when the reservation runs low."""
    s, wb, chan = c._session, c._session.wb, c._chan
    with chan.lock:
        rid = s.new_id()
        wb.reserve_rid = rid
        chan.send(Op.RESERVE, {"blocks": wb.want, "reset": False}, req_id=rid,
                  epoch=s.epoch)
    return rid


def _general_puts(c: Client) -> list[int]:
    calls: list[int] = []
    orig = c._session.op_put_batch

    def counted(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    c._session.op_put_batch = counted
    return calls


def test_dry_reservation_waits_for_the_refill_in_flight():
    with ServerProcess(prealloc_size=1 / 16) as srv:
        with Client(srv.address, transport="shm", write_behind=True) as c, \
                Client(srv.address, transport="shm") as other:
            c.put("warm", b"w")                 # the reservation is granted
            c.flush()
            _dry(c)
            rid = _ask_refill(c)
            general = _general_puts(c)
            # the RESERVE's answer is in the socket, not read: the put waits for it
            assert c._put_behind("after-refill", b"v" * 5000)
            assert not general
            wb = c._session.wb
            assert wb.reserve_rid != rid         # its answer read (and applied)
            assert c.get("after-refill") == b"v" * 5000      # own write, at once
            c.flush()
            assert other.get("after-refill") == b"v" * 5000


def test_dry_reservation_without_a_refill_takes_the_general_path():
    with ServerProcess(prealloc_size=1 / 16) as srv:
        with Client(srv.address, transport="shm", write_behind=True) as c:
            c.put("warm", b"w")
            c.flush()
            _dry(c)
            assert c._session.wb.reserve_rid == 0
            assert c._wait_refill(1) is None    # nothing asked: no wait
            general = _general_puts(c)
            c.put("general", b"g" * 100)        # stored all the same
            assert general
            assert c.get("general") == b"g" * 100


def test_refill_that_does_not_come_in_time_takes_the_general_path(monkeypatch):
    monkeypatch.setattr(kc, "REFILL_WAIT_S", 0.0)
    with ServerProcess(prealloc_size=1 / 16) as srv:
        with Client(srv.address, transport="shm", write_behind=True) as c:
            c.put("warm", b"w")
            c.flush()
            _dry(c)
            _ask_refill(c)
            assert c._wait_refill(1) is None     # no time to wait: general path
            c.put("late", b"l" * 100)
            assert c.get("late") == b"l" * 100
            c.flush()


# ------------------------------------------------- batch lookups through the Client


def _answer(fn, keys):
    try:
        return ("ok", fn(keys))
    except Exception as exc:          # noqa: BLE001 - compared as type and message
        return (type(exc).__name__, str(exc))


def test_client_batch_lookups_answer_and_raise_as_the_server_path(monkeypatch):
    from kvshm import localread

    with ServerProcess("--block-size", "4", prealloc_size=1 / 16) as srv:
        with Client(srv.address, transport="shm") as local:
            monkeypatch.setenv(localread.ENV_DISABLE, "1")
            with Client(srv.address, transport="shm") as remote:
                monkeypatch.delenv(localread.ENV_DISABLE)
                assert local._session.local_reader() is not None
                assert remote._session.local_reader() is None
                held = [f"k-{i}" for i in range(3000)]
                local.put_batch(held, [b"v"] * len(held))
                gone = ["gone-1", "gone-2"]
                cases = [held, tuple(held), held + gone, gone + held, [], held[:5],
                         [k.encode() for k in held], iter(held[:10]),
                         held[:3] + ["\u00e9" * 1000], held[:3] + [bytearray(b"k-1")]]
                for odd in (7, None, b"", "", b"x" * 100000, "\ud800", 1.5):
                    cases += [held[:4] + [odd], [odd] + held[:4],
                              held[:2] + ["gone"] + [odd]]
                for keys in cases:
                    keys = list(keys) if not isinstance(keys, (list, tuple)) else keys
                    for fn in ("exists_batch", "match_prefix"):
                        want = _answer(getattr(remote, fn), keys)
                        got = _answer(getattr(local, fn), keys)
                        assert got == want, (fn, keys[:3], keys[-2:])
                # an iterator is consumed once, locally as by the server
                assert local.exists_batch(iter(held[:10])) == [True] * 10
                assert local.match_prefix(k for k in held[:10]) == 10
