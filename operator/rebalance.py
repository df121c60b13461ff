"""Load-based rebalancing of an ExpertPool (pure; no API or HTTP calls).

Two steps, each a plain function the collector (:mod:`eaas.operator.collector`) calls:

* :func:`window_load` turns two scrapes of the servers' ``/v1/stats`` documents (cumulative
  tokens per (layer, expert) since each server started) into the tokens routed to every
  (layer, expert) between them: float ``[L, E]``, rows in ``placement.layers`` order. A server
  whose counters went down, or whose ``instance`` changed, restarted: its whole current count is
  the window's (what it served since it came back). A server that did not answer either scrape is
  left out, and the tokens of every pair it hosts are scaled up by ``replicas / answered replicas``
  (clients spread an expert's tokens over its replicas); a pair none of whose hosts answered makes
  the window incomplete.
* :func:`plan` re-plans the committed placement for that load with the pool's policy:
  ``cost_aware`` (the latency-optimal rebalance: few moves, and the current placement when the
  gain does not pay) or
  ``eplb`` (DeepSeek's replicate-and-pack, adopted only when its predicted gain pays for its moves
  too, so a flat load never reshuffles the pool). R is never lowered; the version is bumped only
  when the assignment changes.

Units: the window's load is scaled to one rebalance interval and passed as the load of one
"step" (``horizon_steps=1``), so the objective compares compute over the next interval (assumed
to see the same load) against the one-off cost of loading experts. The compute per routed token
is measured: servers report the seconds they spent computing (``busy_seconds``), and the
window's busy seconds per routed token replace the cost model's default (an H100 figure) when
known, so a pool of slower servers weighs its imbalance as what it costs there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from eaas.runtime.placement import (
    CostModel,
    Placement,
    PlacementError,
    Server,
    cost_aware,
    diff,
    predicted_seconds,
    replicate_and_pack,
)

Policy = Literal["cost_aware", "eplb"]
POLICIES: tuple[Policy, ...] = ("cost_aware", "eplb")


class StatsError(ValueError):
    """A ``/v1/stats`` document that cannot be used (the message names the field)."""


@dataclass(frozen=True)
class ServerStats:
    """One server's ``/v1/stats``: cumulative tokens ``[L, E]`` int64 since ``since_unix_s``."""

    instance: str
    since_unix_s: float
    layers: tuple[int, ...]
    tokens: np.ndarray  # [L, E] int64, rows in `layers` order
    busy_seconds: float | None = None  # spent computing batches since start (absent: not reported)


@dataclass(frozen=True)
class Scrape:
    """What the servers answered at time ``at`` (ordinal → stats; servers that did not answer are absent)."""

    at: float
    servers: Mapping[int, ServerStats] = field(default_factory=dict)


@dataclass(frozen=True)
class WindowLoad:
    """Tokens per (layer, expert) between two scrapes.

    load: float64 ``[L, E]`` tokens over the window (rows in ``placement.layers`` order);
    seconds: the window's length; counted: ordinals whose tokens are in ``load``;
    missing: ordinals of the placement left out (no answer now or at the window's start);
    restarted: ordinals whose counters were reset during the window;
    complete: every (layer, expert) has at least one counted host;
    seconds_per_token: the counted servers' busy seconds per routed token over the window (their
    fixed per-layer costs included), None when none reports its busy time.
    """

    load: np.ndarray
    seconds: float
    counted: tuple[int, ...]
    missing: tuple[int, ...]
    restarted: tuple[int, ...]
    complete: bool
    seconds_per_token: float | None = None

    @property
    def total_tokens(self) -> float:
        return float(self.load.sum())


