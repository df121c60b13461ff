"""The attention client: the attention side locally, routed experts on expert servers, with failover."""

from eaas.runtime.client.attention_client import AttentionClient
from eaas.runtime.client.errors import ExpertUnavailable, HandshakeError
from eaas.runtime.client.remote_experts import ClientOptions, FailoverEvent, RemoteExperts
from eaas.runtime.client.routing import RoutingTable, Share

__all__ = [
    "AttentionClient",
    "ClientOptions",
    "ExpertUnavailable",
    "FailoverEvent",
    "HandshakeError",
    "RemoteExperts",
    "RoutingTable",
    "Share",
]
