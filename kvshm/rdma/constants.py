"""Numeric verbs constants used by the pure modules of :mod:`kvshm.rdma`.

These are the values of ``<infiniband/verbs.h>`` (a stable ABI: libibverbs never
renumbers them). The pure modules (work-request planning, QP attributes, completion
mapping) use them so that they, and the tests' verbs double, run without pyverbs;
``tests/test_rdma_pyverbs.py`` checks every value here against ``pyverbs.enums``.
"""

from __future__ import annotations

__all__ = [
    "ACCESS_LOCAL_WRITE", "ACCESS_REMOTE_WRITE", "ACCESS_REMOTE_READ",
    "WR_RDMA_WRITE", "WR_RDMA_READ", "SEND_SIGNALED",
    "QPT_RC", "QPS_RESET", "QPS_INIT", "QPS_RTR", "QPS_RTS", "QPS_ERR",
    "QP_STATE", "QP_ACCESS_FLAGS", "QP_PKEY_INDEX", "QP_PORT", "QP_AV", "QP_PATH_MTU",
    "QP_TIMEOUT", "QP_RETRY_CNT", "QP_RNR_RETRY", "QP_RQ_PSN", "QP_MAX_QP_RD_ATOMIC",
    "QP_MIN_RNR_TIMER", "QP_SQ_PSN", "QP_MAX_DEST_RD_ATOMIC", "QP_DEST_QPN",
    "PORT_ACTIVE", "PORT_STATES", "LINK_LAYER_INFINIBAND", "LINK_LAYER_ETHERNET",
    "GID_TYPE_IB", "GID_TYPE_ROCE_V1", "GID_TYPE_ROCE_V2",
    "GID_TYPE_SYSFS_IB_ROCE_V1", "GID_TYPE_SYSFS_ROCE_V2",
    "MTU_BYTES", "mtu_enum", "mtu_bytes",
    "WC_SUCCESS", "WC_WR_FLUSH_ERR", "WC_RETRY_EXC_ERR", "WC_REM_ACCESS_ERR",
    "WC_STATUS", "wc_status_name", "wc_status_cause",
]

# enum ibv_access_flags
ACCESS_LOCAL_WRITE = 1
ACCESS_REMOTE_WRITE = 2
ACCESS_REMOTE_READ = 4

# enum ibv_wr_opcode, ibv_send_flags
WR_RDMA_WRITE = 0
WR_RDMA_READ = 4
SEND_SIGNALED = 2

# enum ibv_qp_type, ibv_qp_state
QPT_RC = 2
QPS_RESET = 0
QPS_INIT = 1
QPS_RTR = 2
QPS_RTS = 3
QPS_ERR = 6

# enum ibv_qp_attr_mask
QP_STATE = 1 << 0
QP_ACCESS_FLAGS = 1 << 3
QP_PKEY_INDEX = 1 << 4
QP_PORT = 1 << 5
QP_AV = 1 << 7
QP_PATH_MTU = 1 << 8
QP_TIMEOUT = 1 << 9
QP_RETRY_CNT = 1 << 10
QP_RNR_RETRY = 1 << 11
QP_RQ_PSN = 1 << 12
QP_MAX_QP_RD_ATOMIC = 1 << 13
QP_MIN_RNR_TIMER = 1 << 15
QP_SQ_PSN = 1 << 16
QP_MAX_DEST_RD_ATOMIC = 1 << 17
QP_DEST_QPN = 1 << 20

# enum ibv_port_state
PORT_ACTIVE = 4
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}

# IBV_LINK_LAYER_*
LINK_LAYER_INFINIBAND = 1
LINK_LAYER_ETHERNET = 2

# enum ibv_gid_type (ibv_query_gid_table) and ibv_gid_type_sysfs (ibv_query_gid_type)
GID_TYPE_IB = 0
GID_TYPE_ROCE_V1 = 1
GID_TYPE_ROCE_V2 = 2
GID_TYPE_SYSFS_IB_ROCE_V1 = 0
GID_TYPE_SYSFS_ROCE_V2 = 1

# enum ibv_mtu -> bytes
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_MTU_ENUM = {v: k for k, v in MTU_BYTES.items()}


