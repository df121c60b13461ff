"""Helpers shared by the data-path tests: in-process expert servers and concurrent clients."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from eaas.runtime.client import AttentionClient, ClientOptions
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import CheckpointReader, ExpertStack, LocalExperts
from eaas.runtime.placement import Placement, round_robin
from eaas.runtime.server import ExpertServer

PROMPTS: list[list[int]] = [[72, 101, 108, 108, 111], [7, 8], [100, 200, 300, 250], [42]]
MAX_NEW_TOKENS = 5


@contextmanager
def in_process_servers(
    checkpoint: Path, placement: Placement, **options: Any
) -> Iterator[dict[int, ExpertServer]]:
    """Every server of ``placement`` in this process (loop + control port in threads); stopped on exit."""
    with ExitStack() as stack:
        servers = {}
        for ordinal in placement.ordinals:
            server = ExpertServer.from_placement(checkpoint, placement, ordinal, **options)
            stack.callback(server.stop)
            servers[ordinal] = server.start()
        yield servers


@contextmanager
def drill_cluster(checkpoint: Path, workdir: Path) -> Iterator[LocalCluster]:
    """Three expert-server processes, every expert on two of them, offering shm, tcp and nixl."""
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 3, replication=2)
    with LocalCluster(checkpoint, placement, workdir, transports=("shm", "tcp", "nixl")) as cluster:
        yield cluster


def urls(servers: dict[int, ExpertServer]) -> dict[int, str]:
    return {ordinal: server.url for ordinal, server in servers.items()}


def generate_concurrently(
    checkpoint: Path,
    placement: Placement,
    server_urls: dict[int, str],
    transports: Sequence[str],
    prompts: list[list[int]],
    max_new_tokens: int,
    timeout_s: float = 120.0,
) -> list[tuple[list[list[int]], torch.Tensor]]:
    """One attention client per transport, all generating ``prompts`` at the same time."""
    results: list[Any] = [None] * len(transports)

    def work(index: int, client: AttentionClient) -> None:
        try:
            results[index] = client.generate(prompts, max_new_tokens)
        except BaseException as exc:
            results[index] = exc

    with ExitStack() as stack:
        clients = []
        for transport in transports:
            options = ClientOptions(transport=transport, request_timeout_s=10.0)
            client = AttentionClient(checkpoint, placement, server_urls, options)
            stack.callback(client.close)
            clients.append(client.connect())
        threads = [threading.Thread(target=work, args=(i, c), daemon=True) for i, c in enumerate(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
        assert not any(thread.is_alive() for thread in threads), "generation did not finish in time"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def gpu_cluster(
    checkpoint: Path, workdir: Path, transport: str, num_servers: int = 3, replication: int = 2
) -> LocalCluster:
    """Expert server processes computing on the GPU (Triton kernels) and offering ``transport``."""
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, num_servers, replication=replication)
    return LocalCluster(
        checkpoint,
        placement,
        workdir,
        transports=(transport,),
        kernel_backend="triton",
        max_tokens=16,
        extra_args=("--device", "cuda"),
    )


def gpu_local_experts(checkpoint: Path) -> LocalExperts:
    """Every expert of ``checkpoint`` on the GPU in this process: the GPU transports' reference."""
    reader = CheckpointReader(checkpoint)
    config = reader.config
    pairs = [(layer, e) for layer in config.moe_layers for e in range(config.num_experts)]
    return LocalExperts(ExpertStack.load(reader, pairs).to("cuda"), backend="torch")


def gpu_random_inputs(
    num_tokens: int, hidden: int, num_experts: int, top_k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], ids [T, K] int32 and weights [T, K] on the GPU, drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    weights, ids = scores.topk(top_k, dim=-1)
    return x.cuda(), ids.to(torch.int32).cuda(), weights.cuda()


def generation_survives_a_kill(
    cluster: LocalCluster, checkpoint: Path, want: tuple[list[list[int]], torch.Tensor], transport: str
) -> None:
    """An attention client's generations over ``transport`` equal the reference ``want`` (tokens,
    logits), and again when server 0 is SIGKILLed mid-generation (R >= 2): one failover, nothing lost."""
    want_tokens, want_logits = want
    options = ClientOptions(transport=transport, request_timeout_s=20.0)
    with AttentionClient(checkpoint, cluster.placement, cluster.urls, options) as client:
        tokens, logits = client.generate(PROMPTS, MAX_NEW_TOKENS)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        calls = 0
        original = client.experts.__call__

        def kill_mid_generation(layer: int, *args: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 6:
                cluster.kill(0, signal.SIGKILL)
            return original(layer, *args)

        client.decoder.experts = kill_mid_generation
        tokens, logits = client.generate(PROMPTS, MAX_NEW_TOKENS)
        assert calls > 6
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        assert client.experts.counters.failovers == 1
