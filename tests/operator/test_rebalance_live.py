"""The rebalance collector against a real expert-server process on loopback: the window's load is
what the attention client routed, a dead server is counted and left out, never raised."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from inline_jobs import inline_jobs
from prometheus_client import CollectorRegistry
from test_rebalance import counts

from eaas.operator import rebalance
from eaas.operator.collector import Rebalancer
from eaas.operator.metrics import OperatorMetrics
from eaas.runtime.client import AttentionClient, ClientOptions
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import CheckpointReader
from eaas.runtime.placement import round_robin

FAMILY = "deepseek_v3"  # a dense first layer: stats rows are the MoE layers only
PROMPTS = [[72, 101, 108, 108, 111], [7, 8, 9]]
MAX_NEW_TOKENS = 3


def test_collector_measures_the_routed_load_of_a_real_server(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    checkpoint = tiny_checkpoints[FAMILY]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 1, replication=1, version=1)
    layers, experts = tuple(config.moe_layers), config.num_experts
    metrics = OperatorMetrics(CollectorRegistry())
    now = [1000.0]
    rebalancer = Rebalancer(metrics, timeout_seconds=2.0, clock=lambda: now[0], jobs=inline_jobs())
    key = ("ns", "tiny-experts")

    with LocalCluster(checkpoint, placement, tmp_path / "cluster", transports=("tcp",)) as cluster:
        urls = cluster.urls
        options = ClientOptions(transport="tcp", request_timeout_s=10.0)
        client = AttentionClient(checkpoint, placement, urls, options).connect()
        try:
            baseline = rebalancer.scrape(urls, layers, experts)
            client.generate(PROMPTS, MAX_NEW_TOKENS)
            first = rebalancer.scrape(urls, layers, experts)
            client.generate(PROMPTS, MAX_NEW_TOKENS)  # the same greedy work again
            second = rebalancer.scrape(urls, layers, experts)

            # The timer's path: a baseline, then (an interval later) a decision from the real counters.
            assert rebalancer.tick(key, placement, urls, "cost_aware", 60).result == "baseline"  # type: ignore[union-attr]
            client.generate(PROMPTS, MAX_NEW_TOKENS)
            now[0] += 60
            decision = rebalancer.tick(key, placement, urls, "cost_aware", 60)
        finally:
            client.close()

        one = rebalance.window_load(baseline, first, placement)
        two = rebalance.window_load(first, second, placement)
        assert one.complete and one.counted == (0,) and one.restarted == ()
        assert one.load.shape == (len(layers), experts) and one.total_tokens > 0
        per_layer = one.load.sum(axis=1)  # [L]: every MoE layer sees every token, top_k times
        assert np.all(per_layer == per_layer[0]) and per_layer[0] % config.top_k == 0
        total = second.servers[0].tokens.sum() - first.servers[0].tokens.sum()
        assert two.total_tokens == total  # the server's own counters, differenced
        np.testing.assert_array_equal(two.load, one.load)  # same prompts → same routing
        assert decision is not None and decision.result == "unchanged"  # one server: nothing to move

        cluster.kill(0)  # a server that does not answer: counted, left out, nothing raised
        dead = rebalancer.scrape(urls, layers, experts)
        assert dead.servers == {}
        assert not rebalance.window_load(second, dead, placement).complete

    assert counts(metrics, "eaas_operator_stats_scrapes") == {"success": 5.0, "error": 1.0}
    assert counts(metrics, "eaas_operator_rebalances") == {"baseline": 1.0, "unchanged": 1.0}
