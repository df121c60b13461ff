"""`cost_aware`: the latency-optimal rebalance of “Latency-Optimal Load Balancing for Distributed
MoE Inference” (INET4AI 2025).

Unlike EPLB it starts from the current placement and only moves what pays: it minimises predicted
latency over the next ``horizon_steps`` steps = compute (busiest server per layer) + weight
movement (busiest loader) + planner runtime, taking improving relocations, replications and swaps
between the most and least loaded servers, and returns the current placement unchanged when the
predicted gain does not pay for the moves.

The search is `eaas.runtime.placement.search`, the planners' one search (rounds of moves for all
layers at once, in array operations; the elastic operations use it too). On small instances (at
most ``PORTFOLIO_MAX_CELLS`` server x layer x expert cells), where a search costs about a
millisecond, it also runs the rounds with other steps and weights and an iterated local search
(`Search.escape`), and keeps the best. With ``cost.failover_factor`` > 0 (the default) the
objective also bounds the busiest survivor of any single failure, and the search gives hot
experts the replicas that takes.

Moving little is a local search, and a placement that has aged through many rebalances can sit in
a poor local optimum; when the gain the search leaves is large next to a fresh packing's movement
(long horizons), a from-scratch packing (`replicate_and_pack`) with its servers exchanged to keep
as much in place as possible (`keep_in_place`) is scored with the same objective and taken if it
is better (the failure-aware packing: the same balance, with each server's experts' other
replicas on many servers). With ``cost.load_error`` > 0 the objective counts forecast tokens,
which prefer servers that serve several light shares over one heavy share
(`eaas.runtime.placement.cost`).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from eaas.runtime.placement.cost import (
    CostModel,
    check_horizon,
    check_load,
    compute_peaks,
    forecast_loads,
    predicted_seconds,
)
from eaas.runtime.placement.eplb import keep_in_place, replicate_and_pack
from eaas.runtime.placement.placement import Placement, PlacementError
from eaas.runtime.placement.search import SMALL_CELLS, search_for

PORTFOLIO_MAX_CELLS = SMALL_CELLS  # S x L x E up to which cost_aware tries several searches
FRESH_PACK_RELOAD = 1.0
"""A fresh packing is scored when the compute gain the search left (its peaks above the layers'
means) exceeds the time to reload this many times the largest server's slots. Kept in place, a
fresh packing of the DeepSeek-V3 shape in benchmarks/placement.py reloads about 80% of the
busiest server, and its own imbalance (about 4%) costs as much again at a 1000-step horizon; it
won there when the search had left more than about 4 reloads' worth, and never at shorter
horizons or from round-robin."""


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
        max_moves: optional budget of expert loads: the new placement hosts at most this many
            (layer, expert, server) slots that ``current`` does not (`diff`'s ``num_moves``);
            when it binds, the search buys the moves with the best gain per load. A budget also
            rules out the from-scratch packing, which reloads most of the pool.

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
    tokens = forecast_loads(current, loads, cost.load_error)  # [L, S]
    floor = loads.sum(axis=1) / current.num_servers  # [L] no placement's peak is below its mean
    counts = current.replica_counts()
    excess = compute_peaks(current, loads, cost, tokens) - tokens.max(axis=1)  # [L] the failover term
    bound = gain_bound(tokens, counts, current.replication, cost, horizon_steps, floor=floor, excess=excess)
    if bound <= cost.planner_seconds:
        return current
    search = search_for(current, loads, cost, horizon_steps, tokens=tokens, max_moves=max_moves)
    keep = search.objective()  # the current placement's predicted seconds (it moves nothing)
    best = search.optimize()
    matrix = search.matrix() if search.changed else None
    if current.hosting_matrix().size <= PORTFOLIO_MAX_CELLS:
        for value, found in _portfolio(current, loads, cost, horizon_steps, tokens, max_moves):
            if value < best - 1e-12:
                best, matrix = value, found
    left = search.compute() - search.fixed - search.coef * float(floor.sum())  # gain still possible
    reload = FRESH_PACK_RELOAD * cost.seconds_per_expert_load * max(s.capacity for s in current.servers)
    if max_moves is None and left > reload:
        fresh = keep_in_place(current, replicate_and_pack(current, loads, failure_aware=True))
        value = predicted_seconds(current, fresh, loads, replace(cost, planner_seconds=0.0), horizon_steps)
        if value < best - 1e-12 and value + cost.planner_seconds < keep:
            return fresh.with_version(current.version + 1)
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
        search = search_for(
            current, load, cost, horizon_steps, tokens=tokens, max_moves=max_moves, swap_weight=swap_weight
        )
        value = search.optimize(step=step, pairs_per_step=pairs_per_step, stop_step=1)
        if search.changed:
            found.append((value, search.matrix()))
    search = search_for(current, load, cost, horizon_steps, tokens=tokens, max_moves=max_moves)
    value = search.settle()
    if search.changed:
        found.append((value, search.matrix()))
    return found


def gain_bound(
    tokens: np.ndarray,
    counts: np.ndarray,
    replication: int,
    cost: CostModel,
    horizon_steps: int,
    *,
    floor: np.ndarray | None = None,
    excess: np.ndarray | None = None,
) -> float:
    """An upper bound on what any rebalance of the current placement can save (predicted seconds,
    planner runtime aside); `cost_aware` skips the search when it does not exceed
    ``planner_seconds``.

    ``tokens``: ``[L, S]`` (forecast) tokens per layer and server on the current placement;
    ``counts``: its replica counts ``[L, E]``; ``floor``: ``[L]`` a level no placement's peak goes
    below (default: the mean of ``tokens``; with ``load_error`` > 0 replicating lowers the forecast
    tokens' mean, so the caller passes the plain tokens' mean). Lowering layer ``l``'s peak to a
    level ``T`` gains at most ``H * seconds_per_token * (peak_l - max(T, floor_l))``, and every
    server above ``T`` must shed tokens: a relocation or swap lowers one server, a replication
    lowers the expert's current hosts (``R`` of them in a layer without surplus replicas; where a
    layer has some, a free drop may lower a server, and only the gain counts there). So at least
    ``n_l(T) / R`` loads, of which the busiest loader bears at least ``1 / S``, and at least one
    load in all unless some layer has surplus replicas (then drops alone may gain). ``excess``:
    ``[L]`` how far each layer's counted peak lies above its busiest server (the failover term,
    `compute_peaks`); a rebalance may remove all of it, so it is added to every layer's bound."""
    coef = horizon_steps * cost.seconds_per_token
    num_servers = tokens.shape[1]
    mean = (tokens.mean(axis=1) if floor is None else np.asarray(floor, dtype=np.float64))[:, None]
    # Column k < S: lower the peak to just above the (k+1)-th busiest server (k servers must shed);
    # column S: down to the floor (all S shed; the floor may lie below every server's tokens).
    ordered = np.concatenate([-np.sort(-tokens, axis=1), mean], axis=1)  # [L, S + 1] busiest first
    gains = coef * (ordered[:, :1] - np.maximum(ordered, mean))  # column 0 = 0
    charged = gains - cost.seconds_per_expert_load / (num_servers * replication) * np.arange(num_servers + 1)
    surplus = (counts > replication).any(axis=1)
    charged[surplus] = gains[surplus]
    if excess is not None:
        extra = coef * np.maximum(np.asarray(excess, dtype=np.float64), 0.0)[:, None]
        gains, charged = gains + extra, charged + extra
    perfect = float(gains.max(axis=1).sum())  # every peak down to its floor
    one_load = 0.0 if surplus.any() else cost.seconds_per_expert_load
    return min(perfect - one_load, float(charged.max(axis=1).sum()))
