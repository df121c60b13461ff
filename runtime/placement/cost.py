"""The latency model every planner optimises (“Latency-Optimal Load Balancing for Distributed MoE
Inference”, INET4AI 2025).

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

Failure: when a server fails, its clients fail its experts over to their other replicas until the
re-plan commits, and each other host of an expert takes ``share / (replicas - 1)`` more. With
``failover_factor`` = alpha > 0 and R >= 2, a layer's compute term also counts how far its
*failover peak* (the busiest survivor's tokens after the worst single failure in the layer,
`failover_peaks`) exceeds ``alpha_l * m_l``: ``peak_l + max(0, failover_peak_l - alpha_l * m_l)``.
``m_l`` is the layer's mean tokens per server, the peak of a perfectly balanced layer, so the bound
does not move with the placement (a bound on ``alpha * peak_l`` would reward raising the healthy
peak); ``alpha_l`` is alpha or, where no placement of the layer can reach it, the ratio a perfect
one would have (`failover_limits`). A token over the bound counts as much as a token of the
healthy peak. Within the bound, a failure costs nothing in the objective: faults are rare, and the
failover state lasts the seconds until the re-plan commits, so the planners keep it bounded
rather than trade steady-state balance for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from eaas.runtime.placement.placement import Placement, PlacementError

FAILOVER_FACTOR = 1.3
"""Default `CostModel.failover_factor`. DeepSeek-V3's shape on 64 servers with R = 2 and the
drifting trace of benchmarks/placement.py (part D): the failure-aware packing starts at 1.27x
its layers' means (the busiest survivor of the worst failure, per layer), rebalancing without the
bound drifts to 1.38x, and with 1.3 it stays at 1.27–1.31x at the same steady-state balance."""


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
    failover_factor: how far above the healthy peak a layer's busiest server may go while one
        server's experts fail over to their other replicas (module docstring); 0 plans for the
        healthy state only. `cost_aware` and the elastic operations use it; `ilp` and the EPLB
        baseline do not.
    """

    seconds_per_token: float = 0.25e-6
    seconds_per_layer: float = 50e-6
    seconds_per_expert_load: float = 1e-3
    planner_seconds: float = 0.0
    load_error: float = 0.0
    failover_factor: float = FAILOVER_FACTOR

    def __post_init__(self) -> None:
        fields = (
            "seconds_per_token",
            "seconds_per_layer",
            "seconds_per_expert_load",
            "planner_seconds",
            "load_error",
            "failover_factor",
        )
        for field in fields:
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise PlacementError(f"CostModel.{field} must be a finite number >= 0, got {value!r}")
        if self.seconds_per_token <= 0:
            raise PlacementError("CostModel.seconds_per_token must be > 0")
        if 0 < self.failover_factor < 1:
            raise PlacementError(
                f"CostModel.failover_factor must be 0 (off) or >= 1, got {self.failover_factor!r}: "
                "a failure never lowers the busiest survivor's load"
            )


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
    hosting = placement.hosting_matrix().transpose(1, 0, 2)  # [L, S, E]
    counts = placement.replica_counts()  # [L, E]
    overlap = failover_overlap(hosting, loads / np.maximum(counts, 1), counts)  # [L, S, S]
    after = server_loads(placement, loads)[:, None, :] + overlap  # [L, failed s, survivor u]
    diagonal = np.arange(placement.num_servers)
    after[:, diagonal, diagonal] = -np.inf
    result = after.max(axis=2).T if placement.num_servers > 1 else np.full((1, len(placement.layers)), np.inf)
    result[(hosting & (counts == 1)[:, None, :]).any(axis=2).T] = np.inf  # a last replica
    return np.asarray(result, dtype=np.float64)


