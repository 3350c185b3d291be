"""kvshm.rdma's pure parts: work-request planning and signalling, GID selection, the QP
information codec and transition attributes, completion-status mapping, the memlock check,
the memory-region cache, options and device errors. No pyverbs, no device."""

from __future__ import annotations

import argparse
import random

import numpy as np
import pytest

from kvshm.rdma import constants as C
from kvshm.rdma import RdmaOptions
from kvshm.rdma.device import (GidEntry, PortInfo, gid_text, no_device_cause,
                               normalize_link_type, open_port, select_gid)
from kvshm.rdma.errors import CompletionError, DeviceError, MemlockError
from kvshm.rdma.memlock import FIX, check_memlock
from kvshm.rdma.mr_cache import MrCache, buffer_address
from kvshm.rdma.qp import (INIT_MASK, RTR_MASK, RTS_MASK, QpInfo, Timing, init_attrs,
                           new_psn, path_mtu, rtr_attrs, rts_attrs)
from kvshm.rdma.wr import Segment, WorkRequest, groups, plan
from rdma_double import FakeDevice, FakeVerbs, ib_gids, roce_gids

W, R = C.WR_RDMA_WRITE, C.WR_RDMA_READ


# ----------------------------------------------------------------------------- planning


def _segs(sizes, *, contiguous_remote=True, contiguous_local=False, gap=0):
    out, l, r = [], 0x10000, 0x900000
    for i, n in enumerate(sizes):
        out.append(Segment(l, 7, n, r, i))
        l += n + (0 if contiguous_local else 4096)
        r += n + (0 if contiguous_remote else gap or 64)
    return out


def _bytes_of(wrs):
    """Map remote byte ranges to local byte ranges covered by the plan."""
    moved = []
    for w in wrs:
        r = w.remote_addr
        for s in w.sges:
            moved.append((r, s.addr, s.length))
            r += s.length
    return moved


def test_plan_one_wr_per_value_when_nothing_is_contiguous():
    segs = _segs([100, 200, 300], contiguous_remote=False)
    wrs = plan(segs, opcode=W, rkey=9, max_sge=4, max_msg=1 << 30, signal_every=16)
    assert [len(w.sges) for w in wrs] == [1, 1, 1]
    assert [w.remote_addr for w in wrs] == [s.raddr for s in segs]
    assert [w.items for w in wrs] == [(0,), (1,), (2,)]
    assert all(w.rkey == 9 and w.opcode == W for w in wrs)
    assert [w.signaled for w in wrs] == [False, False, True]


def test_plan_gathers_remote_contiguous_values_up_to_max_sge():
    segs = _segs([10] * 10)   # remote contiguous, local not
    wrs = plan(segs, opcode=W, rkey=1, max_sge=4, max_msg=1 << 30, signal_every=100)
    assert [len(w.sges) for w in wrs] == [4, 4, 2]
    assert [w.items for w in wrs] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert [w.length for w in wrs] == [40, 40, 20]


def test_plan_merges_local_and_remote_contiguous_into_one_sge():
    segs = _segs([10] * 5, contiguous_local=True)
    wrs = plan(segs, opcode=R, rkey=1, max_sge=1, max_msg=1 << 30, signal_every=1)
    assert len(wrs) == 1 and wrs[0].sges[0].length == 50 and wrs[0].items == (0, 1, 2, 3, 4)


def test_plan_splits_values_longer_than_the_max_message():
    segs = [Segment(0x1000, 3, 10_000, 0x80000, 0)]
    wrs = plan(segs, opcode=W, rkey=2, max_sge=8, max_msg=4096, signal_every=2)
    assert [w.length for w in wrs] == [4096, 4096, 1808]
    assert [w.remote_addr for w in wrs] == [0x80000, 0x81000, 0x82000]
    assert [w.sges[0].addr for w in wrs] == [0x1000, 0x2000, 0x3000]
    assert [w.signaled for w in wrs] == [False, True, True]


def test_plan_never_exceeds_the_max_message_when_gathering():
    segs = _segs([3000, 3000, 3000])
    wrs = plan(segs, opcode=W, rkey=2, max_sge=8, max_msg=4096, signal_every=4)
    assert all(w.length <= 4096 for w in wrs)
    assert sum(w.length for w in wrs) == 9000


