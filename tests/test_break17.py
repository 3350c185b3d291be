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
