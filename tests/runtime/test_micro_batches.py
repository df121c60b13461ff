"""Micro-batches in flight on ``RemoteExperts``: ``submit`` / ``wait`` tickets equal the blocking call,
in any wait order, and a server killed with two tickets outstanding costs each ticket one resend of
exactly what it owed (real server processes, every transport)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datapath_helpers import PROMPTS, drill_cluster

from e2e.waiting import wait_until
from eaas.runtime.client import AttentionClient, ClientOptions
from eaas.runtime.client.remote_experts import RemoteExperts
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.local.session import StepHook
from eaas.runtime.model import CheckpointReader, Decoder, LocalExperts, load_reference
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.paged_cache import KVPool
from eaas.runtime.serving.sampling import SamplingParams
from eaas.runtime.serving.scheduler import Sequence

FAMILY = "deepseek_v3"
KILLED = 1


@pytest.fixture(scope="module")
def cluster(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with drill_cluster(tiny_checkpoints[FAMILY], tmp_path_factory.mktemp("micro-batches")) as cluster:
        yield cluster


@pytest.fixture
def healthy(cluster: LocalCluster) -> LocalCluster:
    """The cluster with every server running (a test kills one)."""
    for ordinal in cluster.servers:
        if not cluster.is_alive(ordinal):
            cluster.restart(ordinal)
    return cluster


@pytest.fixture(scope="module")
def local_experts(tiny_checkpoints: dict[str, Path]) -> LocalExperts:
    return LocalExperts.from_checkpoint(CheckpointReader(tiny_checkpoints[FAMILY]))


def layer_inputs(config: Any, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=generator)  # [T, H]
    weights, ids = torch.rand(tokens, config.num_experts, generator=generator).topk(config.top_k, dim=-1)
    return x, ids, weights  # [T, H], [T, K], [T, K]


def stopped(cluster: LocalCluster, ordinal: int) -> bool:
    stat = Path(f"/proc/{cluster.servers[ordinal].process.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def experts_for(cluster: LocalCluster, transport: str) -> RemoteExperts:
    config = CheckpointReader(cluster.checkpoint).config
    options = ClientOptions(transport=transport, request_timeout_s=5.0, rejoin_min_s=0.1, rejoin_max_s=0.5)
    return RemoteExperts(config, cluster.placement, cluster.urls, options).connect()


@pytest.mark.parametrize("transport", ["shm", "tcp", "nixl"])
def test_tickets_in_flight_together_equal_the_blocking_call_in_any_wait_order(
    healthy: LocalCluster, local_experts: LocalExperts, transport: str
) -> None:
    cluster = healthy
    experts = experts_for(cluster, transport)
    config = experts.config
    first, last = config.moe_layers[0], config.moe_layers[-1]
    inputs = [
        (first, *layer_inputs(config, 24, 0)),
        (last, *layer_inputs(config, 9, 1)),
        (first, *layer_inputs(config, 5, 2)),
    ]
    try:
        want = [local_experts(*args) for args in inputs]
        tickets = [experts.submit(*args) for args in inputs]  # three in flight (or queued) at once
        assert len(experts._tickets) == 3
        got = [experts.wait(tickets[i]) for i in (2, 0, 1)]  # the last submitted first
        for i, y in zip((2, 0, 1), got, strict=True):
            torch.testing.assert_close(y, want[i], rtol=1e-4, atol=1e-5)
        assert not experts._tickets and all(flight is None for flight in experts._flights)
        torch.testing.assert_close(experts(*inputs[0]), want[0], rtol=1e-4, atol=1e-5)  # blocking still
        assert experts.counters.failovers == 0 and experts.counters.resent_entries == 0
    finally:
        experts.close()


@pytest.mark.parametrize("transport", ["shm", "tcp", "nixl"])
def test_a_server_killed_with_two_tickets_outstanding_resends_each_share_once(
    healthy: LocalCluster, local_experts: LocalExperts, transport: str
) -> None:
    cluster = healthy
    """Server 1 stops with ticket 0's request on its slot and ticket 1's queued behind it, then is
    SIGKILLed: both tickets re-route exactly the entries they had assigned to it, once each, and
    their answers equal the in-process experts (nothing lost, nothing summed twice)."""
    experts = experts_for(cluster, transport)
    config = experts.config
    layer = config.moe_layers[0]
    inputs = [layer_inputs(config, 32, 3), layer_inputs(config, 17, 4)]
    index = experts.table.ordinals.index(KILLED)
    try:
        want = [local_experts(layer, *args) for args in inputs]
        cluster.kill(KILLED, signal.SIGSTOP)
        wait_until(lambda: stopped(cluster, KILLED), 10, "server 1 stopped")  # before anything is sent
        tickets = [experts.submit(layer, *args) for args in inputs]
        owed = []
        for ticket in tickets:
            assert ticket.assignment is not None
            owed.append(int((ticket.assignment == index).sum()))
        assert all(n > 0 for n in owed)  # both tickets owe the stopped server a share
        flight = experts._flights[index]
        assert flight is not None and flight.ticket is tickets[0] and index in tickets[1].queues
        cluster.kill(KILLED)  # SIGKILL (stopped still, so it answers nothing): its slot closes under both
        got = [experts.wait(ticket) for ticket in reversed(tickets)][::-1]
        for y, expected in zip(got, want, strict=True):
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-5)
        assert experts.counters.failovers == 1
        resent = [e.resent_entries for e in experts.events if e.kind == "resent"]
        assert sorted(resent) == sorted(owed) and experts.counters.resent_entries == sum(owed)
        assert KILLED not in experts.live_servers
    finally:
        experts.close()
        cluster.restart(KILLED)


def run_engine(decoder: Decoder, micro_batches: int) -> list[Sequence]:
    """Greedy and seeded rows through an engine whose steps are cut into ``micro_batches``."""
    per_block = KVPool.bytes_per_block(decoder.config, 4, decoder.side.dtype)
    options = EngineOptions(
        64 * per_block, block_size=4, max_batch_tokens=8, max_seqs=4, micro_batches=micro_batches
    )
    engine = Engine(decoder, options)
    seqs = [
        engine.add(
            prompt,
            SamplingParams(max_tokens=6, temperature=0.8, seed=i) if i % 2 else SamplingParams(max_tokens=6),
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    while engine.has_work():
        engine.step()
    return seqs


@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize(
    ("transport", "sig"),
    [("shm", signal.SIGKILL), ("tcp", signal.SIGKILL), ("shm", signal.SIGSTOP)],
    ids=["shm-SIGKILL", "tcp-SIGKILL", "shm-SIGSTOP"],
)
def test_a_server_killed_or_hung_mid_pipeline_fails_no_request_and_changes_no_token(
    healthy: LocalCluster,
    tiny_checkpoints: dict[str, Path],
    transport: str,
    sig: signal.Signals,
    micro_batches: int,
) -> None:
    """SIGKILL (its slot closes) or SIGSTOP (it hangs: probed, then failed) with micro-batches
    in flight: every sequence finishes with the tokens of the unsplit reference run."""
    cluster = healthy
    want = [seq.output for seq in run_engine(load_reference(tiny_checkpoints[FAMILY]), 1)]
    options = ClientOptions(transport=transport, request_timeout_s=5.0, rejoin_min_s=0.1, rejoin_max_s=0.5)
    client = AttentionClient(cluster.checkpoint, cluster.placement, cluster.urls, options).connect()
    experts = client.experts
    try:
        first_moe = client.config.moe_layers[0]
        kill_at = 3 * micro_batches  # a few steps in, with micro-batches in flight to every server
        client.decoder.experts = StepHook(
            experts, first_moe, lambda n: cluster.kill(KILLED, sig) if n == kill_at else None
        )
        seqs = run_engine(client.decoder, micro_batches)
        assert [seq.finish_reason for seq in seqs] == ["length"] * len(PROMPTS)  # 0 failed
        assert [seq.output for seq in seqs] == want
        assert experts.counters.failovers == 1 and experts.counters.resent_entries > 0
    finally:
        cluster.kill(KILLED, signal.SIGCONT)
        client.close()
        cluster.restart(KILLED)