def test_plan_drops_empty_values_and_numbers_wr_ids():
    segs = _segs([0, 5, 0])
    wrs = plan(segs, opcode=W, rkey=2, max_sge=8, max_msg=64, signal_every=4,
               wr_id_base=7 << 32)
    assert len(wrs) == 1 and wrs[0].items == (1,) and wrs[0].wr_id == 7 << 32
    assert plan([], opcode=W, rkey=1, max_sge=1, max_msg=1, signal_every=1) == []


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError):
        plan(_segs([1]), opcode=99, rkey=1, max_sge=1, max_msg=1, signal_every=1)
    with pytest.raises(ValueError):
        plan(_segs([1]), opcode=W, rkey=1, max_sge=0, max_msg=1, signal_every=1)
    with pytest.raises(ValueError):
        plan([Segment(0, 0, -1, 0, 0)], opcode=W, rkey=1, max_sge=1, max_msg=1,
             signal_every=1)


def _canonical(triples):
    """Sorted (remote, local, length) runs, merged where both sides continue."""
    out = []
    for r, l, n in sorted(t for t in triples if t[2]):
        if out and out[-1][0] + out[-1][2] == r and out[-1][1] + out[-1][2] == l:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((r, l, n))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_plan_covers_every_byte_exactly_once(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 7, 4096, 65536, 100_000]) for _ in range(rng.randint(1, 40))]
    segs = _segs(sizes, contiguous_remote=rng.random() < 0.5,
                 contiguous_local=rng.random() < 0.5)
    max_sge = rng.randint(1, 5)
    max_msg = rng.choice([4096, 65536, 1 << 30])
    every = rng.randint(1, 6)
    wrs = plan(segs, opcode=W, rkey=1, max_sge=max_sge, max_msg=max_msg,
               signal_every=every)
    assert all(1 <= len(w.sges) <= max_sge and w.length <= max_msg for w in wrs)
    assert _canonical(_bytes_of(wrs)) == _canonical((s.raddr, s.laddr, s.length)
                                                    for s in segs)
    assert {i for w in wrs for i in w.items} == {s.item for s in segs if s.length}
    # signalling: every `every`-th and the last; the runs cover the plan
    if wrs:
        assert all(w.signaled == ((i + 1) % every == 0 or i == len(wrs) - 1)
                   for i, w in enumerate(wrs))
        runs = groups(wrs)
        assert runs[0][0] == 0 and runs[-1][1] == len(wrs)
        assert all(b - a <= every for a, b in runs)


def test_groups_require_a_signalled_last_wr():
    w = WorkRequest(0, W, (), 0, 0, False, ())
    with pytest.raises(ValueError):
        groups([w])
    s = WorkRequest(1, W, (), 0, 0, True, ())
    assert groups([w, s, s]) == [(0, 2), (2, 3)]


# ----------------------------------------------------------------------------- GIDs


def _v4(ip):
    return bytes(10) + b"\xff\xff" + bytes(int(x) for x in ip.split("."))


def test_roce_picks_the_rocev2_gid_of_the_ipv4_address():
    table = roce_gids("10.1.2.3")
    g = select_gid(table, link_layer="Ethernet")
    assert g.index == 3 and g.gid_type == "RoCEv2" and g.ipv4 == "10.1.2.3"


def test_roce_gid_type_is_read_from_the_table_not_the_index():
    # an unusual order: v2 first at index 0, v1 at 1, two IPv4s
    table = [GidEntry(0, _v4("10.0.0.9"), "RoCEv1"), GidEntry(1, _v4("10.0.0.9"), "RoCEv2"),
             GidEntry(4, _v4("10.0.0.7"), "RoCEv2"), GidEntry(2, bytes(16), "RoCEv2")]
    assert select_gid(table, link_layer="Ethernet").index == 1
    assert select_gid(table, link_layer="Ethernet", prefer_ipv4="10.0.0.7").index == 4
    assert select_gid(table, link_layer="Ethernet", prefer_ipv4="10.9.9.9").index == 1


def test_explicit_gid_index_wins_and_is_checked():
    table = roce_gids()
    assert select_gid(table, link_layer="Ethernet", gid_index=0).gid_type == "RoCEv1"
    with pytest.raises(DeviceError, match="GID index 9 of port 1 is empty"):
        select_gid(table, link_layer="Ethernet", gid_index=9, device="mlx5_0")


