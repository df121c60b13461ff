"""The slot protocol: slot states, the binary header, payload layout and strict validation.

Every transport, the expert server and the attention client import these definitions; nothing
else defines them (DESIGN.md, "One type per concept").
"""

from eaas.runtime.protocol.errors import ProtocolError
from eaas.runtime.protocol.header import (
    HEADER_SIZE,
    MAGIC,
    VERSION,
    DType,
    FrameKind,
    SlotHeader,
    Status,
    dtype_code,
    torch_dtype,
)
from eaas.runtime.protocol.payload import (
    MAX_MESSAGE_BYTES,
    RequestLayout,
    RequestWriter,
    is_staged,
    read_message,
    read_request,
    read_response,
    request_layout,
    response_bytes,
    slot_capacity_bytes,
    staged_x,
    write_message,
    write_request,
    write_response,
)
from eaas.runtime.protocol.slot import FLAG_OFFSET, HEADER_OFFSET, PAYLOAD_OFFSET, SlotState, slot_stride
from eaas.runtime.protocol.validate import (
    ServerLimits,
    check_experts,
    check_framing,
    check_request,
    check_response,
)

__all__ = [
    "FLAG_OFFSET",
    "HEADER_OFFSET",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "PAYLOAD_OFFSET",
    "VERSION",
    "DType",
    "FrameKind",
    "ProtocolError",
    "RequestLayout",
    "RequestWriter",
    "ServerLimits",
    "SlotHeader",
    "SlotState",
    "Status",
    "check_experts",
    "check_framing",
    "check_request",
    "check_response",
    "dtype_code",
    "is_staged",
    "read_message",
    "read_request",
    "read_response",
    "request_layout",
    "response_bytes",
    "slot_capacity_bytes",
    "slot_stride",
    "staged_x",
    "torch_dtype",
    "write_message",
    "write_request",
    "write_response",
]
