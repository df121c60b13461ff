"""`cost_aware`: the latency-optimal rebalance of seed 002 ("Latency-Optimal Load Balancing for
Distributed MoE Inference").

Unlike EPLB it starts from the current placement and only moves what pays: it minimises predicted
latency over the next ``horizon_steps`` steps = compute (busiest server per layer) + weight
movement (busiest loader) + planner runtime, taking improving relocations, replications and swaps
between the most and least loaded servers, and returns the current placement unchanged when the
predicted gain does not pay for the moves.

The search is `eaas.runtime.placement.batched` (rounds of moves for all layers at once, in array
operations). On small instances (at most ``PORTFOLIO_MAX_CELLS`` server x layer x expert cells),
where a search costs about a millisecond, it also runs the rounds with finer steps and the
move-by-move `eaas.runtime.placement.search` (with its two-step chains), and keeps the best.
"""

from __future__ import annotations

import itertools

import numpy as np

from eaas.runtime.placement.batched import BatchedSearch
from eaas.runtime.placement.cost import CostModel, check_horizon, check_load, server_loads
from eaas.runtime.placement.placement import Placement, PlacementError
from eaas.runtime.placement.search import search_for

PORTFOLIO_MAX_CELLS = 1 << 12  # S x L x E up to which cost_aware tries several searches


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
    if max_moves == 0:
        return current
    tokens = server_loads(current, loads)  # [L, S]
    if not _may_pay(tokens, cost, horizon_steps):
        return current
    search = BatchedSearch(current, loads, cost, horizon_steps, tokens=tokens, max_moves=max_moves)
    keep = search.objective()  # the current placement's predicted seconds (it moves nothing)
    best = search.optimize()
    matrix = search.matrix() if search.changed else None
    if current.hosting_matrix().size <= PORTFOLIO_MAX_CELLS:
        for value, found in _portfolio(current, loads, cost, horizon_steps, tokens, max_moves):
            if value < best - 1e-12:
                best, matrix = value, found
    if matrix is None or best + cost.planner_seconds >= keep:
        return current
    # A strictly better objective means a different assignment.
    return Placement.from_matrix(
        current.layers, current.num_experts, current.servers, matrix, current.replication,
        current.version + 1,
    )  # fmt: skip


def _portfolio(
    current: Placement,
    load: np.ndarray,
    cost: CostModel,
    horizon_steps: int,
    tokens: np.ndarray,
    max_moves: int | None,
) -> list[tuple[float, np.ndarray]]:
    """The other searches tried on small instances: (objective, hosting matrix) of each that moved."""
    found = []
    for step, swap_weight, pairs_per_step in itertools.product((1, 2, 4), (0.5, 0.75, 1.0), (1.0, 2.0)):
        search = BatchedSearch(
            current, load, cost, horizon_steps, tokens=tokens, max_moves=max_moves, swap_weight=swap_weight
        )
        value = search.optimize(step=step, pairs_per_step=pairs_per_step, stop_step=1)
        if search.changed:
            found.append((value, search.matrix()))
    matrix = current.hosting_matrix()
    move_by_move = search_for(
        current, current.servers, matrix, matrix, load, cost, horizon_steps, max_moves=max_moves
    )
    value = move_by_move.optimize()
    if move_by_move.log:
        found.append((value, move_by_move.matrix()))
    return found


def _may_pay(tokens: np.ndarray, cost: CostModel, horizon_steps: int) -> bool:
    """Quick skip: even a perfect balance (every layer's peak down to its mean) gains at most
    ``horizon * seconds_per_token * sum_l (peak_l - mean_l)``; one load costs at least
    ``seconds_per_expert_load``. If the bound does not cover that plus the planner, nothing pays.
    ``tokens``: ``[L, S]`` per server and layer on the current placement."""
    bound = horizon_steps * cost.seconds_per_token * float((tokens.max(axis=1) - tokens.mean(axis=1)).sum())
    return bound > cost.seconds_per_expert_load + cost.planner_seconds
