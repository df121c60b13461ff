"""The latency model every planner optimises (seed 002, "Latency-Optimal Load Balancing").

Load is routed tokens per (layer, expert): ``load[L, E]`` float, rows in ``placement.layers`` order
(L = MoE layers, E = experts, S = servers in ordinal order, T = steps). An expert's tokens are
spread evenly over its replicas, so server ``s`` serves ``load[l, e] / replicas[l, e]`` of every
(l, e) it hosts.

Predicted latency of running ``candidate`` for ``horizon_steps`` steps, starting from ``current``::

    horizon_steps * sum_l (seconds_per_layer + seconds_per_token * max_s tokens[l, s])   # compute
    + seconds_per_expert_load * max_s (experts server s must newly load)                 # movement
    + planner_seconds                                    (only when the placement changes)

Each MoE layer is synchronous, so its time is that of its busiest server; servers load weights in
parallel, so movement costs the busiest loader's time. Dropping an expert is free. A server that
is not in ``current`` loads before the new placement is committed and stalls nobody.

The load is a forecast (e.g. the mean of the last steps), and it is wrong by the time the placement
serves: experts' loads drift. With ``load_error`` = rho > 0 (the forecast's relative error over the
horizon, `prediction_error`), ``tokens`` in the compute term are *forecast tokens*: each replica's
share ``x`` of layer ``l`` counts ``x * (1 + rho * x / m_l)``, ``m_l`` = the layer's mean tokens
per server. A server's load then deviates from its forecast by about ``rho * sqrt(sum x^2)`` (each
share by ``rho * x``, independently), and the busiest server is the one that deviates upwards; the
``x^2 / m_l`` term is that spread to first order around a balanced server, so a server that serves
one heavy share counts more than one serving the same tokens as several light shares, and
replicating a heavy expert pays for itself sooner. ``load_error = 0`` is the plain forecast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from eaas.runtime.placement.placement import Placement, PlacementError


@dataclass(frozen=True)
class CostModel:
    """Linear cost functions, profiled per deployment (defaults: a DeepSeek-V3 FP8 expert on an
    H100-class GPU — 3 x 7168 x 2048 weights, ~44 MB — loaded over a ~50 GB/s link).

    seconds_per_token: compute time per routed token on one server (slope of the linear model).
    seconds_per_layer: fixed time per MoE layer per step (launch, weight reads, round trip).
    seconds_per_expert_load: time for one server to load one expert's weights.
    planner_seconds: the planner's own runtime, charged to any rebalance that changes placement.
    load_error: relative error of the load forecast over the horizon (`prediction_error` measures
        it from the counters); shares are weighted by it as described in the module docstring.
        Not a profile of the deployment but of the forecast: set it per rebalance with
        ``dataclasses.replace``. `cost_aware` uses it; `ilp` and the elastic operations plan for
        the forecast itself.
    """

    seconds_per_token: float = 0.25e-6
    seconds_per_layer: float = 50e-6
    seconds_per_expert_load: float = 1e-3
    planner_seconds: float = 0.0
    load_error: float = 0.0

    def __post_init__(self) -> None:
        fields = (
            "seconds_per_token",
            "seconds_per_layer",
            "seconds_per_expert_load",
            "planner_seconds",
            "load_error",
        )
        for field in fields:
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise PlacementError(f"CostModel.{field} must be a finite number >= 0, got {value!r}")
        if self.seconds_per_token <= 0:
            raise PlacementError("CostModel.seconds_per_token must be > 0")


def check_load(load: object, num_layers: int, num_experts: int) -> np.ndarray:
    """Validate ``load`` as float ``[L, E]`` tokens (finite, >= 0) and return it as float64."""
    array = np.asarray(load, dtype=np.float64)
    if array.shape != (num_layers, num_experts):
        raise PlacementError(
            f"load has shape {array.shape}; expected [L, E] = ({num_layers}, {num_experts}) tokens per "
            "(layer, expert), rows in placement.layers order"
        )
    if not np.isfinite(array).all() or (array < 0).any():
        raise PlacementError("load must hold finite token counts >= 0")
    return array


def routing_weights(placement: Placement) -> np.ndarray:
    """float64 ``[L, E, S]``: the share of (l, e)'s tokens that server s serves (1/replicas or 0)."""
    return placement.replica_shares()


