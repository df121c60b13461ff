"""`ilp`: the exact optimum of the seed-002 objective with `scipy.optimize.milp` (HiGHS).

The oracle the heuristics are measured against, for small instances only (a few layers, tens of
experts, a handful of servers). Same model as `eaas.runtime.placement.cost`, planner runtime aside:

    minimise  horizon * seconds_per_token * sum_l t_l  +  seconds_per_expert_load * m
    over      p[l,e,s] in {0,1}   server s hosts (l, e)
              w[l,e,s] >= 0       tokens of (l, e) served by s
              q[l,e] >= 0         tokens per replica of (l, e)
    s.t.      R <= sum_s p[l,e,s] <= max_replicas;  sum_s w[l,e,s] = load[l,e]
              w = q * p, linearised: w <= load*p, w <= q, w >= q - load*(1 - p)
                  (so every replica serves the same share q = load / replicas)
              t_l >= sum_e w[l,e,s]  for every server s                  (layer peak)
              sum_{l,e} p[l,e,s] <= capacity_s
              m >= sum of p[l,e,s] over pairs s did not host before      (busiest loader)
              replicas cover >= min(R, domains) failure domains (when servers share domains)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eaas.runtime.placement.cost import CostModel, check_horizon, check_load, predicted_seconds
from eaas.runtime.placement.placement import Placement, PlacementError

MAX_VARIABLES = 20_000
"""Larger problems are refused: this is an oracle for small instances, not an online planner."""


@dataclass(frozen=True)
class IlpSolution:
    """placement: the best placement found (``current`` itself if that is optimal).
    predicted_seconds: its objective (without planner runtime). is_optimal: HiGHS proved
    optimality within ``mip_rel_gap`` before the time limit. mip_gap: the final relative gap."""

    placement: Placement
    predicted_seconds: float
    is_optimal: bool
    mip_gap: float | None


def ilp(
    current: Placement,
    load: np.ndarray,
    cost: CostModel | None = None,
    *,
    horizon_steps: int = 100,
    time_limit_seconds: float = 10.0,
    max_replicas: int | None = None,
    mip_rel_gap: float = 1e-4,
) -> IlpSolution:
    """Optimal placement for ``load [L, E]`` starting from ``current`` (same servers).

    max_replicas: upper bound C on replicas of one (layer, expert) (default: number of servers).
    Raises `PlacementError` if the instance is too large or HiGHS finds no feasible placement in
    the time limit.
    """
    cost = cost or CostModel()
    check_horizon(horizon_steps)
    if time_limit_seconds <= 0:
        raise PlacementError(f"time_limit_seconds must be > 0, got {time_limit_seconds}")
    if cost.load_error:
        raise PlacementError(
            f"ilp models the forecast itself (CostModel.load_error = 0), got load_error={cost.load_error}"
        )
    num_layers, num_experts, num_servers = len(current.layers), current.num_experts, current.num_servers
    loads = check_load(load, num_layers, num_experts)
    replication = current.replication
    top = num_servers if max_replicas is None else min(max_replicas, num_servers)
    if top < replication:
        raise PlacementError(f"max_replicas={max_replicas} is below replication={replication}")
    pairs = num_layers * num_experts
    domain_ids, num_domains = current.domain_ids()
    needed_domains = current.required_spread
    use_domains = needed_domains > 1 and num_domains < num_servers

    # Variable layout: p (binary hosting), w (tokens of (l, e) served by s), q (tokens per replica),
    # t (layer peaks), m (busiest loader), u (domain covered, binary; only with shared domains).
    p0 = 0
    w0 = p0 + pairs * num_servers
    q0 = w0 + pairs * num_servers
    t0 = q0 + pairs
    m0 = t0 + num_layers
    u0 = m0 + 1
    total = u0 + (pairs * num_domains if use_domains else 0)
    if total > MAX_VARIABLES:
        raise PlacementError(
            f"ilp: {total} variables exceed {MAX_VARIABLES}; it is an oracle for small instances "
            "(use cost_aware for real ones)"
        )

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []

    def constraint(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        row = len(lower)
        for col, val in entries:
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    for pair in range(pairs):
        demand = float(loads.reshape(-1)[pair])
        hosting = [p0 + pair * num_servers + s for s in range(num_servers)]
        served = [w0 + pair * num_servers + s for s in range(num_servers)]
        share = q0 + pair
        constraint([(col, 1.0) for col in hosting], replication, top)
        constraint([(col, 1.0) for col in served], demand, demand)
        for s in range(num_servers):
            # w = q * p (even split over the replicas): w <= demand * p, w <= q, w >= q - demand * (1 - p).
            constraint([(served[s], 1.0), (hosting[s], -demand)], -np.inf, 0)
            constraint([(served[s], 1.0), (share, -1.0)], -np.inf, 0)
            constraint([(served[s], 1.0), (share, -1.0), (hosting[s], -demand)], -demand, np.inf)
        if use_domains:
            for d in range(num_domains):
                members = np.flatnonzero(domain_ids == d).tolist()
                constraint(
                    [(u0 + pair * num_domains + d, 1.0)] + [(hosting[s], -1.0) for s in members], -np.inf, 0
                )
            constraint(
                [(u0 + pair * num_domains + d, 1.0) for d in range(num_domains)], needed_domains, np.inf
            )
    for l in range(num_layers):
        # Valid cut that tightens the LP relaxation: a layer's peak is at least its mean per server.
        constraint([(t0 + l, 1.0)], float(loads[l].sum()) / num_servers, np.inf)
        for s in range(num_servers):
            entries = [(t0 + l, 1.0)]
            entries += [(w0 + (l * num_experts + e) * num_servers + s, -1.0) for e in range(num_experts)]
            constraint(entries, 0, np.inf)
    before = current.hosting_matrix()
    for s, server in enumerate(current.servers):
        constraint([(p0 + pair * num_servers + s, 1.0) for pair in range(pairs)], -np.inf, server.capacity)
        fresh = np.flatnonzero(~before[s].reshape(-1)).tolist()
        constraint([(m0, 1.0)] + [(p0 + pair * num_servers + s, -1.0) for pair in fresh], 0, np.inf)

    scale = 1e3  # objective in milliseconds keeps HiGHS' tolerances meaningful
    objective = np.zeros(total)
    objective[t0 : t0 + num_layers] = scale * horizon_steps * cost.seconds_per_token
    objective[m0] = scale * cost.seconds_per_expert_load
    integrality = np.zeros(total)
    integrality[p0:w0] = 1
    integrality[u0:] = 1
    upper_bounds = np.ones(total)
    upper_bounds[w0:t0] = np.repeat(loads.reshape(-1), num_servers).tolist() + loads.reshape(-1).tolist()
    upper_bounds[t0 : m0 + 1] = np.inf
    # scipy loads in ~0.5 s: imported here so servers and clients that import placement skip it.
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lower), total)).tocsr()
    result = milp(
        objective,
        integrality=integrality,
        bounds=Bounds(np.zeros(total), upper_bounds),
        constraints=LinearConstraint(matrix, np.array(lower), np.array(upper)),
        options={"time_limit": float(time_limit_seconds), "mip_rel_gap": mip_rel_gap, "disp": False},
    )
    if result.x is None:
        raise PlacementError(
            f"ilp found no feasible placement within {time_limit_seconds}s: {result.message}"
        )
    hosting = np.round(result.x[p0:w0]).astype(bool).reshape(num_layers, num_experts, num_servers)
    candidate = Placement.from_matrix(
        current.layers, num_experts, current.servers, np.transpose(hosting, (2, 0, 1)), replication,
        current.version + 1,
    )  # fmt: skip
    keep = predicted_seconds(current, current, loads, cost, horizon_steps)
    value = predicted_seconds(current, candidate, loads, cost, horizon_steps) - (
        0.0 if candidate.same_assignment(current) else cost.planner_seconds
    )
    if candidate.same_assignment(current) or value >= keep:
        candidate, value = current, keep
    gap = getattr(result, "mip_gap", None)
    return IlpSolution(
        placement=candidate,
        predicted_seconds=value,
        is_optimal=result.status == 0,
        mip_gap=None if gap is None else float(gap),
    )
