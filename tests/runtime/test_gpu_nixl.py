"""``nixl`` on a real GPU: expert servers as separate processes computing on the GPU, and clients
whose areas are GPU memory (the servers' slots then GPU memory too, frames split: headers in the
notifications; UCX ``cuda_ipc`` between the processes) or host memory.

- one MoE layer over nixl equals every expert computed in this process, for both kinds of client
  memory (GPU: the servers' GPU slots; host: their host slots, the request copied to the GPU
  there), at 1, 7 and 40 tokens (40 > max_tokens: several round trips);
- a request the server refuses comes back as a ``RemoteError`` with its message (carried in the
  notification: no WRITE), and the slot serves the next request;
- channels opened and closed while another holds the server's view of this client's agent;
- whole generations of an attention client equal the monolithic reference, and SIGKILL of a
  server mid-generation loses nothing (R = 2): the same tokens.

Tolerances as ``test_gpu_cuda_ipc``: float32 checkpoints, 2e-4 for layer outputs, 1e-4 for logits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from datapath_helpers import generation_survives_a_kill, gpu_cluster, gpu_local_experts, gpu_random_inputs

from eaas.runtime.client import ClientOptions
from eaas.runtime.client.connection import ServerConnection
from eaas.runtime.client.remote_experts import RemoteExperts
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import CheckpointReader
from eaas.runtime.transport import RemoteError, nixl_client
from eaas.runtime.transport.nixl_client import NixlChannel
from eaas.runtime.transport.nixl_endpoint import HOST, is_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not is_available(), reason="needs the NIXL library (eaas[nixl])"),
]

FAMILY = "deepseek_v3"


@pytest.fixture(scope="module")
def cluster(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with gpu_cluster(tiny_checkpoints[FAMILY], tmp_path_factory.mktemp("gpu-nixl"), "nixl") as cluster:
        yield cluster


@pytest.mark.parametrize("client_memory", ["VRAM", "DRAM"])
def test_layer_equals_local_experts(
    cluster: LocalCluster,
    tiny_checkpoints: dict[str, Path],
    client_memory: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if client_memory == "DRAM":  # a client without a GPU of its own: UCX moves host <-> GPU memory
        monkeypatch.setattr(nixl_client, "area_memory", lambda server: HOST)
    checkpoint = tiny_checkpoints[FAMILY]
    config = CheckpointReader(checkpoint).config
    local = gpu_local_experts(checkpoint)
    options = ClientOptions(transport="nixl", request_timeout_s=20.0)
    with RemoteExperts(config, cluster.placement, cluster.urls, options) as remote:
        for num_tokens in (1, 7, 40):
            for layer in config.moe_layers:
                x, ids, weights = gpu_random_inputs(
                    num_tokens, config.hidden_size, config.num_experts, config.top_k, layer
                )
                torch.testing.assert_close(
                    remote(layer, x, ids, weights), local(layer, x, ids, weights), rtol=2e-4, atol=2e-4
                )
        # A client in GPU memory gets GPU slots (split frames); one in host memory host slots.
        channels = [c.channel for c in remote.connections]
        assert all(isinstance(c, NixlChannel) for c in channels), channels
        assert {c.split for c in channels if isinstance(c, NixlChannel)} == {client_memory == "VRAM"}
        assert {c.offer_made.memory.kind for c in channels if isinstance(c, NixlChannel)} == {client_memory}
        assert {c.handle["memory"] for c in remote.connections} == {client_memory}
        assert remote.counters.failovers == 0


def test_a_refused_request_comes_back_with_its_message(
    cluster: LocalCluster, tiny_checkpoints: dict[str, Path]
) -> None:
    checkpoint = tiny_checkpoints[FAMILY]
    config = CheckpointReader(checkpoint).config
    local = gpu_local_experts(checkpoint)
    conn = ServerConnection(0, cluster.urls[0], "nixl", "refused", 20.0, 5.0)
    conn.connect()
    try:
        channel = conn.channel
        assert isinstance(channel, NixlChannel) and channel.split and channel.on_gpu
        layer, expert = cluster.placement.experts_of(0)[0]
        x, ids, weights = gpu_random_inputs(3, config.hidden_size, config.num_experts, config.top_k, 7)
        channel.send(layer, x, torch.full_like(ids, 10_000), weights)  # no such expert
        with pytest.raises(RemoteError, match="expert"):
            channel.receive(time.monotonic() + 20)
        one = torch.full_like(ids[:, :1], expert)
        channel.send(layer, x, one, weights[:, :1])
        got = channel.receive(time.monotonic() + 20).clone()
        torch.testing.assert_close(got.float(), local(layer, x, one, weights[:, :1]), rtol=2e-4, atol=2e-4)
    finally:
        conn.close()


def test_channels_reopened_while_another_holds_the_server(
    cluster: LocalCluster, tiny_checkpoints: dict[str, Path]
) -> None:
    """While one channel holds the server's view of this process's agent, others open and close:
    each new offer must not describe GPU memory the server knows at the same address under another
    key (NIXL refuses it: seen here when a freed area's block came back from the CUDA caching
    allocator). Closed channels' areas serve the next offers instead."""
    checkpoint = tiny_checkpoints[FAMILY]
    config = CheckpointReader(checkpoint).config
    local = gpu_local_experts(checkpoint)
    layer, expert = cluster.placement.experts_of(0)[0]
    x, ids, weights = gpu_random_inputs(5, config.hidden_size, config.num_experts, config.top_k, 11)
    one = torch.full_like(ids[:, :1], expert)
    want = local(layer, x, one, weights[:, :1])
    holder = ServerConnection(0, cluster.urls[0], "nixl", "holder", 20.0, 5.0)
    holder.connect()
    try:
        for i in range(6):
            conn = ServerConnection(0, cluster.urls[0], "nixl", f"again-{i}", 20.0, 5.0)
            conn.connect()
            try:
                channel = conn.channel
                assert isinstance(channel, NixlChannel) and channel.on_gpu
                channel.send(layer, x, one, weights[:, :1])
                got = channel.receive(time.monotonic() + 20).clone()
                torch.testing.assert_close(got.float(), want, rtol=2e-4, atol=2e-4)
            finally:
                conn.close()
    finally:
        holder.close()


def test_generation_equals_reference_and_survives_a_kill(
    tiny_checkpoints: dict[str, Path],
    reference_outputs: dict[str, tuple[list[list[int]], torch.Tensor]],
    tmp_path: Path,
) -> None:
    checkpoint = tiny_checkpoints[FAMILY]
    with gpu_cluster(checkpoint, tmp_path, "nixl") as cluster:
        generation_survives_a_kill(cluster, checkpoint, reference_outputs[FAMILY], "nixl")
