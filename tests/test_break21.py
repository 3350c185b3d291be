"""break21: the packed ALLOC + COMMIT put path (client._Packed -> ShmMover.write ->
Pool.write_values) against hostile ALLOC offsets, compared with KVSHM_PACKED_PUT=0."""
from __future__ import annotations

import pytest

from kvshm import _batch
from kvshm._pool import PackedValues, Pool
from kvshm.client import _Buffers, _Packed, byte_view
from kvshm.movers import ShmMover

BLOCK = 4096


def _packed(keys, values):
    sizes, frames, counts = _batch.pack_values(keys, values, 1 << 20, 0, byte_view,
                                                ValueError)
    return _Packed(keys, PackedValues.of(frames, counts, sizes), sizes)


@pytest.mark.parametrize("bad", [-1, -4096, 16 * BLOCK, 16 * BLOCK - 3])
def test_packed_refuses_an_ok_key_offset_the_old_path_refuses(shm_name, bad):
    """An ALLOC reply granting an OK key a negative offset: the old path (write_many)
    raises; the packed path read -1 as 'refused, skip' and the COMMIT then published
    blocks never written (another key's bytes). Both must raise, nothing written."""
    keys = [b"a", b"b", b"c"]
    vals = [b"x" * 10, bytearray(b"y" * 20), memoryview(b"0123456789z" * 3)[1:]]
    with Pool.create(shm_name, 16 * BLOCK, block_size=BLOCK) as p:
        m = ShmMover(p)
        with pytest.raises((IndexError, ValueError)):
            _Buffers(keys, [byte_view(v) for v in vals],
                     [len(byte_view(v)) for v in vals]).to_pool(m, [0, bad, 2 * BLOCK],
                                                                [0, 1, 2])
        with pytest.raises((IndexError, ValueError)):
            _packed(keys, vals).to_pool(m, [0, bad, 2 * BLOCK], [0, 1, 2])


def test_packed_refused_middle_key_held(shm_name):
    keys = [b"a", b"b", b"c"]
    vals = [b"x" * 10, b"", bytearray(b"z" * 5000)]
    with Pool.create(shm_name, 16 * BLOCK, block_size=BLOCK) as p:
        m = ShmMover(p)
        _packed(keys, vals).to_pool(m, [0, 2 * BLOCK], [0, 2])
        assert p.read_bytes_many([0, 2 * BLOCK], [10, 5000]) == [b"x" * 10, b"z" * 5000]
