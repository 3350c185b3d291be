"""break15: hostile input against the batch PUT fast paths merged by batchp
(``_batch.pack_request``, ``_index.put_packed``, ``BitmapAllocator.alloc_runs`` /
``free_runs``, ``_batch.scan_plain``). Each test failed on main before its fix."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, encode_request

_BODY = {"keys": [b"k%02d" % i for i in range(20)], "sizes": [1] * 20, "counts": [20]}


@pytest.mark.parametrize("req_id, epoch", [
    (True, 3), (9, False), (9, 1.5), (9, 2.9), (None, 3), (9, "3"), (2**63, 3),
    (9, 2**64 - 1),
])
def test_pack_request_head_fields_as_msgpack(req_id: Any, epoch: Any) -> None:
    # pack_request took its head fields as C long long: a bool packed as 0/1, a float
    # truncated (2.9 -> 2: another epoch on the wire), None or a str a TypeError, an int
    # of 2**63 .. 2**64 - 1 an OverflowError, where msgpack packs each as it is
    try:
        want: Any = msgpack.packb([PROTOCOL_VERSION, int(Op.PUT), req_id, epoch, _BODY],
                                  use_bin_type=True)
    except Exception as exc:
        with pytest.raises(type(exc)):
            encode_request(Op.PUT, req_id, epoch, _BODY)
    else:
        assert encode_request(Op.PUT, req_id, epoch, _BODY) == want
