"""Expert placement and load balancing (pure CPU code; no dependency on the rest of the runtime).

- `Placement` / `Server`: THE type for servers → hosted (layer, expert) pairs, capacities,
  replication, failure domains and version, with its versioned JSON form.
- `round_robin`: the simple placement the launcher starts from.
- `diff` / `PlacementDiff`: expert loads and unloads between two placements.
- `CostModel` and the objective (`predicted_seconds`, `step_seconds`, `imbalance`, ...).
- Planners: `replicate_and_pack` (EPLB baseline), `cost_aware` (“Latency-Optimal Load Balancing
  for Distributed MoE Inference”), `ilp` (exact oracle).
- Elastic operations: `add_server`, `drain_server`, `recover`.
- `SyntheticTrace` / `TraceConfig`: drifting routing loads for benchmarks and tests.
"""

from eaas.runtime.placement.builders import round_robin
from eaas.runtime.placement.cost import (
    CostModel,
    failover_loads,
    forecast_loads,
    imbalance,
    movement_seconds,
    predicted_seconds,
    prediction_error,
    server_loads,
    step_seconds,
)
from eaas.runtime.placement.cost_aware import cost_aware
from eaas.runtime.placement.diff import Move, PlacementDiff, diff, num_moves
from eaas.runtime.placement.elastic import add_server, drain_server, recover
from eaas.runtime.placement.eplb import layer_quotas, replicate_and_pack
from eaas.runtime.placement.ilp import IlpSolution, ilp
from eaas.runtime.placement.placement import SCHEMA_VERSION, LayerExpert, Placement, PlacementError, Server
from eaas.runtime.placement.traces import SyntheticTrace, TraceConfig

__all__ = [
    "SCHEMA_VERSION",
    "CostModel",
    "IlpSolution",
    "LayerExpert",
    "Move",
    "Placement",
    "PlacementDiff",
    "PlacementError",
    "Server",
    "SyntheticTrace",
    "TraceConfig",
    "add_server",
    "cost_aware",
    "diff",
    "drain_server",
    "failover_loads",
    "forecast_loads",
    "ilp",
    "imbalance",
    "layer_quotas",
    "movement_seconds",
    "num_moves",
    "predicted_seconds",
    "prediction_error",
    "recover",
    "replicate_and_pack",
    "round_robin",
    "server_loads",
    "step_seconds",
]
