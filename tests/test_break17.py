"""break17: attacks on gcpause (kvshm._gcutil.untrack_plain and its callers), cutfix
(sends._cut's (fd, st_dev, st_ino) check), vllmlocal (_common.compact_fields) and localx3
(IndexReader batch segments). Each test failed on main before its fix, or is marked held."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace
from typing import Any

from kvshm.zmq_ctrl.sends import SendsMixin


def _open_fds() -> set[int]:
    # (the listing's own fd, closed by now, left out)
    return {int(x) for x in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{x}")}


class _CutLoop(SendsMixin):
    def __init__(self) -> None:
        self.store = SimpleNamespace(config=SimpleNamespace(lease_timeout=1.0))
        self.errors: dict[str, int] = {}

    def _count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


def test_cut_of_an_fd_reused_by_a_file_leaks_no_fd() -> None:
    """The peer's fd, closed by libzmq, is given by the kernel to a file (an SSD tier's
    file, a log, libzmq's own eventfd): _cut dup()ed it and made a socket of the dup,
    which raised ENOTSOCK and left the dup open, an fd leaked per cut, for good."""
    loop = _CutLoop()
    with tempfile.TemporaryFile() as f:
        fd = f.fileno()
        st = os.fstat(fd)
        before = _open_fds()
        for _ in range(5):
            loop._cut(b"peer", (fd, st.st_dev, st.st_ino))       # same inode even
            loop._cut(b"peer", (fd, st.st_dev, st.st_ino + 1))
        r, w = os.pipe()                    # a pipe (not a socket) at the fd
        try:
            pst = os.fstat(r)
            loop._cut(b"peer", (r, pst.st_dev, pst.st_ino))
            leaked = _open_fds() - before - {r, w}
        finally:
            os.close(r)
            os.close(w)
    assert not leaked, [os.readlink(f"/proc/self/fd/{x}") for x in leaked]
    assert loop.errors["unread_replies"] == 11


def test_cut_while_no_descriptor_is_free_says_untold_and_leaves_the_socket_up() -> None:
    """At EMFILE _cut cannot dup the fd to check it: it answers UNTOLD (the replies'
    next lease tries again), shuts nothing down and leaks nothing; with a descriptor
    free the same connection is shut down (SHUT), and a closed fd is GONE."""
    import socket

    from kvshm.zmq_ctrl import sends
    from test_idlecut import _NoFreeDescriptor

    loop = _CutLoop()
    a, b = socket.socketpair()
    try:
        st = os.fstat(a.fileno())
        conn = (a.fileno(), st.st_dev, st.st_ino)
        before = _open_fds()
        with _NoFreeDescriptor() as nf:
            assert nf.fill
            assert loop._cut(b"peer", conn) == sends.UNTOLD
        assert _open_fds() == before
        a.sendall(b"x")
        assert b.recv(1) == b"x"                # still up
        assert loop._cut(b"peer", conn) == sends.SHUT
        assert b.recv(1) == b""
    finally:
        a.close()
        b.close()
    assert sends.shut_conn(conn) == sends.GONE  # closed (or another's now)
    assert sends.shut_conn(None) == sends.GONE
    assert loop.errors["unread_replies"] == 2


_PV_TRACKED = r"""
import gc
from kvshm._pool import PackedValues
pv = PackedValues.of([b"x" * 300], [300], [1] * 300)
lists = [x for f in gc.get_referents(pv) for x in gc.get_referents(f)
         if type(x) is list and len(x) == 300]
