"""kvshm.rdma against real pyverbs objects that need no device: the constants, SGE and
send work-request building, QP attributes, work completions, GID table entries, the lazy
loader, and the error a host without RDMA gives.

Skipped, with the reason, where pyverbs cannot be imported (install python3-pyverbs;
.ci/run does). A device is never needed here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvshm.rdma import constants as C
from kvshm.rdma.device import select_gid
from kvshm.rdma.errors import CompletionError, DeviceError
from kvshm.rdma.qp import QpInfo, init_attrs, rtr_attrs, rts_attrs
from kvshm.rdma.verbs import (Completion, QpCaps, completion_of, device_caps_of,
                              gid_entry_of, load_pyverbs, port_info_of, qp_attr,
                              qp_init_attr, send_wrs, sge_list)
from kvshm.rdma.wr import Segment, plan

try:
    pv = load_pyverbs()
except DeviceError as _exc:
    pytest.skip(f"pyverbs is not importable here: {_exc}", allow_module_level=True)

e = pv.enums


def _v4(ip):
    return bytes(10) + b"\xff\xff" + bytes(int(x) for x in ip.split("."))


# ----------------------------------------------------------------------------- constants


@pytest.mark.parametrize("ours,theirs", [
    ("ACCESS_LOCAL_WRITE", "IBV_ACCESS_LOCAL_WRITE"),
    ("ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_WRITE"),
    ("ACCESS_REMOTE_READ", "IBV_ACCESS_REMOTE_READ"),
    ("WR_RDMA_WRITE", "IBV_WR_RDMA_WRITE"), ("WR_RDMA_READ", "IBV_WR_RDMA_READ"),
    ("SEND_SIGNALED", "IBV_SEND_SIGNALED"), ("QPT_RC", "IBV_QPT_RC"),
    ("QPS_RESET", "IBV_QPS_RESET"), ("QPS_INIT", "IBV_QPS_INIT"),
    ("QPS_RTR", "IBV_QPS_RTR"), ("QPS_RTS", "IBV_QPS_RTS"), ("QPS_ERR", "IBV_QPS_ERR"),
    ("QP_STATE", "IBV_QP_STATE"), ("QP_ACCESS_FLAGS", "IBV_QP_ACCESS_FLAGS"),
    ("QP_PKEY_INDEX", "IBV_QP_PKEY_INDEX"), ("QP_PORT", "IBV_QP_PORT"),
    ("QP_AV", "IBV_QP_AV"), ("QP_PATH_MTU", "IBV_QP_PATH_MTU"),
    ("QP_TIMEOUT", "IBV_QP_TIMEOUT"), ("QP_RETRY_CNT", "IBV_QP_RETRY_CNT"),
    ("QP_RNR_RETRY", "IBV_QP_RNR_RETRY"), ("QP_RQ_PSN", "IBV_QP_RQ_PSN"),
    ("QP_MAX_QP_RD_ATOMIC", "IBV_QP_MAX_QP_RD_ATOMIC"),
    ("QP_MIN_RNR_TIMER", "IBV_QP_MIN_RNR_TIMER"), ("QP_SQ_PSN", "IBV_QP_SQ_PSN"),
    ("QP_MAX_DEST_RD_ATOMIC", "IBV_QP_MAX_DEST_RD_ATOMIC"),
    ("QP_DEST_QPN", "IBV_QP_DEST_QPN"), ("PORT_ACTIVE", "IBV_PORT_ACTIVE"),
    ("LINK_LAYER_INFINIBAND", "IBV_LINK_LAYER_INFINIBAND"),
    ("LINK_LAYER_ETHERNET", "IBV_LINK_LAYER_ETHERNET"),
    ("GID_TYPE_IB", "IBV_GID_TYPE_IB"), ("GID_TYPE_ROCE_V1", "IBV_GID_TYPE_ROCE_V1"),
    ("GID_TYPE_ROCE_V2", "IBV_GID_TYPE_ROCE_V2"),
    ("GID_TYPE_SYSFS_IB_ROCE_V1", "IBV_GID_TYPE_SYSFS_IB_ROCE_V1"),
    ("GID_TYPE_SYSFS_ROCE_V2", "IBV_GID_TYPE_SYSFS_ROCE_V2"),
])
def test_constants_match_pyverbs(ours, theirs):
    assert getattr(C, ours) == int(getattr(e, theirs))


def test_mtu_and_completion_status_tables_match_pyverbs():
    for n, size in C.MTU_BYTES.items():
        assert int(getattr(e, f"IBV_MTU_{size}")) == n
    for value, (name, cause) in C.WC_STATUS.items():
        assert int(getattr(e, name)) == value, name
        assert cause


def test_the_rc_masks_are_those_pyverbs_uses():
    # pyverbs' QP._get_comp_mask('INIT'/'RTR'/'RTS') for IBV_QPT_RC, from its source
    from kvshm.rdma.qp import INIT_MASK, RTR_MASK, RTS_MASK

    assert INIT_MASK == (e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS
                         | e.IBV_QP_STATE)
    assert RTR_MASK == (e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
                        | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC
                        | e.IBV_QP_MIN_RNR_TIMER | e.IBV_QP_STATE)
    assert RTS_MASK == (e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY
                        | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC | e.IBV_QP_STATE)


# ----------------------------------------------------------------------------- WRs


def test_sges_and_send_wrs_from_a_plan():
    segs = [Segment(0x10000 + i * 8192, 0x55 + (i % 2), 4096, 0x7F0000000000 + i * 4096, i)
            for i in range(6)]
    wrs = plan(segs, opcode=C.WR_RDMA_WRITE, rkey=0xABCD, max_sge=4, max_msg=1 << 30,
               signal_every=1)
    assert [len(w.sges) for w in wrs] == [4, 2]
    sges = sge_list(pv, wrs[0])
    assert [(s.addr, s.length, s.lkey) for s in sges] == \
        [(0x10000 + i * 8192, 4096, 0x55 + (i % 2)) for i in range(4)]
    chain = send_wrs(pv, wrs)
    assert len(chain) == 2
    for w, swr in zip(wrs, chain):
        assert isinstance(swr, pv.wr.SendWR)
        assert swr.wr_id == w.wr_id and swr.opcode == e.IBV_WR_RDMA_WRITE
        assert swr.num_sge == len(w.sges) and swr.send_flags == e.IBV_SEND_SIGNALED
        if hasattr(swr, "rdma_remote_addr"):   # newer pyverbs can read it back
            assert swr.rdma_remote_addr == w.remote_addr


def test_unsignalled_reads():
    segs = [Segment(0x1000, 1, 100, 0x9000 + i * 4096, i) for i in range(3)]
    wrs = plan(segs, opcode=C.WR_RDMA_READ, rkey=1, max_sge=1, max_msg=1 << 30,
               signal_every=8, wr_id_base=3 << 32)
    chain = send_wrs(pv, wrs)
    assert [w.send_flags for w in chain] == [0, 0, e.IBV_SEND_SIGNALED]
    assert [w.opcode for w in chain] == [e.IBV_WR_RDMA_READ] * 3
    assert [w.wr_id for w in chain] == [(3 << 32) + i for i in range(3)]


def test_qp_init_attr_for_an_rc_qp():
    ia = qp_init_attr(pv, QpCaps(max_send_wr=256, max_send_sge=16))
    assert ia.qp_type == e.IBV_QPT_RC and ia.sq_sig_all == 0
    assert (ia.cap.max_send_wr, ia.cap.max_send_sge, ia.cap.max_recv_wr) == (256, 16, 1)


# ----------------------------------------------------------------------------- QP attrs


def _info(**kw):
    d = dict(qpn=0x1234, psn=0x42, lid=0, gid=_v4("10.0.0.1"), mtu=4096,
             link_layer="Ethernet", rd_atomic=16)
    d.update(kw)
    return QpInfo(**d)


def test_qp_attr_roce_rtr():
    remote = _info(qpn=0x777, psn=0x99, gid=_v4("10.0.0.2"), mtu=1024)
    a = rtr_attrs(_info(), remote, port_num=1, sgid_index=3, responder_depth=16)
    qa = qp_attr(pv, a)
    assert qa.qp_state == e.IBV_QPS_RTR and qa.path_mtu == e.IBV_MTU_1024
    assert qa.dest_qp_num == 0x777 and qa.rq_psn == 0x99 and qa.max_dest_rd_atomic == 16
    assert qa.min_rnr_timer == 12
    ah = qa.ah_attr
    assert ah.is_global == 1 and ah.sgid_index == 3 and ah.hop_limit == 64
    assert ah.dgid == "0000:0000:0000:0000:0000:ffff:0a00:0002" and ah.dlid == 0
    assert ah.port_num == 1


def test_qp_attr_ib_rtr_and_init_rts():
    local = _info(link_layer="IB", lid=1, gid=b"\xfe\x80" + bytes(13) + b"\x01")
    remote = _info(link_layer="IB", lid=17, qpn=5, gid=b"\xfe\x80" + bytes(13) + b"\x02")
    qa = qp_attr(pv, rtr_attrs(local, remote, port_num=2, sgid_index=0, responder_depth=4))
    assert qa.ah_attr.is_global == 0 and qa.ah_attr.dlid == 17 and qa.ah_attr.port_num == 2
    qi = qp_attr(pv, init_attrs(port_num=2, access=C.ACCESS_REMOTE_READ |
                                C.ACCESS_REMOTE_WRITE))
    assert qi.qp_state == e.IBV_QPS_INIT and qi.port_num == 2 and qi.pkey_index == 0
    assert qi.qp_access_flags == e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
    qr = qp_attr(pv, rts_attrs(local, initiator_depth=8))
    assert (qr.qp_state, qr.sq_psn, qr.timeout, qr.retry_cnt, qr.rnr_retry,
            qr.max_rd_atomic) == (e.IBV_QPS_RTS, 0x42, 14, 7, 7, 8)


# ----------------------------------------------------------------------------- completions


@pytest.mark.parametrize("status", ["IBV_WC_RETRY_EXC_ERR", "IBV_WC_REM_ACCESS_ERR",
                                    "IBV_WC_WR_FLUSH_ERR", "IBV_WC_SUCCESS"])
def test_work_completions_map_to_errors(status):
    wc = pv.cq.WC(wr_id=(5 << 32) + 3, status=getattr(e, status),
                  opcode=e.IBV_WC_RDMA_READ, vendor_err=0x81)
    c = completion_of(wc)
    assert c == Completion((5 << 32) + 3, int(getattr(e, status)),
                           int(e.IBV_WC_RDMA_READ), 0x81)
    if c.status != C.WC_SUCCESS:
        err = CompletionError(op="RDMA READ", keys=[b"k"], status=c.status, peer="h:1",
                              vendor_err=c.vendor_err)
        assert status in str(err) and "b'k'" in str(err)


# ----------------------------------------------------------------------------- GIDs


def _gid_entry(gid: bytes, index: int, gid_type: int, ifindex: int = 0):
    # GIDEntry takes the raw (big-endian in memory) halves, as ibv_query_gid_table fills
    return pv.device.GIDEntry(int.from_bytes(gid[:8], "little"),
                              int.from_bytes(gid[8:], "little"), index, 1, gid_type, ifindex)


def test_gid_entries_and_selection_from_a_pyverbs_table():
    ll = b"\xfe\x80" + bytes(6) + bytes.fromhex("0202c9fffe000001")
    table = [_gid_entry(ll, 0, e.IBV_GID_TYPE_ROCE_V1),
             _gid_entry(ll, 1, e.IBV_GID_TYPE_ROCE_V2),
             _gid_entry(_v4("10.7.0.5"), 2, e.IBV_GID_TYPE_ROCE_V1),
             _gid_entry(_v4("10.7.0.5"), 3, e.IBV_GID_TYPE_ROCE_V2)]
    ours = [gid_entry_of(x) for x in table]
    assert [g.gid_type for g in ours] == ["RoCEv1", "RoCEv2", "RoCEv1", "RoCEv2"]
    assert ours[0].gid == ll and ours[3].ipv4 == "10.7.0.5"
    assert select_gid(ours, link_layer="Ethernet").index == 3
    ib = [gid_entry_of(_gid_entry(ll, 0, e.IBV_GID_TYPE_IB))]
    assert select_gid(ib, link_layer="IB").gid_type == "IB"


def test_port_and_device_attributes_map():
    port = SimpleNamespace(state=e.IBV_PORT_ACTIVE, lid=0, link_layer=e.IBV_LINK_LAYER_ETHERNET,
                           active_mtu=e.IBV_MTU_1024, max_msg_sz=1 << 30, gid_tbl_len=255)
    p = port_info_of(port)
    assert (p.link_layer, p.active_mtu, p.state_name) == ("Ethernet", 1024, "ACTIVE")
    dev = SimpleNamespace(max_qp_wr=32768, max_sge=30, max_sge_rd=0, max_qp_rd_atom=16,
                          max_qp_init_rd_atom=16, max_cqe=4194303, max_mr_size=1 << 64,
                          phys_port_cnt=1)
    d = device_caps_of(dev)
    assert d.max_sge_rd == 30 and d.max_qp_wr == 32768   # 0 means "as max_sge"
    # the real classes exist and read back zeros without a device
    assert pv.device.PortAttr().state == 0 and pv.device.DeviceAttr().max_qp_wr == 0


# ----------------------------------------------------------------------------- loading


def test_loader_exposes_only_pyverbs_from_the_distribution_directory(tmp_path):
    code = ("import sys\n"
            "from kvshm.rdma.verbs import load_pyverbs\n"
            "pv = load_pyverbs()\n"
            "print(pv.device.__file__)\n"
            "print(any(p.rstrip('/').endswith('dist-packages') and p.startswith('/usr/lib')"
            " for p in sys.path))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    where, leaked = r.stdout.split()
    assert where.endswith(".so") and "pyverbs" in where
    assert leaked == "False"


def _devices_listed() -> bool:
    try:
        return bool(pv.device.get_device_list())
    except pv.pyverbs_error.PyverbsError:
        return False


@pytest.mark.skipif(_devices_listed(), reason="this host lists RDMA devices")
def test_no_device_here_gives_a_cause():
    from kvshm import rdma
    from kvshm.rdma.verbs import PyverbsBackend

    with pytest.raises(DeviceError) as ei:
        PyverbsBackend().device_names()
    assert "RDMA" in str(ei.value) and ei.value.cause
    with pytest.raises(DeviceError) as ei:
        rdma.open_server_endpoint("mlx5_0", pool_bytes=1 << 20)
    assert str(ei.value).startswith("RDMA device mlx5_0: ")
    if not os.path.isdir("/sys/class/infiniband"):
        assert "/sys/class/infiniband does not exist" in str(ei.value)