def test_roce_without_ipv4_gid_says_what_to_do():
    table = [GidEntry(0, b"\xfe\x80" + bytes(13) + b"\x01", "RoCEv1"),
             GidEntry(1, b"\xfe\x80" + bytes(13) + b"\x01", "RoCEv2")]
    with pytest.raises(DeviceError) as ei:
        select_gid(table, link_layer="Ethernet", device="mlx5_1", port=2)
    msg = str(ei.value)
    assert "RDMA device mlx5_1" in msg and "port 2" in msg and "--gid-index" in msg
    assert "fe80::1 RoCEv2" in msg


def test_ib_picks_the_port_gid():
    assert select_gid(ib_gids(), link_layer="IB").index == 0
    with pytest.raises(DeviceError, match="empty"):
        select_gid([], link_layer="IB")


def test_gid_text():
    assert gid_text(_v4("192.0.2.1")) == "::ffff:192.0.2.1"
    assert gid_text(b"\xfe\x80" + bytes(13) + b"\x01") == "fe80::1"


def test_link_type_spellings():
    assert normalize_link_type("ib") == "IB"
    assert normalize_link_type("Ethernet") == normalize_link_type("RoCE") == "Ethernet"
    assert normalize_link_type(None) is None
    with pytest.raises(ValueError):
        normalize_link_type("token-ring")


# ----------------------------------------------------------------------------- QP info


def _info(**kw):
    d = dict(qpn=0x1234, psn=0xABCDE, lid=0, gid=_v4("10.0.0.1"), mtu=4096,
             link_layer="Ethernet", rd_atomic=16)
    d.update(kw)
    return QpInfo(**d)


def test_qp_info_round_trips_through_msgpack():
    import msgpack

    a = _info()
    wire = msgpack.unpackb(msgpack.packb(a.to_wire(), use_bin_type=True), raw=False)
    assert QpInfo.from_wire(wire) == a


@pytest.mark.parametrize("field,value,match", [
    ("qpn", 0, "qpn"), ("qpn", 1 << 24, "qpn"), ("psn", -1, "psn"), ("lid", 70000, "lid"),
    ("gid", b"short", "gid"), ("gid", "x" * 16, "gid"), ("mtu", 1500, "mtu"),
    ("link", "FDDI", "link"), ("rd", 0, "rd"), ("qpn", "12", "qpn"), ("qpn", None, "qpn"),
])
def test_qp_info_rejects_bad_fields(field, value, match):
    w = _info().to_wire()
    w[field] = value
    with pytest.raises(ValueError, match=match):
        QpInfo.from_wire(w)


def test_qp_info_rejects_non_maps():
    with pytest.raises(ValueError, match="map"):
        QpInfo.from_wire([1, 2])


def test_new_psn_is_24_bits():
    assert all(0 <= new_psn() < 1 << 24 for _ in range(100))


def test_rtr_on_roce_uses_a_global_route():
    local = _info(mtu=4096)
    remote = _info(qpn=77, psn=5, gid=_v4("10.0.0.2"), mtu=1024)
    a = rtr_attrs(local, remote, port_num=1, sgid_index=3, responder_depth=16)
    assert a.qp_state == C.QPS_RTR and a.dest_qp_num == 77 and a.rq_psn == 5
    assert a.path_mtu == C.mtu_enum(1024) == path_mtu(local, remote) // 1024 + 2
    assert (a.ah_is_global, a.ah_dgid, a.ah_sgid_index) == (1, remote.gid, 3)
    assert a.ah_hop_limit == 64 and a.ah_dlid == 0 and a.max_dest_rd_atomic == 16


def test_rtr_on_ib_uses_the_lid():
    local = _info(link_layer="IB", lid=3, gid=bytes(15) + b"\x01")
    remote = _info(link_layer="IB", lid=9, qpn=5, gid=bytes(15) + b"\x02")
    a = rtr_attrs(local, remote, port_num=2, sgid_index=0, responder_depth=4)
    assert (a.ah_is_global, a.ah_dlid, a.ah_port_num, a.port_num) == (0, 9, 2, 2)
    g = rtr_attrs(local, remote, port_num=1, sgid_index=1, responder_depth=4,
                  force_grh=True)
    assert g.ah_is_global == 1 and g.ah_dgid == remote.gid and g.ah_dlid == 9