def server_loads(placement: Placement, load: np.ndarray) -> np.ndarray:
    """Tokens each server serves per layer: ``load [..., L, E]`` → ``[..., L, S]`` float64."""
    array = np.asarray(load, dtype=np.float64)
    if array.shape[-2:] != (len(placement.layers), placement.num_experts):
        raise PlacementError(
            f"load has shape {array.shape}; expected [..., L, E] with L={len(placement.layers)}, "
            f"E={placement.num_experts}"
        )
    if array.ndim == 2:
        return _per_server(placement, array / np.maximum(placement.hosted_entries()[3], 1))
    weights = routing_weights(placement)  # [L, E, S]
    # [L, ..., E] @ [L, E, S] -> [L, ..., S], then layers back to axis -2.
    moved = np.moveaxis(array, -2, 0)
    flat = moved.reshape(moved.shape[0], -1, moved.shape[-1])
    result = np.matmul(flat, weights).reshape(*moved.shape[:-1], weights.shape[-1])
    return np.moveaxis(result, 0, -2)


def failover_shares(share: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``[L, E]``: the tokens each other host of an expert takes over when one of its
    ``counts`` replicas (of ``share`` tokens each) fails: ``share / (counts - 1)``; 0 for an
    expert with a single replica (nothing takes it over)."""
    return np.where(counts > 1, share / np.maximum(counts - 1, 1), 0.0)


def failover_loads(placement: Placement, load: np.ndarray) -> np.ndarray:
    """float64 ``[S, L]``: for every server ``s`` (ordinal order) failing alone, each layer's
    busiest surviving server's tokens while the clients fail over (no re-plan: an expert's tokens
    split evenly over its live replicas, so each other host of an expert ``s`` hosted takes
    ``share / (replicas - 1)`` more); ``inf`` where ``s`` held an expert's only replica.

    Per layer, with ``H [S, E]`` the hosting and ``w = share / (replicas - 1)``, the extra tokens
    server ``u`` takes when ``s`` fails is ``(H diag(w) H^T)[s, u]``: large where two servers share
    many experts (EPLB's packing pairs servers that way, so one failure doubles its partner's
    load), small where each server's experts have their other replicas spread over many."""
    loads = check_load(load, len(placement.layers), placement.num_experts)
    hosting = placement.hosting_matrix()  # [S, L, E]
    counts = hosting.sum(axis=0)  # [L, E]
    extra = failover_shares(loads / np.maximum(counts, 1), counts)  # [L, E]
    tokens = server_loads(placement, loads)  # [L, S]
    num_servers = placement.num_servers
    result = np.empty((num_servers, len(placement.layers)))
    diagonal = np.arange(num_servers)
    for l in range(len(placement.layers)):
        held = hosting[:, l, :].astype(np.float64)  # [S, E]
        after = tokens[l][None, :] + (held * extra[l]) @ held.T  # [failed s, survivor u]
        after[diagonal, diagonal] = -np.inf
        result[:, l] = after.max(axis=1) if num_servers > 1 else np.inf
        result[(hosting[:, l, :] & (counts[l] == 1)[None, :]).any(axis=1), l] = np.inf  # a last replica
    return result


def _per_server(placement: Placement, shares: np.ndarray) -> np.ndarray:
    """``[L, S]``: every hosted pair's share ``shares [L, E]`` summed per (layer, server) (sparse,
    no ``[L, E, S]`` array)."""
    layer, server, expert, _ = placement.hosted_entries()
    num_layers, num_servers = len(placement.layers), placement.num_servers
    cells = np.bincount(
        layer * num_servers + server, weights=shares[layer, expert], minlength=num_layers * num_servers
    )
    return cells.reshape(num_layers, num_servers)


def forecast_shares(load: np.ndarray, counts: np.ndarray, load_error: float, num_servers: int) -> np.ndarray:
    """``[L, E]`` forecast tokens of one replica of each (layer, expert): share ``x = load / counts``
    weighted ``x * (1 + load_error * x / m_l)`` (module docstring); ``counts`` >= 1."""
    share = load / counts
    if load_error == 0:
        return share
    mean = load.sum(axis=1, keepdims=True) / max(1, num_servers)  # [L, 1] tokens per server
    return share + load_error * share * share / np.where(mean > 0, mean, 1.0)


def forecast_loads(placement: Placement, load: np.ndarray, load_error: float) -> np.ndarray:
    """``[L, S]`` forecast tokens per layer and server for ``load [L, E]``: `server_loads` with
    every replica's share weighted by `forecast_shares` (equal to it when ``load_error`` is 0)."""
    if load_error == 0:
        return server_loads(placement, load)
    counts = np.maximum(placement.hosted_entries()[3], 1)
    array = np.asarray(load, dtype=np.float64)
    return _per_server(placement, forecast_shares(array, counts, load_error, placement.num_servers))


