"""``cuda_ipc`` on a real GPU: expert servers as separate processes computing with the Triton
kernels, slots in GPU memory, flags in page-locked shared memory.

- one MoE layer over cuda_ipc equals every expert computed in this process (eager and captured
  in a CUDA graph, replayed with new inputs);
- whole generations of a CPU attention client equal the monolithic reference;
- SIGKILL of a server mid-generation loses nothing (R = 2): the same tokens;
- a server killed between replays of a captured layer: ``finish`` releases the stream, reports
  the failure, and the eager redo equals the reference.

Tolerances: float32 checkpoints, float32 accumulation on both sides; the checks allow 1e-4
(logits) and 2e-4 (layer outputs), and all passed at that on an H100 (docs/benchmarks.md).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from datapath_helpers import generation_survives_a_kill, gpu_cluster, gpu_local_experts, gpu_random_inputs

from eaas.runtime.client import ClientOptions
from eaas.runtime.client.captured import CapturedExperts, CapturedStepFailed
from eaas.runtime.client.remote_experts import RemoteExperts
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import CheckpointReader

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAMILY = "deepseek_v3"


@pytest.fixture
def cluster(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> Iterator[LocalCluster]:
    with gpu_cluster(tiny_checkpoints[FAMILY], tmp_path, "cuda_ipc") as cluster:
        yield cluster


def capture_layer(
    captured: CapturedExperts, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One MoE layer's exchange captured in a CUDA graph; returns the graph and its output buffer."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = captured(layer, x, ids, weights)
    return graph, out


def test_layer_equals_local_experts_eager(cluster: LocalCluster, tiny_checkpoints: dict[str, Path]) -> None:
    checkpoint = tiny_checkpoints[FAMILY]
    config = CheckpointReader(checkpoint).config
    local = gpu_local_experts(checkpoint)
    options = ClientOptions(transport="cuda_ipc", request_timeout_s=20.0)
    with RemoteExperts(config, cluster.placement, cluster.urls, options) as remote:
        for num_tokens in (1, 7, 40):  # 40 > max_tokens: split into several round trips
            for layer in config.moe_layers:
                x, ids, weights = gpu_random_inputs(
                    num_tokens, config.hidden_size, config.num_experts, config.top_k, layer
                )
                got = remote(layer, x, ids, weights)
                assert got.device.type == "cuda"
                torch.testing.assert_close(got, local(layer, x, ids, weights), rtol=2e-4, atol=2e-4)
        assert remote.counters.failovers == 0


def test_captured_layer_replays_new_inputs(cluster: LocalCluster, tiny_checkpoints: dict[str, Path]) -> None:
    checkpoint = tiny_checkpoints[FAMILY]
    config = CheckpointReader(checkpoint).config
    local = gpu_local_experts(checkpoint)
    layer = config.moe_layers[-1]
    options = ClientOptions(transport="cuda_ipc", request_timeout_s=20.0)
    with RemoteExperts(config, cluster.placement, cluster.urls, options) as remote:
        x, ids, weights = gpu_random_inputs(8, config.hidden_size, config.num_experts, config.top_k, seed=1)
        captured = CapturedExperts(remote)
        graph, out = capture_layer(captured, layer, x, ids, weights)
        for seed in (2, 3, 4):
            new = gpu_random_inputs(8, config.hidden_size, config.num_experts, config.top_k, seed=seed)
            for static, value in zip((x, ids, weights), new, strict=True):
                static.copy_(value)
            out.fill_(float("nan"))
            graph.replay()
            done = torch.cuda.Event()
            done.record()
            captured.finish(done, timeout_s=20.0)
            torch.testing.assert_close(out, local(layer, x, ids, weights), rtol=2e-4, atol=2e-4)


def test_server_killed_between_replays_is_reported_and_redone(
    cluster: LocalCluster, tiny_checkpoints: dict[str, Path]
) -> None:
    checkpoint = tiny_checkpoints[FAMILY]
    config = CheckpointReader(checkpoint).config
    local = gpu_local_experts(checkpoint)
    layer = config.moe_layers[0]
    options = ClientOptions(transport="cuda_ipc", request_timeout_s=20.0)
    with RemoteExperts(config, cluster.placement, cluster.urls, options) as remote:
        x, ids, weights = gpu_random_inputs(8, config.hidden_size, config.num_experts, config.top_k, seed=5)
        captured = CapturedExperts(remote)
        graph, _ = capture_layer(captured, layer, x, ids, weights)
        cluster.kill(1, signal.SIGKILL)
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        with pytest.raises(CapturedStepFailed) as failure:
            captured.finish(done, timeout_s=20.0)
        assert failure.value.servers == [1]
        assert not captured.is_current()
        # The redo, eager, goes to the replicas and equals the reference.
        torch.testing.assert_close(
            remote(layer, x, ids, weights), local(layer, x, ids, weights), rtol=2e-4, atol=2e-4
        )
        # The client's CUDA context still works after touching the dead server's memory.
        assert float((torch.ones(4, device="cuda") * 2).sum()) == 8.0


def test_generation_equals_reference_and_survives_a_kill(
    tiny_checkpoints: dict[str, Path],
    reference_outputs: dict[str, tuple[list[list[int]], torch.Tensor]],
    tmp_path: Path,
) -> None:
    checkpoint = tiny_checkpoints[FAMILY]
    with gpu_cluster(checkpoint, tmp_path, "cuda_ipc") as cluster:
        generation_survives_a_kill(cluster, checkpoint, reference_outputs[FAMILY], "cuda_ipc")
