"""Transports of the slot protocol, chosen by name: ``shm`` (same host), ``tcp`` and ``nixl`` (any host),
``cuda_ipc`` (GPU, one node)."""

from eaas.runtime.transport.base import (
    Channel,
    ChannelClosed,
    ChannelError,
    ChannelTimeout,
    Offer,
    OfferRefused,
    RemoteError,
    Request,
    ServerTransport,
    SlotsExhausted,
    TransportOptions,
)
from eaas.runtime.transport.registry import (
    TransportSpec,
    get_transport,
    host_transport_names,
    register_transport,
    transport_names,
)

__all__ = [
    "Channel",
    "ChannelClosed",
    "ChannelError",
    "ChannelTimeout",
    "Offer",
    "OfferRefused",
    "RemoteError",
    "Request",
    "ServerTransport",
    "SlotsExhausted",
    "TransportOptions",
    "TransportSpec",
    "get_transport",
    "host_transport_names",
    "register_transport",
    "transport_names",
]