def mtu_bytes(mtu_enum_value: int) -> int:
    """Bytes of an ``enum ibv_mtu`` value (``IBV_MTU_4096`` = 5 -> 4096)."""
    try:
        return MTU_BYTES[mtu_enum_value]
    except KeyError:
        raise ValueError(f"{mtu_enum_value!r} is not an ibv_mtu value (1-5)") from None


def mtu_enum(nbytes: int) -> int:
    """The ``enum ibv_mtu`` value of an MTU in bytes (4096 -> ``IBV_MTU_4096`` = 5)."""
    try:
        return _MTU_ENUM[nbytes]
    except KeyError:
        raise ValueError(f"{nbytes!r} is not an RDMA MTU (256, 512, 1024, 2048, 4096)"
                         ) from None


# enum ibv_wc_status: value -> (name, what it means for a kvshm transfer)
WC_SUCCESS = 0
WC_WR_FLUSH_ERR = 5
WC_REM_ACCESS_ERR = 10
WC_RETRY_EXC_ERR = 12

WC_STATUS: dict[int, tuple[str, str]] = {
    0: ("IBV_WC_SUCCESS", "success"),
    1: ("IBV_WC_LOC_LEN_ERR", "local length error: a work request is longer than the "
        "port's maximum message size"),
    2: ("IBV_WC_LOC_QP_OP_ERR", "local QP operation error: the work request is not valid "
        "for this QP, a bad opcode or too many scatter/gather entries"),
    3: ("IBV_WC_LOC_EEC_OP_ERR", "local EE context operation error"),
    4: ("IBV_WC_LOC_PROT_ERR", "local protection error: a local buffer is not inside a "
        "memory region registered with this protection domain"),
    5: ("IBV_WC_WR_FLUSH_ERR", "flushed: the queue pair was already in the error state "
        "because of an earlier failure, so this work request was not executed"),
    6: ("IBV_WC_MW_BIND_ERR", "memory window bind error"),
    7: ("IBV_WC_BAD_RESP_ERR", "bad response from the remote side"),
    8: ("IBV_WC_LOC_ACCESS_ERR", "local access error: the local memory region does not "
        "allow this access; RDMA READ needs LOCAL_WRITE"),
    9: ("IBV_WC_REM_INV_REQ_ERR", "remote invalid request: the server's QP refused the "
        "request, too many outstanding RDMA READs or a message longer than it accepts"),
    10: ("IBV_WC_REM_ACCESS_ERR", "remote access error: the server refused the rkey or "
         "the address range; the pool's memory region was deregistered, the server "
         "restarted, or the offset is outside the pool"),
    11: ("IBV_WC_REM_OP_ERR", "remote operation error: the server's QP could not complete "
         "the operation"),
    12: ("IBV_WC_RETRY_EXC_ERR", "transport retry counter exceeded: the server's NIC did "
         "not acknowledge; the server is gone, its QP was destroyed, or there is no route "
         "between the ports (check the GID index, the subnet and the link)"),
    13: ("IBV_WC_RNR_RETRY_EXC_ERR", "receiver-not-ready retry counter exceeded"),
    14: ("IBV_WC_LOC_RDD_VIOL_ERR", "local RDD violation"),
    15: ("IBV_WC_REM_INV_RD_REQ_ERR", "remote invalid RD request"),
    16: ("IBV_WC_REM_ABORT_ERR", "remote aborted the operation"),
    17: ("IBV_WC_INV_EECN_ERR", "invalid EE context number"),
    18: ("IBV_WC_INV_EEC_STATE_ERR", "invalid EE context state"),
    19: ("IBV_WC_FATAL_ERR", "fatal error of the local device"),
    20: ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout"),
    21: ("IBV_WC_GENERAL_ERR", "general error of the local device"),
}


def wc_status_name(status: int) -> str:
    """``IBV_WC_*`` name of a completion status (``IBV_WC_STATUS_<n>`` if unknown)."""
    entry = WC_STATUS.get(status)
    return entry[0] if entry else f"IBV_WC_STATUS_{status}"


def wc_status_cause(status: int) -> str:
    """A sentence saying what a completion status means for a transfer."""
    entry = WC_STATUS.get(status)
    return entry[1] if entry else f"unknown completion status {status}"
