"""The disaggregated model equals the monolithic reference: every family, 1-4 servers, R 1-2, shm, tcp and
nixl, several clients at once (real shared memory, real sockets, real NIXL agents over UCX; servers
run in this process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datapath_helpers import MAX_NEW_TOKENS, PROMPTS, generate_concurrently, in_process_servers, urls

from eaas.runtime.model import FAMILIES, CheckpointReader
from eaas.runtime.placement import round_robin

LAYOUTS = [(1, 1), (2, 1), (3, 2), (4, 2)]  # (servers, replication)
# What the servers offer for each transport under test (nixl beside tcp: the server waits in one
# transport while watching the other's wake-ups).
SERVER_TRANSPORTS = {"shm": ("shm", "tcp"), "tcp": ("shm", "tcp"), "nixl": ("nixl", "tcp")}


def check_equal(
    got: tuple[list[list[int]], torch.Tensor], want: tuple[list[list[int]], torch.Tensor]
) -> None:
    tokens, logits = got
    assert tokens == want[0]
    torch.testing.assert_close(logits, want[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("transport", ["shm", "tcp", "nixl"])
@pytest.mark.parametrize(("num_servers", "replication"), LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_equals_the_reference(
    family: str,
    num_servers: int,
    replication: int,
    transport: str,
    tiny_checkpoints: dict[str, Path],
    reference_outputs: dict[str, tuple[list[list[int]], torch.Tensor]],
) -> None:
    checkpoint = tiny_checkpoints[family]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, num_servers, replication=replication)
    with in_process_servers(checkpoint, placement, transports=SERVER_TRANSPORTS[transport]) as servers:
        results = generate_concurrently(
            checkpoint, placement, urls(servers), [transport, transport], PROMPTS, MAX_NEW_TOKENS
        )
        total = sum(int(server.load.snapshot().sum()) for server in servers.values())
    for result in results:
        check_equal(result, reference_outputs[family])
    # Every routed (token, expert) entry was computed exactly once per client, somewhere.
    prompt_tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_NEW_TOKENS - 1)
    assert total == 2 * prompt_tokens * len(config.moe_layers) * config.top_k


def test_shm_and_tcp_clients_share_servers_and_small_slots_split_batches(
    tiny_checkpoints: dict[str, Path], reference_outputs: dict[str, tuple[list[list[int]], torch.Tensor]]
) -> None:
    checkpoint = tiny_checkpoints["deepseek_v3"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 3, replication=2)
    # max_tokens=2: the prefill (12 tokens) must be split over several round trips (the server
    # refuses anything larger, which would fail the test).
    with in_process_servers(checkpoint, placement, max_tokens=2) as servers:
        results = generate_concurrently(
            checkpoint, placement, urls(servers), ["shm", "tcp", "shm"], PROMPTS, MAX_NEW_TOKENS
        )
    for result in results:
        check_equal(result, reference_outputs["deepseek_v3"])
