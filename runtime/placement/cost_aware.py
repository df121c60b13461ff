"""`cost_aware`: the latency-optimal rebalance of seed 002 ("Latency-Optimal Load Balancing for
Distributed MoE Inference").

Unlike EPLB it starts from the current placement and only moves what pays: it minimises predicted
latency over the next ``horizon_steps`` steps = compute (busiest server per layer) + weight
movement (busiest loader) + planner runtime, taking improving relocations, replications and swaps
between the most and least loaded servers (see `eaas.runtime.placement.search`), and returns the
current placement unchanged when the predicted gain does not pay for the moves.
"""

from __future__ import annotations

import numpy as np

from eaas.runtime.placement.cost import CostModel, check_horizon, check_load, predicted_seconds, server_loads
from eaas.runtime.placement.placement import Placement, PlacementError
from eaas.runtime.placement.search import Search


def cost_aware(
    current: Placement,
    load: np.ndarray,
    cost: CostModel | None = None,
    *,
    horizon_steps: int = 100,
    max_moves: int | None = None,
) -> Placement:
    """Rebalance ``current`` for predicted ``load``, moving as little as pays.

    Args:
        current: the placement being served.
        load: float ``[L, E]`` predicted tokens per step per (layer, expert), rows in
            ``current.layers`` order (e.g. a moving average of the servers' counters).
        cost: the latency model (default `CostModel()`).
        horizon_steps: steps the new placement will serve before the next rebalance; the gain per
            step is multiplied by it, the movement is paid once.
        max_moves: optional budget of moves (a move loads at most two experts).

    Returns:
        ``current`` itself when no rebalance pays, else a new placement with ``version + 1``.
    """
    cost = cost or CostModel()
    check_horizon(horizon_steps)
    if max_moves is not None and (not isinstance(max_moves, int) or max_moves < 0):
        raise PlacementError(f"max_moves must be an int >= 0 or None, got {max_moves!r}")
    loads = check_load(load, len(current.layers), current.num_experts)
    if max_moves == 0 or not _may_pay(current, loads, cost, horizon_steps):
        return current
    domain_ids, _ = current.domain_ids()
    matrix = current.hosting_matrix()
    search = Search(
        matrix,
        matrix,
        loads,
        [server.capacity for server in current.servers],
        domain_ids.tolist(),
        current.replication,
        current.required_spread,
        cost,
        horizon_steps,
        max_moves=max_moves,
    )
    search.optimize()
    if not search.log:
        return current
    candidate = Placement.from_matrix(
        current.layers, current.num_experts, current.servers, search.matrix(), current.replication,
        current.version + 1,
    )  # fmt: skip
    if candidate.same_assignment(current):
        return current
    keep = predicted_seconds(current, current, loads, cost, horizon_steps)
    if predicted_seconds(current, candidate, loads, cost, horizon_steps) >= keep:
        return current
    return candidate


def _may_pay(current: Placement, load: np.ndarray, cost: CostModel, horizon_steps: int) -> bool:
    """Quick skip: even a perfect balance (every layer's peak down to its mean) gains at most
    ``horizon * seconds_per_token * sum_l (peak_l - mean_l)``; one load costs at least
    ``seconds_per_expert_load``. If the bound does not cover that plus the planner, nothing pays."""
    per_server = server_loads(current, load)  # [L, S]
    bound = (
        horizon_steps
        * cost.seconds_per_token
        * float((per_server.max(axis=1) - per_server.mean(axis=1)).sum())
    )
    return bound > cost.seconds_per_expert_load + cost.planner_seconds
