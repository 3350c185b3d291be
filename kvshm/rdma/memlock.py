"""RLIMIT_MEMLOCK: registering memory for RDMA pins it, and the kernel counts pinned
pages against this limit (unless the process has CAP_IPC_LOCK).

:func:`check_memlock` runs when the server starts with ``--dev-name``, before the pool is
registered, so a low limit is one clear line instead of an ``ENOMEM`` from
``ibv_reg_mr``.
"""

from __future__ import annotations

import resource

from kvshm.rdma.errors import MemlockError

__all__ = ["memlock_limit", "pinned_bytes", "has_cap_ipc_lock", "check_memlock",
           "available_bytes", "FIX"]

_CAP_IPC_LOCK = 14

#: How to raise the limit, for messages and docs.
FIX = ("raise it for the process that registers the memory: `ulimit -l unlimited` in the "
       "shell that starts it (allowed up to the hard limit), LimitMEMLOCK=infinity in a "
       "systemd unit, `--ulimit memlock=-1:-1` for docker, or a line "
       "`<user> - memlock unlimited` in /etc/security/limits.conf (then log in again)")


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _status_field(name: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024   # "VmPin:   123 kB"
    except (OSError, ValueError):
        pass
    return 0


def pinned_bytes() -> int:
    """Bytes this process has pinned already (VmPin of /proc/self/status: the counter that
    ibv_reg_mr's pinning is checked against; mlock's VmLck is counted apart)."""
    return _status_field("VmPin")


def has_cap_ipc_lock() -> bool:
    """Whether this process has CAP_IPC_LOCK in its effective set (no limit then)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def available_bytes() -> int | None:
    """Bytes this process may still pin, or None when there is no limit."""
    if has_cap_ipc_lock():
        return None
    limit = memlock_limit()
    if limit is None:
        return None
    return max(0, limit - pinned_bytes())


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} bytes"


def check_memlock(nbytes: int, *, what: str = "the pool", limit: int | None = -1,
                  pinned: int | None = None, cap_ipc_lock: bool | None = None) -> None:
    """Raise :class:`MemlockError` when pinning ``nbytes`` more would pass the limit.

    ``limit`` (bytes, None = unlimited), ``pinned`` and ``cap_ipc_lock`` default to this
    process's values; tests pass them.
    """
    if cap_ipc_lock is None:
        cap_ipc_lock = has_cap_ipc_lock()
    if cap_ipc_lock:
        return
    if limit == -1:
        limit = memlock_limit()
    if limit is None:
        return
    if pinned is None:
        pinned = pinned_bytes()
    if pinned + nbytes <= limit:
        return
    already = f" ({_fmt(pinned)} of it pinned already)" if pinned else ""
    raise MemlockError(
        f"RLIMIT_MEMLOCK is {_fmt(limit)}{already}, but registering {what} for RDMA pins "
        f"{_fmt(nbytes)}: {FIX}")
