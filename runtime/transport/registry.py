"""Transports by name: ``shm`` and ``tcp`` (host memory), ``cuda_ipc`` (GPU memory, one node),
``nixl`` (NIXL one-sided writes over UCX: any hosts; needs the ``eaas[nixl]`` extra).

Importing them needs no GPU and no NIXL: the CUDA driver bindings are loaded when a GPU transport
is used, the NIXL library when a ``nixl`` server or channel is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaas.runtime.transport.base import Channel, ServerTransport
from eaas.runtime.transport.cuda_ipc_client import CudaIpcChannel
from eaas.runtime.transport.cuda_ipc_server import CudaIpcServerTransport
from eaas.runtime.transport.nixl_client import NixlChannel
from eaas.runtime.transport.nixl_server import NixlServerTransport
from eaas.runtime.transport.shm_client import ShmChannel
from eaas.runtime.transport.shm_server import ShmServerTransport
from eaas.runtime.transport.tcp_client import TcpChannel
from eaas.runtime.transport.tcp_server import TcpServerTransport


@dataclass(frozen=True)
class TransportSpec:
    name: str
    server: type[ServerTransport]
    channel: type[Channel]
    needs_gpu: bool = False  # slots in GPU memory: only servers and clients on a GPU can use it


_TRANSPORTS: dict[str, TransportSpec] = {
    "shm": TransportSpec("shm", ShmServerTransport, ShmChannel),
    "tcp": TransportSpec("tcp", TcpServerTransport, TcpChannel),
    "cuda_ipc": TransportSpec("cuda_ipc", CudaIpcServerTransport, CudaIpcChannel, needs_gpu=True),
    "nixl": TransportSpec("nixl", NixlServerTransport, NixlChannel),
}


def register_transport(spec: TransportSpec) -> None:
    _TRANSPORTS[spec.name] = spec


def transport_names() -> list[str]:
    return sorted(_TRANSPORTS)


def host_transport_names() -> list[str]:
    """The transports whose slots are in host memory: usable by any process, CPU or GPU."""
    return sorted(name for name, spec in _TRANSPORTS.items() if not spec.needs_gpu)


def get_transport(name: str) -> TransportSpec:
    try:
        return _TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"transport: must be one of {', '.join(transport_names())}, got {name!r}") from None