assert len(lists) == 1, lists
print(gc.is_tracked(lists[0]))
"""


def test_packed_values_sizes_honour_the_untrack_off_switch() -> None:
    """KVSHM_UNTRACK=0 leaves every list tracked (kvshm._gcutil's docstring; the A/B of
    gcpause's figures): PackedValues.of untracked its sizes copy whatever the switch."""
    import subprocess
    import sys

    def tracked(flag: str) -> bool:
        env = dict(os.environ, KVSHM_UNTRACK=flag)
        out = subprocess.run([sys.executable, "-c", _PV_TRACKED], env=env, check=True,
                             capture_output=True, text=True, timeout=120).stdout
        return out.strip() == "True"

    assert tracked("1") is False
    assert tracked("0") is True


def test_cut_of_a_parked_or_sliced_request_names_the_connection_it_came_on() -> None:
    """A parked (tier wait) or sliced request is answered turns after it came: the
    reply's connection was taken (conn_of of the request's frame) only then, when the
    fd number may name another client's connection already (the peer's closed, the
    kernel gave the number to the next accept): that client was shut down for the
    peer's unread replies, the bug cutfix fixed for replies sent at once."""
    import time

    from test_cut_fd_reuse import _alive, _Frame, _Loop, _pair, unix_listener

    from kvshm.zmq_ctrl.handling import _Sliced
    from kvshm.zmq_ctrl.parked import _Parked

    with unix_listener("kvshm-b17cut-") as (ls, path, socks):
        for reuse in (True, False):
            loop = _Loop()
            a_cli, a_srv = _pair(ls, path)
            socks += [a_cli, a_srv]
            fd = a_srv.fileno()
            # A's large GET: received now, served in slices (or parked) over turns
            p = _Parked(b"A" * 16, object(), 1, 2, _Sliced(lambda f: None, lambda: None),
                        {}, [1], time.perf_counter(), time.monotonic() + 5.0,
                        _Frame(fd, ""))
            if reuse:
                a_cli.close()
                a_srv.close()
                b_cli, b_srv = _pair(ls, path)
                socks += [b_cli, b_srv]
                assert b_srv.fileno() == fd      # B's connection got A's fd number
            # the last slice done: the reply queued as slices.py / parked.py queue it
            loop._reply(p.ident, p.session, p.req_id, p.op, 0, {}, [b"x" * 65536],
                        p.extra, p.on_sent, p.t0, p.src)
            if reuse:
                # A's connection ended: its late reply is dropped, never sent on B's
                # (sends.conn_still, tests/test_break_trust27.py), so B is not cut either
                assert not loop._sending and loop.errors.get("reply_conn_gone") == 1
                assert _alive(b_cli, b_srv), "B was shut down for A's unread replies"
                b_cli.close()
                b_srv.close()
                continue
            assert loop._sending
            loop._reap_sends(time.monotonic() + 10.0)
            assert loop.errors.get("unread_replies") == 1
            a_cli.settimeout(5.0)
            assert a_cli.recv(1) == b""          # A itself is still cut: EOF
            a_cli.close()
            a_srv.close()


class _BigFrame(bytes):
    """A received large header frame (libzmq message) with its fd."""

    fd = -1

    def get(self, k: Any) -> Any:
        import zmq
        if k == zmq.SRCFD:
            return self.fd
        raise zmq.ZMQError(22)

    @property
    def buffer(self) -> memoryview:
        return memoryview(self)


def test_cut_of_a_request_whose_header_was_decoded_over_turns() -> None:
    """A large request header (>= STREAM_HEADER_BYTES) is decoded a slice a turn and
    dispatched turns after it came; its tracked reply's connection was taken only then
    (conn_of of the kept frame): the peer gone meanwhile and its fd number given to
    another client's connection, that client was shut down for the peer's unread
    replies."""
    import collections
    import time

    from test_cut_fd_reuse import _alive, _Loop, _pair, unix_listener

    from kvshm.zmq_ctrl.protocol import encode_request
    from kvshm.zmq_ctrl.slices import STREAM_HEADER_BYTES, SlicesMixin

    class Loop(_Loop, SlicesMixin):
        def __init__(self) -> None:
            super().__init__()
            self.epoch = 7
            self._batchq = None
            self._decodes: collections.deque[Any] = collections.deque()
            self._held: dict[bytes, Any] = {}
            self._stateful: set[int] = set()
            self.slice_keys = 1 << 20
            self.sess = SimpleNamespace(seen=0.0)

            def handler(session: Any, req_id: int, body: Any, frames: Any,
                        on_sent: list[Any]) -> Any:
                on_sent.append(1)                   # a zero-copy value: tracked
                return 0, {}, [b"x" * 65536]
            self._handlers = {5: handler}

        def _session_of(self, ident: bytes, src: Any = None) -> Any:
            return self.sess

        def _settle_is_large(self, session: Any, body: Any) -> bool:
            return False

        def _piggyback(self, session: Any, body: Any, extra: Any) -> None:
            pass

    with unix_listener("kvshm-b17dec-") as (ls, path, socks):
        loop = Loop()
        a_cli, a_srv = _pair(ls, path)
        socks += [a_cli, a_srv]
        fd = a_srv.fileno()
        hdr = encode_request(5, 1, 7, {"keys": [b"k%07d" % i for i in range(12000)]})
        assert len(hdr) >= STREAM_HEADER_BYTES
        frame = _BigFrame(hdr)
        frame.fd = fd
        loop._dispatch([b"A" * 16, frame])          # A's large request: being decoded
        assert loop._decodes and not loop._sending
        a_cli.close()                                # A goes; B gets its fd number
        a_srv.close()
        b_cli, b_srv = _pair(ls, path)
        socks += [b_cli, b_srv]
        assert b_srv.fileno() == fd
        for _ in range(1000):
            if not loop._decodes:
                break
            loop._run_decodes()
        # A's connection ended before its reply was made: dropped, never queued on B's
        # connection (sends.conn_still), so B is neither sent it nor cut for it
        assert not loop._sending and loop.errors.get("reply_conn_gone") == 1, loop.errors
        loop._reap_sends(time.monotonic() + 10.0)
        assert not loop.errors.get("unread_replies")
        assert _alive(b_cli, b_srv), "B was shut down for A's unread replies"


def test_decoded_lists_with_a_nested_item_after_the_untracked_start_stay_tracked() -> None:
    """gcpause (held): a request's long list untracked from the start (RequestDecoder,
    in turns) or after decoding (decode_request) is tracked when any item is a
    container (a list, a map, an ExtType: a namedtuple) however late it comes, and a
    bytes subclass of no __dict__ is a tracked type (heap types always are)."""
    import gc

    import msgpack

    from kvshm._gcutil import untrack_plain
    from kvshm.zmq_ctrl.protocol import RequestDecoder, decode_request

    class K(bytes):
        __slots__ = ()

    lst = [K(b"a")] * 300
    assert untrack_plain(lst) is False and gc.is_tracked(lst)
    for tail in ([1, 2], {"a": 1}, msgpack.ExtType(5, b"x")):
        items = [b"k%d" % i for i in range(300)] + [tail] + [b"z"] * 300
        hdr = msgpack.packb([1, 5, 1, 0, {"keys": items}], use_bin_type=True)
        assert gc.is_tracked(decode_request(hdr)[4]["keys"])
        dec = RequestDecoder(hdr)
        r = None
        while r is None:
            r = dec.step(100)
        assert gc.is_tracked(r[4]["keys"]), tail
        assert r[4]["keys"] == items


def test_local_batch_items_replaced_by_another_thread_between_segments(shm_name) -> None:
    """localx3 (held): another thread replacing the later keys of a large batch's list
    (same length) by an int, an absent key, a str, and back, while the GIL is released
    per segment: no crash; the keys never touched (the first three segments, all
    present) are answered True, or the batch falls back."""
    import threading

    from test_localx import Tables

    from kvshm._shmindex import BATCH_SEGMENT, FALLBACK

    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        n = 6 * BATCH_SEGMENT
        keys = [b"rep-%08d" % i for i in range(n)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i % 65000, 1)]) >= 0
        shared = list(keys)
        stable = 3 * BATCH_SEGMENT
        stop = threading.Event()
        subs: list[Any] = [12345, b"absent-key", "rep-str", None, b""]

        def mutate() -> None:
            j = 0
            while not stop.is_set():
                j += 1
                sub = subs[j % len(subs)]
                for i in range(stable, n, 97):
                    shared[i] = sub
                for i in range(stable, n, 97):
                    shared[i] = keys[i]

        th = threading.Thread(target=mutate)
        th.start()
        try:
            for _ in range(60):
                got = t.fast.exists_batch(shared)
                assert got is None or (len(got) == n and got[:stable] == [True] * stable)
                m = t.fast.match_prefix(shared)
                assert m == FALLBACK or stable <= m <= n
        finally:
            stop.set()
            th.join()
        assert t.fast.exists_batch(shared) == [True] * n
        assert t.fast.match_prefix(shared) == n
    finally:
        t.close()