def test_rtr_refuses_mixed_link_layers():
    with pytest.raises(ValueError, match="link layers differ"):
        rtr_attrs(_info(), _info(link_layer="IB"), port_num=1, sgid_index=0,
                  responder_depth=1)


def test_init_and_rts_attributes_and_masks():
    i = init_attrs(port_num=1, access=C.ACCESS_REMOTE_READ | C.ACCESS_REMOTE_WRITE)
    assert i.qp_state == C.QPS_INIT and i.qp_access_flags == 6 and i.pkey_index == 0
    r = rts_attrs(_info(psn=42), initiator_depth=8, timing=Timing(timeout=18))
    assert (r.qp_state, r.sq_psn, r.max_rd_atomic, r.timeout, r.retry_cnt, r.rnr_retry) \
        == (C.QPS_RTS, 42, 8, 18, 7, 7)
    # the masks pyverbs' QP.to_init/to_rtr/to_rts use for RC QPs
    assert INIT_MASK == C.QP_STATE | C.QP_PKEY_INDEX | C.QP_PORT | C.QP_ACCESS_FLAGS
    assert RTR_MASK & C.QP_AV and RTR_MASK & C.QP_DEST_QPN and RTR_MASK & C.QP_PATH_MTU
    assert RTS_MASK & C.QP_SQ_PSN and RTS_MASK & C.QP_RETRY_CNT and RTS_MASK & C.QP_TIMEOUT


# ----------------------------------------------------------------------------- completions


@pytest.mark.parametrize("status,name,word", [
    (C.WC_RETRY_EXC_ERR, "IBV_WC_RETRY_EXC_ERR", "retry counter exceeded"),
    (C.WC_REM_ACCESS_ERR, "IBV_WC_REM_ACCESS_ERR", "remote access error"),
    (C.WC_WR_FLUSH_ERR, "IBV_WC_WR_FLUSH_ERR", "flushed"),
    (4, "IBV_WC_LOC_PROT_ERR", "local protection"),
    (99, "IBV_WC_STATUS_99", "unknown completion status 99"),
])
def test_completion_error_names_key_status_and_cause(status, name, word):
    e = CompletionError(op="RDMA READ", keys=[b"layer3/chunk7", b"x"], status=status,
                        peer="10.0.0.2:12345", vendor_err=0x81)
    s = str(e)
    assert e.key == b"layer3/chunk7" and e.status_name == name
    assert "RDMA READ of key b'layer3/chunk7'" in s and "1 more keys" in s
    assert name in s and word in s and "10.0.0.2:12345" in s and "0x81" in s
    assert "re-establishes" in s
    assert isinstance(e, OSError)


def test_every_known_status_has_a_name_and_a_cause():
    assert set(C.WC_STATUS) == set(range(22))
    assert C.wc_status_name(0) == "IBV_WC_SUCCESS"


def test_mtu_conversions():
    assert [C.mtu_bytes(i) for i in range(1, 6)] == [256, 512, 1024, 2048, 4096]
    assert C.mtu_enum(2048) == 4
    with pytest.raises(ValueError):
        C.mtu_enum(1500)
    with pytest.raises(ValueError):
        C.mtu_bytes(0)


# ----------------------------------------------------------------------------- memlock


def test_memlock_within_limit_passes():
    check_memlock(1 << 20, limit=8 << 20, pinned=0, cap_ipc_lock=False)
    check_memlock(1 << 40, limit=None, pinned=0, cap_ipc_lock=False)
    check_memlock(1 << 40, limit=8 << 20, pinned=0, cap_ipc_lock=True)


def test_memlock_too_low_says_how_to_fix():
    with pytest.raises(MemlockError) as ei:
        check_memlock(2 << 30, what="the 2 GiB pool", limit=8 << 20, pinned=1 << 20,
                      cap_ipc_lock=False)
    msg = str(ei.value)
    assert "RLIMIT_MEMLOCK is 8 MiB" in msg and "1 MiB of it pinned already" in msg
    assert "the 2 GiB pool" in msg and "ulimit -l unlimited" in msg
    assert "LimitMEMLOCK=infinity" in msg and "limits.conf" in msg and FIX in msg


