"""Helpers for the placement tests: an invariant checker independent of `Placement`'s own
validation, and small instances."""

from __future__ import annotations

import numpy as np

from eaas.runtime.placement import Placement, Server, SyntheticTrace, TraceConfig


def assert_invariants(placement: Placement) -> None:
    """Capacity, R replicas on distinct servers, and domain spread, recomputed from experts_of."""
    replicas: dict[tuple[int, int], list[int]] = {}
    for server in placement.servers:
        pairs = placement.experts_of(server.ordinal)
        assert len(pairs) <= server.capacity, f"server {server.ordinal} over capacity"
        assert len(set(pairs)) == len(pairs), f"server {server.ordinal} hosts a pair twice"
        for pair in pairs:
            replicas.setdefault(pair, []).append(server.ordinal)
    domain_of = {
        s.ordinal: s.domain if s.domain is not None else f"own-{s.ordinal}" for s in placement.servers
    }
    slots: dict[str, int] = {}
    for server in placement.servers:
        slots[domain_of[server.ordinal]] = slots.get(domain_of[server.ordinal], 0) + server.capacity
    num_pairs = len(placement.layers) * placement.num_experts
    # Each domain can give every pair at most one replica towards its spread.
    allowed = sum(min(n, num_pairs) for n in slots.values()) // num_pairs
    needed = max(1, min(placement.replication, len(slots), allowed))
    for layer in placement.layers:
        for expert in range(placement.num_experts):
            hosts = replicas.get((layer, expert), [])
            assert len(hosts) >= placement.replication, f"({layer}, {expert}) has {len(hosts)} replicas"
            assert len({domain_of[h] for h in hosts}) >= needed, f"({layer}, {expert}) not spread"
            assert sorted(hosts) == placement.servers_of(layer, expert)


def domain_servers(num_servers: int, capacity: int, num_domains: int) -> list[Server]:
    return [
        Server(ordinal=i, capacity=capacity, name=f"expert-{i}", domain=f"node-{i % num_domains}")
        for i in range(num_servers)
    ]


def trace_load(num_layers: int, num_experts: int, seed: int = 0, steps: int = 20) -> np.ndarray:
    """float64 [L, E]: a skewed window-mean load (mean 64 tokens per expert)."""
    config = TraceConfig(
        num_layers=num_layers, num_experts=num_experts, tokens_per_step=64 * num_experts, seed=seed
    )
    return SyntheticTrace(config).loads(0, steps).mean(axis=0).astype(np.float64)