def test_cut_of_a_request_held_behind_its_peers_large_header() -> None:
    """A peer's requests that come while its large header is being decoded are held
    and dispatched only after it: a held request's tracked reply took its connection
    (conn_of of its frame) then, when the peer could be gone and its fd number another
    client's connection, which was shut down for the peer's unread replies."""
    import collections
    import time

    from test_cut_fd_reuse import _alive, _Loop, _pair, unix_listener

    from kvshm.zmq_ctrl.protocol import encode_request
    from kvshm.zmq_ctrl.router import ServiceLoop
    from kvshm.zmq_ctrl.slices import SlicesMixin

    class Loop(_Loop, SlicesMixin):
        _handle = ServiceLoop._handle

        def __init__(self) -> None:
            super().__init__()
            self.epoch = 7
            self._batchq = None
            self._decodes: collections.deque[Any] = collections.deque()
            self._held: dict[bytes, Any] = {}
            self._stateful: set[int] = set()
            self.slice_keys = 1 << 20
            self.sess = SimpleNamespace(seen=0.0)

            def big(session: Any, req_id: int, body: Any, frames: Any,
                    on_sent: list[Any]) -> Any:
                return 0, {}, []                    # answered, nothing tracked

            def small(session: Any, req_id: int, body: Any, frames: Any,
                      on_sent: list[Any]) -> Any:
                on_sent.append(1)                   # a zero-copy value: tracked
                return 0, {}, [b"x" * 65536]
            self._handlers = {5: big, 6: small}

        def _session_of(self, ident: bytes, src: Any = None) -> Any:
            return self.sess

        def _settle_is_large(self, session: Any, body: Any) -> bool:
            return False

        def _piggyback(self, session: Any, body: Any, extra: Any) -> None:
            pass

    with unix_listener("kvshm-b17held-") as (ls, path, socks):
        loop = Loop()
        a_cli, a_srv = _pair(ls, path)
        socks += [a_cli, a_srv]
        fd = a_srv.fileno()
        big = _BigFrame(encode_request(5, 1, 7, {"keys": [b"k%07d" % i
                                                          for i in range(12000)]}))
        small = _BigFrame(encode_request(6, 2, 7, {"keys": [b"a"]}))
        big.fd = small.fd = fd
        ident = b"A" * 16
        loop._handle([ident, big])                   # being decoded
        loop._handle([ident, small])                 # held behind it
        assert loop._decodes and loop._held[ident]
        a_cli.close()                                # A goes; B gets its fd number
        a_srv.close()
        b_cli, b_srv = _pair(ls, path)
        socks += [b_cli, b_srv]
        assert b_srv.fileno() == fd
        for _ in range(1000):
            if not loop._decodes:
                break
            loop._run_decodes()
        # both of A's replies (the decoded request's and the held GET's) dropped: its
        # connection ended (sends.conn_still); none queued on B's, B not cut
        assert not loop._sending and loop.errors.get("reply_conn_gone") == 2, loop.errors
        loop._reap_sends(time.monotonic() + 10.0)
        assert not loop.errors.get("unread_replies")
        assert _alive(b_cli, b_srv), "B was shut down for A's unread replies"