def parse_stats(document: Any, layers: tuple[int, ...], num_experts: int) -> ServerStats:
    """Validate one ``/v1/stats`` JSON document against the pool's MoE `layers` and `num_experts`."""
    if not isinstance(document, dict):
        raise StatsError(f"expected a JSON object, got {type(document).__name__}")
    if document.get("layers") != list(layers):
        raise StatsError(f"layers: expected the MoE layers {list(layers)}, got {document.get('layers')!r}")
    if document.get("num_experts") != num_experts:
        raise StatsError(f"num_experts: expected {num_experts}, got {document.get('num_experts')!r}")
    try:
        tokens = np.asarray(document.get("tokens"), dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as error:
        raise StatsError(f"tokens: expected [layers][experts] integers ({error})") from error
    if tokens.shape != (len(layers), num_experts) or (tokens < 0).any():
        raise StatsError(
            f"tokens: expected [{len(layers)}][{num_experts}] counts >= 0, got shape {tokens.shape}"
        )
    since = document.get("since_unix_s", 0.0)
    if not isinstance(since, (int, float)) or not math.isfinite(since):
        raise StatsError(f"since_unix_s: expected a number, got {since!r}")
    busy = document.get("busy_seconds")
    if busy is not None and (not isinstance(busy, (int, float)) or not math.isfinite(busy) or busy < 0):
        raise StatsError(f"busy_seconds: expected a number >= 0, got {busy!r}")
    return ServerStats(
        str(document.get("instance", "")),
        float(since),
        tuple(layers),
        tokens,
        None if busy is None else float(busy),
    )


def window_load(previous: Scrape, current: Scrape, placement: Placement) -> WindowLoad:
    """Tokens per (layer, expert) routed between `previous` and `current` (see the module doc)."""
    shape = (len(placement.layers), placement.num_experts)
    counted_sum = np.zeros(shape, dtype=np.float64)
    counted: list[int] = []
    restarted: list[int] = []
    timed_seconds, timed_tokens = 0.0, 0  # over servers that report their busy time
    for ordinal in placement.ordinals:
        now = current.servers.get(ordinal)
        before = previous.servers.get(ordinal)
        if now is None or now.tokens.shape != shape:
            continue
        busy: float | None
        if before is None or before.tokens.shape != shape:
            if now.since_unix_s < previous.at:  # up before the window began: its start is unknown
                continue
            delta, busy = now.tokens, now.busy_seconds  # started during the window: all is the window's
        elif before.instance != now.instance or (now.tokens < before.tokens).any():
            delta, busy = now.tokens, now.busy_seconds  # restarted: counters start again from zero
            restarted.append(ordinal)
        else:
            delta = now.tokens - before.tokens
            busy = None
            if now.busy_seconds is not None and before.busy_seconds is not None:
                busy = now.busy_seconds - before.busy_seconds
        counted_sum += delta
        counted.append(ordinal)
        if busy is not None and busy >= 0:
            timed_seconds += busy
            timed_tokens += int(delta.sum())
    hosting = placement.hosting_matrix()  # [S, L, E] bool
    replicas = hosting.sum(axis=0)  # [L, E]
    counted_rows = [placement.server_index(o) for o in counted]
    answered = hosting[counted_rows].sum(axis=0) if counted_rows else np.zeros(shape, dtype=np.int64)
    complete = bool((answered > 0).all())
    scale = np.where(answered > 0, replicas / np.maximum(answered, 1), 0.0)  # [L, E]
    return WindowLoad(
        load=counted_sum * scale,
        seconds=max(current.at - previous.at, 0.0),
        counted=tuple(counted),
        missing=tuple(o for o in placement.ordinals if o not in counted),
        restarted=tuple(restarted),
        complete=complete,
        seconds_per_token=timed_seconds / timed_tokens if timed_tokens > 0 and timed_seconds > 0 else None,
    )


@dataclass(frozen=True)
class Decision:
    """What :func:`plan` decided.

    placement: the next placement (version + 1), or None for "no change";
    result: ``rebalanced`` or ``unchanged``; message: for the Event and the logs;
    moves: experts loaded; gain_seconds: predicted compute saved over the next interval, net of
    the movement; load_error: the forecast error the plan was made with (``CostModel.load_error``).
    """

    placement: Placement | None
    result: str
    message: str
    moves: int = 0
    gain_seconds: float = 0.0
    load_error: float = 0.0


def plan(
    current: Placement,
    load: np.ndarray,
    policy: Policy,
    cost: CostModel | None = None,
    *,
    capacity: int = 0,
    max_moves: int | None = None,
) -> Decision:
    """The next placement for `load` (float ``[L, E]`` tokens over one interval), or no change.

    capacity: slots per server the pool allows (e.g. ``expertSlotsPerServer``); servers of
    `current` with fewer get that many for the re-plan (0 = keep each server's capacity).
    max_moves: the most expert loads the change may take (``maxExpertMovesPerRebalance``; None =
    no bound): ``cost_aware`` plans within it; an ``eplb`` packing that needs more is declined.
    """
    if policy not in POLICIES:
        raise PlacementError(f"placement.policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    cost = cost or CostModel()
    base = _widened(current, capacity)
    if policy == "cost_aware":
        candidate = cost_aware(base, load, cost, horizon_steps=1, max_moves=max_moves)
    else:
        candidate = replicate_and_pack(base, load)
    keep = predicted_seconds(current, current, load, cost, 1)
    if candidate is base or candidate.same_assignment(current):
        return Decision(None, "unchanged", f"{policy}: the current placement v{current.version} is kept")
    new = predicted_seconds(current, candidate, load, cost, 1)
    if new >= keep:
        return Decision(
            None,
            "unchanged",
            f"{policy}: a new placement would not pay for its moves "
            f"(predicted {new:.4g} s vs {keep:.4g} s over the interval)",
        )
    if int(candidate.replica_counts().min()) < current.replication:  # belt and braces: never below R
        raise PlacementError(f"{policy} planned fewer than R={current.replication} replicas of an expert")
    changes = diff(current, candidate)
    if max_moves is not None and changes.num_moves > max_moves:
        return Decision(
            None,
            "unchanged",
            f"{policy}: a new placement would load {changes.num_moves} experts, more than "
            f"maxExpertMovesPerRebalance={max_moves}",
        )
    moved = candidate.with_version(current.version + 1)
    gain = keep - new
    return Decision(
        moved,
        "rebalanced",
        f"{policy}: placement v{moved.version} pending: {changes.num_moves} expert loads "
        f"(at most {changes.max_loads_per_server()} per server), predicted gain {gain:.4g} s "
        f"({100 * gain / keep:.1f}%) over the next interval",
        moves=changes.num_moves,
        gain_seconds=gain,
    )


def plan_job(
    current: Placement,
    load: np.ndarray,
    policy: Policy,
    cost: CostModel,
    *,
    capacity: int = 0,
    max_moves: int | None = None,
    measured: bool = False,
) -> Decision:
    """:func:`plan` as the operator runs it in its planning worker (:mod:`eaas.operator.plan_jobs`):
    a placement error becomes the decision ``error``; the message also tells the compute per
    routed token planned with (`measured` on the servers, or the cost model's default), and
    ``load_error`` is the cost model's."""
    try:
        decision = plan(current, load, policy, cost, capacity=capacity, max_moves=max_moves)
    except PlacementError as error:
        return Decision(None, "error", str(error), load_error=cost.load_error)
    how = "measured" if measured else "assumed"
    message = f"{decision.message}; {cost.seconds_per_token * 1e6:.3g} us per routed token ({how})"
    return replace(decision, load_error=cost.load_error, message=message)


def interval_load(window: WindowLoad, interval_seconds: float) -> np.ndarray:
    """The window's load scaled to one rebalance interval: float ``[L, E]``."""
    if window.seconds <= 0:
        return np.zeros_like(window.load)
    return window.load * (interval_seconds / window.seconds)


def _widened(current: Placement, capacity: int) -> Placement:
    """`current` with every server's capacity raised to `capacity` (same assignment and version)."""
    if all(server.capacity >= capacity for server in current.servers):
        return current
    servers = [
        Server(s.ordinal, max(s.capacity, capacity), s.name, s.domain) for s in current.servers
    ]  # fmt: skip
    return Placement.from_matrix(
        current.layers,
        current.num_experts,
        servers,
        current.hosting_matrix(),
        current.replication,
        current.version,
    )
