"""The client's routing table: live replicas only, each token once per server, deterministic spread."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eaas.runtime.client import ExpertUnavailable, RoutingTable
from eaas.runtime.placement import Placement, Server, round_robin

LAYERS = [1, 2]
EXPERTS = 8


def routed(seed: int, tokens: int, top_k: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(EXPERTS, generator=generator)[:top_k] for _ in range(tokens)])


@settings(max_examples=60, deadline=None)
@given(
    servers=st.integers(1, 5),
    replication=st.integers(1, 3),
    seed=st.integers(0, 1000),
    tokens=st.integers(1, 40),
    dead_mask=st.integers(0, 31),
)
def test_every_entry_goes_to_a_live_server_hosting_its_expert(
    servers: int, replication: int, seed: int, tokens: int, dead_mask: int
) -> None:
    replication = min(replication, servers)
    placement = round_robin(LAYERS, EXPERTS, servers, replication=replication)
    table = RoutingTable(placement)
    live = torch.tensor([not (dead_mask >> i) & 1 for i in range(servers)])
    ids = routed(seed, tokens, top_k=2)
    try:
        assignment = table.assign(2, ids, live)
    except ExpertUnavailable as error:
        assert all(not live[table.ordinals.index(o)] for o in placement.servers_of(2, error.expert))
        assert f"(layer 2, expert {error.expert})" in str(error)
        return
    for (t, k), server in zip(torch.cartesian_prod(torch.arange(tokens), torch.arange(2)).tolist(),
                              assignment.reshape(-1).tolist(), strict=True):  # fmt: skip
        assert live[server]
        assert table.ordinals[server] in placement.servers_of(2, int(ids[t, k]))
    shares = RoutingTable.split(assignment, ids)
    seen = torch.full_like(ids, -1)
    for share in shares:
        assert share.rows.unique().numel() == share.rows.numel()  # each token at most once per server
        for row, local in zip(share.rows.tolist(), share.expert_ids, strict=True):
            mine = local >= 0
            assert mine.any()
            assert torch.equal(local[mine], ids[row][mine])
            assert (seen[row][mine] == -1).all()  # no entry is computed twice
            seen[row][mine] = share.server
    assert torch.equal(seen, assignment)  # every entry is computed once


def test_replicas_share_a_hot_expert_and_the_choice_is_deterministic() -> None:
    placement = round_robin(LAYERS, EXPERTS, 4, replication=2)
    table = RoutingTable(placement)
    ids = torch.full((100, 1), 3)  # every token wants expert 3
    live = torch.ones(4, dtype=torch.bool)
    first = table.assign(1, ids, live)
    assert torch.equal(first, table.assign(1, ids, live))
    counts = torch.bincount(first.reshape(-1), minlength=4)
    hosts = [table.ordinals.index(o) for o in placement.servers_of(1, 3)]
    assert sorted(counts.nonzero().squeeze(1).tolist()) == sorted(hosts)
    assert counts[hosts].tolist() == [50, 50]  # a hot expert is split over its replicas
    cold = table.assign(1, torch.full((8, 1), 3), live)
    assert cold.unique().numel() == 1 and int(cold[0, 0]) in hosts  # a cold one stays whole on one replica
    turns = [int(table.assign(1, torch.full((8, 1), 3), live)[0, 0]) for _ in range(6)]
    assert sorted(turns) == sorted(hosts * 3)  # ... which rotates: over batches its replicas share it
    spread = table.assign(1, torch.arange(EXPERTS)[:, None], live)
    assert spread.unique().numel() == 4  # and different experts land on different servers


def test_a_dead_replica_is_skipped_and_no_replica_means_expert_unavailable() -> None:
    placement = round_robin(LAYERS, EXPERTS, 3, replication=2)
    table = RoutingTable(placement)
    a, b = (table.ordinals.index(o) for o in placement.servers_of(1, 0))
    live = torch.ones(3, dtype=torch.bool)
    live[a] = False
    assignment = table.assign(1, torch.zeros(10, 1, dtype=torch.int64), live)
    assert (assignment == b).all()
    live[b] = False
    with pytest.raises(ExpertUnavailable, match=r"\(layer 1, expert 0\)"):
        table.assign(1, torch.zeros(10, 1, dtype=torch.int64), live)
    assert (table.assign(1, torch.full((2, 2), -1), live) == -1).all()  # nothing to do, nothing raised


def test_unchecked_assignment_never_raises_and_marks_unserved_entries() -> None:
    # The capturable form (check=False) cannot raise inside a CUDA graph: an entry whose expert has
    # no live replica gets -1 instead, every other entry a live server hosting its expert.
    placement = round_robin(LAYERS, EXPERTS, 4, replication=1)
    table = RoutingTable(placement)
    live = torch.tensor([True, False, True, True])
    ids = routed(3, 20, top_k=3)
    with pytest.raises(ExpertUnavailable):
        table.assign(2, ids, live)
    assignment = table.assign(2, ids, live, check=False)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            hosts = table.replicas(2, int(ids[t, k]))
            server = int(assignment[t, k])
            if not any(live[table.ordinals.index(o)] for o in hosts):
                assert server == -1
            else:
                assert server >= 0 and live[server] and table.ordinals[server] in hosts
    assert table.servers_of_layer(2) == [0, 1, 2, 3]


def test_each_batch_gives_every_server_its_share_of_whole_experts() -> None:
    # Server 0 holds the even experts. With replica lists ordered by ordinal it would be replica 0
    # of all four, and the rotation (layer + turn + e) mod 2 would send it, with one token per
    # expert, all four in one batch and none in the next (and server 1 the other way round).
    hosted = {
        0: [(1, 0), (1, 2), (1, 4), (1, 6)],
        1: [(1, 0), (1, 2), (1, 5), (1, 7)],
        2: [(1, 1), (1, 3), (1, 4), (1, 6)],
        3: [(1, 1), (1, 3), (1, 5), (1, 7)],
    }
    placement = Placement([1], EXPERTS, [Server(n, 4) for n in range(4)], hosted, replication=2)
    table = RoutingTable(placement)
    live = torch.ones(4, dtype=torch.bool)
    ids = torch.arange(EXPERTS)[:, None]  # [T=8, K=1]: one token per expert, all cold
    for _ in range(4):
        per_server = torch.bincount(table.assign(1, ids, live).reshape(-1), minlength=4)
        assert per_server.tolist() == [2, 2, 2, 2]
