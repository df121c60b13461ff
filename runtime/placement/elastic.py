"""Elastic operations on the seed-002 objective: add a server, drain one, recover from failures.

All three return a placement over the new server set with every (layer, expert) still hosted at
least R times (spread over failure domains where possible), moving little:

- `add_server`: only the new server loads experts (it loads before it serves, so it stalls no one);
  it takes the replicas and relocations that lower the per-layer peaks most. Existing servers only
  drop surplus replicas.
- `drain_server`: the leaving server keeps serving until the new placement is committed; every
  pair that would fall below R (or below the domain spread) is re-homed on the servers with the
  fewest new loads, then a cost-aware pass rebalances what the drain unbalanced.
- `recover`: the failed servers are gone. Pairs left with no replica are restored first, then
  pairs below R (their weights are copied from surviving replicas), then a cost-aware pass. If the
  survivors cannot hold R replicas, R is lowered to what fits (never below 1) — check
  ``result.replication``.

All three run the planners' one search (`eaas.runtime.placement.search`) on the objective of
`eaas.runtime.placement.cost`, the failover bound included.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from eaas.runtime.placement.cost import CostModel, check_horizon, check_load
from eaas.runtime.placement.placement import Placement, PlacementError, Server, check_feasible
from eaas.runtime.placement.search import search_for


def add_server(
    current: Placement,
    server: Server,
    load: np.ndarray,
    cost: CostModel | None = None,
    *,
    horizon_steps: int = 100,
) -> Placement:
    """Add ``server`` (a new ordinal) and fill it with the replicas that help most.

    load: float ``[L, E]`` predicted tokens per step. Returns a placement with version + 1 (the new
    server may stay empty if nothing it could host lowers a peak).
    """
    cost = cost or CostModel()
    check_horizon(horizon_steps)
    if not isinstance(server, Server):
        raise PlacementError(f"server must be a Server, got {type(server).__name__}")
    if server.ordinal in current.ordinals:
        raise PlacementError(
            f"server ordinal {server.ordinal} is already in the placement {list(current.ordinals)}"
        )
    loads = check_load(load, len(current.layers), current.num_experts)
    servers = sorted([*current.servers, server], key=lambda s: s.ordinal)
    new_column = next(i for i, s in enumerate(servers) if s.ordinal == server.ordinal)
    original = np.insert(current.hosting_matrix(), new_column, False, axis=0)
    is_new = [s.ordinal == server.ordinal for s in servers]
    search = search_for(
        current, loads, cost, horizon_steps, servers=servers, matrix=original, load_allowed=is_new,
        charged=[not new for new in is_new],
    )  # fmt: skip
    search.settle()
    return _result(current, servers, search.matrix(), current.replication)


def drain_server(
    current: Placement,
    ordinal: int,
    load: np.ndarray,
    cost: CostModel | None = None,
    *,
    horizon_steps: int = 100,
) -> Placement:
    """Re-home everything ``ordinal`` hosts so it can be removed, keeping R (raises if the other
    servers cannot hold R replicas). load: float ``[L, E]``. Returns the placement without it."""
    cost = cost or CostModel()
    check_horizon(horizon_steps)
    current.server_index(ordinal)  # raises for an unknown ordinal
    loads = check_load(load, len(current.layers), current.num_experts)
    survivors = [s for s in current.servers if s.ordinal != ordinal]
    if not survivors:
        raise PlacementError(f"cannot drain server {ordinal}: it is the only server")
    try:
        check_feasible(len(current.layers), current.num_experts, survivors, current.replication)
    except PlacementError as error:
        raise PlacementError(f"cannot drain server {ordinal}: {error}") from None
    try:
        return _rebuild(current, survivors, loads, cost, horizon_steps, current.replication)
    except PlacementError as error:
        raise PlacementError(f"cannot drain server {ordinal}: {error}") from None


def recover(
    current: Placement,
    failed: Iterable[int],
    load: np.ndarray,
    cost: CostModel | None = None,
    *,
    horizon_steps: int = 100,
) -> Placement:
    """Placement after the servers in ``failed`` died: every pair served again, R restored where
    the survivors have room (lowered otherwise; never below 1). load: float ``[L, E]``."""
    cost = cost or CostModel()
    check_horizon(horizon_steps)
    failed_set = set(failed)
    for ordinal in failed_set:
        current.server_index(ordinal)
    loads = check_load(load, len(current.layers), current.num_experts)
    survivors = [s for s in current.servers if s.ordinal not in failed_set]
    if not survivors:
        raise PlacementError("every server failed; nothing to recover onto")
    if not failed_set:
        return current
    replication = current.replication
    while replication > 1:
        try:
            check_feasible(len(current.layers), current.num_experts, survivors, replication)
            break
        except PlacementError:
            replication -= 1
    try:
        check_feasible(len(current.layers), current.num_experts, survivors, replication)
    except PlacementError as error:
        raise PlacementError(
            f"cannot recover from the loss of servers {sorted(failed_set)}: {error}"
        ) from None
    try:
        return _rebuild(current, survivors, loads, cost, horizon_steps, replication)
    except PlacementError as error:
        raise PlacementError(
            f"cannot recover from the loss of servers {sorted(failed_set)}: {error}"
        ) from None


def _rebuild(
    current: Placement,
    survivors: list[Server],
    load: np.ndarray,
    cost: CostModel,
    horizon_steps: int,
    replication: int,
) -> Placement:
    keep = [current.server_index(s.ordinal) for s in survivors]
    original = current.hosting_matrix()[keep]
    search = search_for(
        current, load, cost, horizon_steps, servers=survivors, matrix=original, replication=replication
    )
    counts = original.sum(axis=0)  # [L, E]
    # Pairs with no replica left first, then the heaviest under-replicated ones.
    short = np.argwhere(counts < replication)
    priority = sorted(
        ((int(counts[l, e]), -float(load[l, e]), int(l), int(e)) for l, e in short),
    )
    pairs = [(l, e) for _, _, l, e in priority]
    covered_short = set(pairs)
    pairs += [pair for pair in search.under_spread() if pair not in covered_short]
    search.ensure_replicas(pairs)
    search.settle()
    return _result(current, survivors, search.matrix(), replication)


def _result(current: Placement, servers: list[Server], matrix: np.ndarray, replication: int) -> Placement:
    return Placement.from_matrix(
        current.layers, current.num_experts, servers, matrix, replication, current.version + 1
    )