# ----------------------------------------------------------------------------- MR cache


class _MR:
    def __init__(self, pd, addr, length, access):
        self.addr, self.length, self.access = addr, length, access
        self.lkey = self.rkey = len(pd.log) + 1
        self.closed = False
        self.pd = pd

    def close(self):
        self.closed = True
        self.pd.closed.append((self.addr, self.length))


class _PD:
    def __init__(self):
        self.log = []
        self.closed = []

    def reg_mr(self, addr, length, access):
        self.log.append((addr, length, access))
        return _MR(self, addr, length, access)


def test_mr_cache_registers_a_whole_numpy_allocation_once():
    pd = _PD()
    cache = MrCache(pd, access=C.ACCESS_LOCAL_WRITE)
    kv = np.zeros((8, 4096), dtype=np.uint8)
    views = [memoryview(kv[i]) for i in range(8)]
    keys = {cache.lookup(v)[1] for v in views}
    assert len(pd.log) == 1 and len(keys) == 1
    assert pd.log[0] == (buffer_address(memoryview(kv)), kv.nbytes, C.ACCESS_LOCAL_WRITE)
    addr, _ = cache.lookup(memoryview(kv[3, 100:200]))
    assert addr == buffer_address(memoryview(kv)) + 3 * 4096 + 100
    assert cache.hits == 8 and cache.registrations == 1
    cache.close()
    assert pd.closed == [(pd.log[0][0], kv.nbytes)] and len(cache) == 0


def test_mr_cache_keeps_owners_alive_and_reregisters_moved_memory():
    pd = _PD()
    cache = MrCache(pd, access=C.ACCESS_LOCAL_WRITE)
    b = bytearray(1000)
    cache.lookup(memoryview(b))
    cache.lookup(memoryview(b)[10:20])
    assert len(pd.log) == 1
    b.extend(bytes(1 << 20))   # reallocates: the old registration no longer covers it
    cache.lookup(memoryview(b)[:2000])
    assert len(pd.log) == 2
    data = b"x" * 4096
    cache.lookup(memoryview(data))
    assert any(e.owner is data for e in cache._lru.values())
    cache.close()


def test_mr_cache_registers_read_only_buffers_without_local_write():
    pd = _PD()
    cache = MrCache(pd, access=C.ACCESS_LOCAL_WRITE)
    a = np.zeros(8192, np.uint8)
    ro = a.view()
    ro.flags.writeable = False
    cache.lookup(memoryview(ro))
    assert pd.log[-1][2] == 0
    cache.lookup(memoryview(ro)[100:])        # read-only again: the same region
    assert len(pd.log) == 1
    cache.lookup(memoryview(a)[:10])          # a READ destination needs LOCAL_WRITE
    assert len(pd.log) == 2 and pd.log[-1][2] == C.ACCESS_LOCAL_WRITE
    cache.lookup(memoryview(ro))              # a writable region serves reads too
    assert len(pd.log) == 2
    cache.close()


def test_mr_cache_evicts_lru_but_not_the_current_batch():
    pd = _PD()
    cache = MrCache(pd, access=1, max_bytes=10_000)
    a, b, c = (np.zeros(4000, np.uint8) for _ in range(3))
    cache.next_batch()
    cache.lookup(memoryview(a))
    cache.lookup(memoryview(b))
    cache.lookup(memoryview(c))   # same batch: nothing may go, the bound is passed
    assert cache.bytes == 12_000 and not pd.closed
    cache.next_batch()
    d = np.zeros(4000, np.uint8)
    cache.lookup(memoryview(d))   # new batch: the least recently used go first
    assert cache.bytes <= 10_000 and pd.closed[0][1] == 4000
    cache.close()


def test_mr_cache_forget():
    pd = _PD()
    cache = MrCache(pd, access=1)
    a = np.zeros(4096, np.uint8)
    cache.lookup(memoryview(a))
    cache.forget(a)
    assert len(cache) == 0 and cache.bytes == 0 and pd.closed == [(pd.log[0][0], 4096)]
    cache.lookup(memoryview(a))
    assert len(pd.log) == 2
    cache.close()


