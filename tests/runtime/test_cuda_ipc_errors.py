"""``cuda_ipc`` and GPU servers refuse what cannot work with errors that say why (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaas.runtime.placement import round_robin
from eaas.runtime.server import ExpertServer
from eaas.runtime.transport import ChannelClosed, TransportOptions, get_transport, transport_names

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")


def test_cuda_ipc_is_a_registered_transport() -> None:
    assert "cuda_ipc" in transport_names()


def test_a_cuda_ipc_server_needs_a_gpu_device() -> None:
    options = TransportOptions(max_clients=1, capacity_bytes=4096, device="cpu")
    with pytest.raises(
        ValueError, match=r"slots live in GPU memory.*\(device cuda or cuda:N\), got device 'cpu'"
    ):
        get_transport("cuda_ipc").server(options)


@NO_CUDA
def test_a_client_without_cuda_cannot_open_a_cuda_ipc_slot() -> None:
    with pytest.raises(ChannelClosed, match="sees no CUDA device"):
        get_transport("cuda_ipc").channel.connect({"segment": "eaas-none", "slot": 0}, "127.0.0.1", 1.0)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "device: must be cpu, cuda or cuda:N, got 'tpu'"),
        pytest.param("cuda", "this process sees no CUDA device", marks=NO_CUDA),
    ],
)
def test_an_expert_server_names_a_device_it_cannot_use(
    device: str, message: str, tiny_checkpoints: dict[str, Path]
) -> None:
    checkpoint = tiny_checkpoints["mixtral"]
    placement = round_robin([0, 1], 8, 1)
    with pytest.raises(ValueError, match=message):
        ExpertServer.from_placement(checkpoint, placement, 0, device=device, transports=("tcp",))