def test_compact_vllm_keys_at_the_boundary_and_never_meeting_the_readable_form() -> None:
    """vllmlocal (held): names whose readable keys are exactly KEY_MAX stay readable, one
    byte more goes compact (the key then <= KEY_MAX); quote() of any name (non-ASCII,
    '%h', '|', '%' itself) never starts with '%h' nor holds '|'; compact and readable
    namespaces never meet."""
    from urllib.parse import quote

    from kvshm._shmindex import KEY_MAX
    from kvshm.integrations._common import compact_fields, compact_key

    raw = bytes(range(36))
    base = ["vllm", "", "bfloat16", "tp1pp1pcp1dcp1", "default", "c1x16", "r4096"]
    fixed = len("|".join(base) + "|") + 2 * len(raw)
    seen: dict[str, str] = {}
    for name in ["a" * (KEY_MAX - fixed), "a" * (KEY_MAX - fixed + 1), "%h" + "x" * 90,
                 "|" * 40, "模型/" * 20, "%25h", "/tmp/x" * 30, "é" * 13, ""]:
        q = quote(name, safe="")
        assert not q.startswith("%h") and "|" not in q
        f = list(base)
        f[1] = q
        ns, hexids = compact_fields(f, 1, len(raw))
        k = compact_key(ns.encode(), hexids, raw)
        assert len(k) <= KEY_MAX, (name, len(k))
        assert k.decode().split("|")[3] == "tp1pp1pcp1dcp1"
        assert hexids == (len("|".join(f) + "|") + 72 <= KEY_MAX)
        assert seen.setdefault(ns, name) == name         # one namespace, one name
    assert compact_fields([*base[:1], "a" * (KEY_MAX - fixed), *base[2:]], 1, 36)[1]
    assert not compact_fields([*base[:1], "a" * (KEY_MAX - fixed + 1), *base[2:]], 1, 36)[1]