def test_mr_cache_registers_huge_allocations_by_range():
    pd = _PD()
    cache = MrCache(pd, access=1, whole_max=1 << 16)
    big = np.zeros(1 << 20, np.uint8)
    cache.lookup(memoryview(big[4096:8192]))
    assert pd.log[0][1] == 4096
    cache.close()


# ----------------------------------------------------------------------------- options


def test_rdma_options_coerce_and_validate():
    assert RdmaOptions.coerce(None) == RdmaOptions()
    o = RdmaOptions.coerce({"dev_name": "mlx5_0", "gid_index": 3})
    assert o.dev_name == "mlx5_0" and o.gid_index == 3
    with pytest.raises(TypeError, match="unknown RDMA option"):
        RdmaOptions.coerce({"device": "x"})
    with pytest.raises(TypeError):
        RdmaOptions.coerce("mlx5_0")
    for bad in ({"ib_port": 0}, {"max_send_wr": 0}, {"poll_timeout": 0},
                {"gid_index": -1}, {"max_outstanding": 0}):
        with pytest.raises(ValueError):
            RdmaOptions.coerce(bad)


# ----------------------------------------------------------------------------- devices


def test_open_port_names_the_device_and_the_cause(tmp_path):
    v = FakeVerbs(str(tmp_path), [FakeDevice("fake0"),
                                  FakeDevice("down0", state=1),
                                  FakeDevice("ib0", link_layer="IB", lid=0,
                                             gids=ib_gids())])
    with pytest.raises(DeviceError, match=r"RDMA device mlx5_0: no such device .*fake0"):
        open_port(v, "mlx5_0")
    with pytest.raises(DeviceError, match="RDMA device down0: port 1 is DOWN"):
        open_port(v, "down0")
    with pytest.raises(DeviceError, match="has no port 2"):
        open_port(v, "fake0", 2)
    with pytest.raises(DeviceError, match="--link-type IB was given but port 1 is Ethernet"):
        open_port(v, "fake0", link_type="ib")
    with pytest.raises(DeviceError, match="no LID"):
        open_port(v, "ib0")
    p = open_port(v, None)   # the first usable device
    assert p.device == "fake0" and p.gid.index == 3 and "RoCEv2 gid 3" in p.describe()
    p.close()
    nodev = FakeVerbs(str(tmp_path), list_error=no_device_cause())
    with pytest.raises(DeviceError, match="RDMA device mlx5_0: .*no RDMA devices|"
                                          "RDMA device mlx5_0: .*infiniband"):
        open_port(nodev, "mlx5_0")
    v.close()


def test_port_info_state_name():
    assert PortInfo(4, 0, "IB", 4096, 1, 1).state_name == "ACTIVE"


# ----------------------------------------------------------------------------- config / CLI


def test_server_config_validates_rdma_options():
    from kvshm.server import ConfigError, ServerConfig

    ServerConfig(dev_name="mlx5_0", ib_port=2, link_type="roce", gid_index=3).validate()
    for kw, opt in (({"dev_name": ""}, "dev_name"), ({"ib_port": 0}, "ib_port"),
                    ({"link_type": "fddi"}, "link_type"), ({"gid_index": -2}, "gid_index")):
        with pytest.raises(ConfigError) as ei:
            ServerConfig(**kw).validate()
        assert ei.value.option == opt
    c = ServerConfig(link_type="eth")
    c.validate()
    assert c.link_type == "Ethernet"


def test_cli_flags_map_to_the_config():
    from kvshm.cli import add_server_flags, config_from_args

    p = argparse.ArgumentParser()
    add_server_flags(p)
    cfg = config_from_args(p.parse_args(["--dev-name", "mlx5_0", "--ib-port", "2",
                                         "--link-type", "IB", "--gid-index", "3"]))
    assert (cfg.dev_name, cfg.ib_port, cfg.link_type, cfg.gid_index) == ("mlx5_0", 2, "IB", 3)
    cfg = config_from_args(p.parse_args([]))
    assert (cfg.dev_name, cfg.ib_port, cfg.link_type, cfg.gid_index) == (None, 1, None, None)
    for bad in (["--ib-port", "0"], ["--link-type", "fddi"], ["--gid-index", "-1"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
