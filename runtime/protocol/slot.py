"""Slot states and the byte layout of one slot: ``[flag | header | payload]``.

| offset | bytes | what |
|---|---|---|
| ``FLAG_OFFSET`` = 0 | 4 | ``SlotState`` as a little-endian u32 |
| ``HEADER_OFFSET`` = 16 | 48 | ``SlotHeader`` |
| ``PAYLOAD_OFFSET`` = 64 | capacity | request or response payload |

Header and payload are contiguous (``[16, 64 + payload_bytes)``), so a stream transport sends a
frame straight from the slot. The writer of a slot writes header and payload first and the flag
last; the reader reads the flag first. Slots are padded to whole pages so two slots never share a
cache line.
"""

from __future__ import annotations

from enum import IntEnum

from eaas.runtime.protocol.header import HEADER_SIZE

FLAG_OFFSET = 0
HEADER_OFFSET = 16
PAYLOAD_OFFSET = HEADER_OFFSET + HEADER_SIZE  # 64
PAGE = 4096


class SlotState(IntEnum):
    IDLE = 0  # the client may write a request
    REQUEST_READY = 1  # the client finished writing; the server may process
    RESPONSE_READY = 2  # the server wrote the result; the client may read
    OFFLINE = 3  # the client is gone; the slot is released
    SERVING = 4  # the server took the request and computes it (transports whose GPU writes the answer)


def slot_stride(capacity_bytes: int) -> int:
    """Bytes one slot occupies for a payload capacity, rounded up to whole pages."""
    return -(-(PAYLOAD_OFFSET + capacity_bytes) // PAGE) * PAGE