def prediction_error(
    predicted: np.ndarray, actual: np.ndarray, predicted_steps: int, actual_steps: int
) -> float:
    """The relative error of a load forecast, for `CostModel.load_error`: ``predicted`` was the
    mean of ``predicted_steps`` steps of per-step load ``[L, E]``, ``actual`` the mean of the
    ``actual_steps`` steps it then served (both tokens per step). Returns rho with
    ``sum (actual - predicted)^2 = rho^2 * sum predicted^2 + sampling noise``: routed-token counts
    are Poisson-like (variance = mean), so the means carry a noise of ``load / steps`` each, which
    no placement can hedge and which is subtracted. 0 when the forecast has no tokens."""
    for name, steps in (("predicted_steps", predicted_steps), ("actual_steps", actual_steps)):
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise PlacementError(f"{name} must be an int >= 1, got {steps!r}")
    p = np.asarray(predicted, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    if p.shape != a.shape or p.ndim != 2:
        raise PlacementError(
            f"predicted and actual must both be [L, E] tokens per step, got {p.shape} and {a.shape}"
        )
    if not (np.isfinite(p).all() and np.isfinite(a).all()) or (p < 0).any() or (a < 0).any():
        raise PlacementError("predicted and actual must hold finite token counts >= 0")
    scale = float((p * p).sum())
    if scale == 0:
        return 0.0
    noise = float(p.sum()) * (1 / predicted_steps + 1 / actual_steps)
    return math.sqrt(max(0.0, float(((a - p) ** 2).sum()) - noise) / scale)


def imbalance(placement: Placement, load: np.ndarray) -> float:
    """Per-server max/mean tokens, averaged over layers (1.0 = perfectly balanced). The mean is over
    all servers; a layer without tokens counts as 1.0."""
    per_server = server_loads(placement, check_load(load, len(placement.layers), placement.num_experts))
    return float(np.mean(max_over_mean(per_server)))


def max_over_mean(per_server: np.ndarray) -> np.ndarray:
    """``[..., S]`` tokens per server → ``[...]`` max/mean (1.0 where there are no tokens)."""
    mean = per_server.mean(axis=-1)
    peak = per_server.max(axis=-1)
    return np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)


def step_seconds(placement: Placement, load: np.ndarray, cost: CostModel) -> float:
    """Modelled MoE time of one step with per-step ``load [L, E]``: sum over layers of the busiest
    server's time."""
    per_server = server_loads(placement, check_load(load, len(placement.layers), placement.num_experts))
    peaks = per_server.max(axis=-1)  # [L]
    return float(len(peaks) * cost.seconds_per_layer + cost.seconds_per_token * peaks.sum())


def movement_seconds(current: Placement, candidate: Placement, cost: CostModel) -> float:
    """Time the busiest already-serving server spends loading experts to go from ``current`` to
    ``candidate`` (servers new in ``candidate`` load before they serve and are not counted)."""
    if current.layers != candidate.layers or current.num_experts != candidate.num_experts:
        raise PlacementError("current and candidate place different models (layers/num_experts differ)")
    old_matrix = current.hosting_matrix()
    new_matrix = candidate.hosting_matrix()
    current_ordinals = set(current.ordinals)
    columns = [column for column, ordinal in enumerate(candidate.ordinals) if ordinal in current_ordinals]
    if not columns:
        return 0.0
    old_columns = [current.server_index(candidate.ordinals[column]) for column in columns]
    fresh = new_matrix[columns] & ~old_matrix[old_columns]  # [S', L, E] newly loaded
    worst = int(fresh.reshape(len(columns), -1).sum(axis=1).max())
    return worst * cost.seconds_per_expert_load


def predicted_seconds(
    current: Placement, candidate: Placement, load: np.ndarray, cost: CostModel, horizon_steps: int
) -> float:
    """The objective: latency of serving ``horizon_steps`` steps of per-step ``load [L, E]`` on
    ``candidate``, plus moving there from ``current``, plus the planner's runtime if it moved.
    With ``cost.load_error`` > 0 the compute term counts forecast tokens (`forecast_loads`)."""
    check_horizon(horizon_steps)
    array = check_load(load, len(candidate.layers), candidate.num_experts)
    peaks = forecast_loads(candidate, array, cost.load_error).max(axis=-1)  # [L]
    per_step = len(peaks) * cost.seconds_per_layer + cost.seconds_per_token * float(peaks.sum())
    total = horizon_steps * per_step + movement_seconds(current, candidate, cost)
    if not current.same_assignment(candidate):
        total += cost.planner_seconds
    return total


def check_horizon(horizon_steps: int) -> None:
    if not isinstance(horizon_steps, int) or isinstance(horizon_steps, bool) or horizon_steps < 1:
        raise PlacementError(
            f"horizon_steps must be an int >= 1 (steps until the next rebalance), got {horizon_steps!r}"
        )
