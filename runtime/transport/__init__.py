"""Transports of the slot protocol, chosen by name: ``shm`` (same host) and ``tcp`` (any host)."""

from eaas.runtime.transport.base import (
    Channel,
    ChannelClosed,
    ChannelError,
    ChannelTimeout,
    RemoteError,
    Request,
    ServerTransport,
    SlotsExhausted,
    TransportOptions,
)
from eaas.runtime.transport.registry import TransportSpec, get_transport, register_transport, transport_names

__all__ = [
    "Channel",
    "ChannelClosed",
    "ChannelError",
    "ChannelTimeout",
    "RemoteError",
    "Request",
    "ServerTransport",
    "SlotsExhausted",
    "TransportOptions",
    "TransportSpec",
    "get_transport",
    "register_transport",
    "transport_names",
]
