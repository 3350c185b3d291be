"""The SSD tier's manifest (``--ssd-persist``): what a restarted server serves again.

``DIR/kvshm-ssd.manifest`` is a header (magic, version, body length, xxh64 of the body)
and a msgpack body: the block size, the files (name, blocks) it was written for, and one
record ``[key, file, start block, size, xxh64 of the value]`` per stored entry, least
recently used first. It is replaced atomically (written to a temporary file, fsync'ed,
renamed, directory fsync'ed) after the data files were made durable, so a crash leaves
the previous manifest or the new one, never a torn one; a manifest written for other
files, torn or corrupt is ignored (and removed). The checksum of each value is checked
again on every read, so a record whose blocks were overwritten since is never served.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import Any, Sequence

import msgpack
import xxhash

from kvshm.tiers.ssd.files import DATA_FMT, MANIFEST_NAME, SsdFile, remove_file

__all__ = ["Record", "load", "pack", "write"]

log = logging.getLogger(__name__)

_MAGIC = b"KVSHMSSD"
_MANIFEST_VERSION = 1
_HDR = struct.Struct("<8sIQQ")   # magic, version, body length, xxh64(body)

#: ``(key, file index, start block, size, xxh64)`` of one stored entry.
Record = tuple[bytes, int, int, int, int]


def _geometry(files: Sequence[SsdFile]) -> list[list[Any]]:
    return [[DATA_FMT.format(f.index), f.nblocks] for f in files]


def load(path: str, block_size: int, files: Sequence[SsdFile]) -> list[Any] | None:
    """The records of the manifest in directory ``path`` (unchecked: each may be out of
    range), or None when there is none or it cannot be used (logged; a manifest written
    for other files, torn or corrupt is removed)."""
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        with open(mpath, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("SSD tier: cannot read manifest %s (%s); starting empty", mpath, exc)
        return None
    try:
        magic, version, n, csum = _HDR.unpack_from(data)
        body = data[_HDR.size:_HDR.size + n]
        if magic != _MAGIC or version != _MANIFEST_VERSION:
            raise ValueError("not a kvshm SSD manifest of this version")
        if len(body) != n or xxhash.xxh64_intdigest(body) != csum:
            raise ValueError("torn or corrupt (checksum mismatch)")
        m = msgpack.unpackb(body, raw=False, strict_map_key=False)
        geometry = _geometry(files)
        if m["block_size"] != block_size or m["files"] != geometry:
            raise ValueError(f"written for other files (block size {m['block_size']}, "
                             f"files {m['files']}; now {block_size}, {geometry})")
        entries = m["entries"]
    except (ValueError, KeyError, TypeError, struct.error,
            msgpack.UnpackException) as exc:
        log.warning("SSD tier: ignoring manifest %s: %s; starting empty", mpath, exc)
        remove_file(mpath)         # the files were resized / will be overwritten
        return None
    return list(entries)


def pack(block_size: int, files: Sequence[SsdFile], recs: list[Record]) -> bytes:
    """The manifest's bytes for ``recs``."""
    body = msgpack.packb({
        "block_size": block_size,
        "files": _geometry(files),
        "written": time.time(),
        "entries": recs}, use_bin_type=True)
    return _HDR.pack(_MAGIC, _MANIFEST_VERSION, len(body),
                     xxhash.xxh64_intdigest(body)) + body


def write(path: str, block_size: int, files: Sequence[SsdFile], recs: list[Record]) -> None:
    """Data files durable first, then the manifest (atomically replaced). Raises OSError."""
    data = pack(block_size, files, recs)
    for f in files:
        if not f.disabled:
            os.fdatasync(f.fd)
    mpath = os.path.join(path, MANIFEST_NAME)
    tmp = mpath + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, mpath)
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