def failover_overlap(hosting: np.ndarray, share: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``[L, S, S]`` the tokens server ``u`` takes over when ``s`` fails, at ``[l, s, u]``
    (``H diag(w) H^T`` per layer), for ``hosting`` bool ``[L, S, E]``, ``share [L, E]`` tokens per
    replica and ``counts [L, E]`` replicas. Summed over the hosted pairs (each adds its ``w`` at
    every two of its hosts), not multiplied out: ``L x E x R^2`` terms instead of ``L x S^2 x E``."""
    num_layers, num_servers, num_experts = hosting.shape
    layer, server, expert = np.nonzero(hosting)
    order = np.lexsort((server, expert, layer))  # the hosts of each pair together
    layer, server, expert = layer[order], server[order], expert[order]
    weight = failover_shares(share, counts)[layer, expert]
    cells, row = overlap_cells(layer * num_experts + expert, layer, server, num_servers)
    overlap = np.bincount(cells, weights=weight[row], minlength=num_layers * num_servers * num_servers)
    return overlap.reshape(num_layers, num_servers, num_servers)


def overlap_cells(
    pair: np.ndarray, layer: np.ndarray, server: np.ndarray, num_servers: int
) -> tuple[np.ndarray, np.ndarray]:
    """For host entries ``(pair, layer, server)`` ``[N]`` grouped by ``pair`` (one entry per
    replica): the flat indices into ``[L, S, S]`` of every two hosts ``(s, u)`` of one pair (both
    orders and ``s = u``), and for each the entry of ``s``."""
    if len(pair) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    start = np.flatnonzero(np.concatenate(([True], pair[1:] != pair[:-1])))
    size = np.diff(np.append(start, len(pair)))  # hosts per pair
    group_start = np.repeat(start, size)  # [N] the first entry of each entry's pair
    repeats = np.repeat(size, size)  # [N] hosts of each entry's pair
    first = np.repeat(np.arange(len(pair)), repeats)
    offset = np.arange(len(first)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
    second = group_start[first] + offset
    return (layer[first] * num_servers + server[first]) * num_servers + server[second], first


def failover_limits(
    factor: float, counts: np.ndarray, num_servers: int, replication: int
) -> np.ndarray | None:
    """``[L]`` the factor over its mean tokens per server each layer's failover peak is held to
    (`CostModel.failover_factor`), or
    None when failures are not planned for (``factor`` 0, fewer than 2 servers, or R = 1: a
    failure then makes experts unavailable, which only R prevents).

    A layer's limit is ``factor`` or, where that is out of reach, the ratio an even placement
    would have: a server's experts have ``k`` other replicas in all (on average over servers,
    ``sum_e c_e (c_e - 1) / S`` for replica counts ``c [E]``), each taking an equal part of its
    tokens when it fails, and at best they lie on the other servers as evenly as whole replicas
    can: the busiest survivor holds ``ceil(k / (S - 1))`` of them and carries
    ``1 + ceil(k / (S - 1)) / k`` times the mean. With DeepSeek-V3's 256 experts on 64 servers and
    R = 2 that is 1.125; 8 experts on 4 servers (two layers' worth of the tiny test model), 1.5."""
    if factor == 0 or num_servers < 2 or replication < 2:
        return None
    others = np.maximum((counts * np.maximum(counts - 1, 0)).sum(axis=1) / num_servers, 1e-9)  # [L] k
    busiest = np.ceil(others / (num_servers - 1) - 1e-9)
    return np.maximum(factor, 1.0 + busiest / others)


def failover_peaks(
    hosting: np.ndarray, tokens: np.ndarray, share: np.ndarray, counts: np.ndarray
) -> np.ndarray:
    """``[L]`` each layer's busiest survivor after the worst single failure (clients fail over, no
    re-plan), for ``hosting`` bool ``[L, S, E]``, ``tokens [L, S]`` per server, ``share [L, E]``
    tokens per replica and ``counts [L, E]`` replicas. Experts with one replica move nowhere
    (`failover_loads` marks them ``inf``; here they add nothing). ``-inf`` with one server."""
    return failover_peaks_from(failover_overlap(hosting, share, counts), tokens)


def failover_peaks_from(overlap: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """`failover_peaks` from ``overlap [L, S, S]``: the tokens server ``u`` takes over when ``s``
    fails, at ``[l, s, u]`` (the diagonal is ignored)."""
    num_servers = tokens.shape[1]
    after = tokens[:, None, :] + overlap  # [L, failed s, survivor u]
    diagonal = np.arange(num_servers)
    after[:, diagonal, diagonal] = -np.inf
    return np.asarray(after.reshape(len(tokens), -1).max(axis=1))


def compute_peaks(
    placement: Placement, load: np.ndarray, cost: CostModel, tokens: np.ndarray | None = None
) -> np.ndarray:
    """``[L]`` the tokens each layer's compute term counts: the busiest server's (forecast) tokens,
    plus how far the failover peak exceeds its bound (module docstring). ``tokens``: the
    placement's `forecast_loads` ``[L, S]``, if the caller has them."""
    array = check_load(load, len(placement.layers), placement.num_experts)
    if tokens is None:
        tokens = forecast_loads(placement, array, cost.load_error)  # [L, S]
    peaks = tokens.max(axis=-1)
    counts = placement.replica_counts()
    limits = failover_limits(cost.failover_factor, counts, placement.num_servers, placement.replication)
    if limits is None:
        return np.asarray(peaks)
    share = forecast_shares(array, np.maximum(counts, 1), cost.load_error, placement.num_servers)
    hosting = placement.hosting_matrix().transpose(1, 0, 2)
    bound = limits * array.sum(axis=1) / placement.num_servers
    return np.asarray(peaks + np.maximum(0.0, failover_peaks(hosting, tokens, share, counts) - bound))


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
    With ``cost.load_error`` > 0 the compute term counts forecast tokens (`forecast_loads`); with
    ``cost.failover_factor`` > 0, failover peaks over their limits (`compute_peaks`)."""
    check_horizon(horizon_steps)
    peaks = compute_peaks(candidate, load, cost)  # [L]
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
