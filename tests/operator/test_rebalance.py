"""Load-based rebalancing: the window load from /v1/stats scrapes, the planner, the timer's tick and
the step that publishes a rebalance (pure parts; a real server is in test_rebalance_live.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from inline_jobs import inline_jobs
from prometheus_client import CollectorRegistry

from eaas.operator import planning, rebalance
from eaas.operator.collector import Rebalancer, pod_control_urls
from eaas.operator.expert_step import Observed, PodState, idle, plan
from eaas.operator.metrics import OperatorMetrics
from eaas.runtime.placement import CostModel, Placement, imbalance, prediction_error

LAYERS = (1, 2)  # layer 0 is dense: rows of [L, E] are MoE layers 1 and 2
SHAPE = planning.PoolShape(layers=LAYERS, num_experts=8, replication=2, slots_per_server=12)
FLAT = 10_000.0  # tokens per expert over one interval


def placement(servers: int = 4, shape: planning.PoolShape = SHAPE) -> Placement:
    return planning.initial(shape, dict.fromkeys(range(servers)), {}, version=3)


def hot_load(layer: int = 0, expert: int = 3, tokens: float = 1e6) -> np.ndarray:
    load = np.full((len(LAYERS), 8), FLAT)  # [L, E]
    load[layer, expert] = tokens
    return load


# -- the planner ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["cost_aware", "eplb"])
def test_a_hot_expert_gets_more_replicas_and_r_is_kept(policy: rebalance.Policy) -> None:
    current = placement()
    load = hot_load()
    decision = rebalance.plan(current, load, policy)
    assert decision.result == "rebalanced" and decision.placement is not None
    new = decision.placement
    assert new.version == current.version + 1
    assert int(new.replica_counts().min()) >= SHAPE.replication  # R kept for every expert
    assert len(new.servers_of(1, 3)) > len(current.servers_of(1, 3))  # the hot expert is replicated
    assert imbalance(new, load) < imbalance(current, load)
    assert decision.moves > 0 and decision.gain_seconds > 0
    assert f"v{new.version}" in decision.message and "gain" in decision.message


@pytest.mark.parametrize("policy", ["cost_aware", "eplb"])
def test_a_flat_load_changes_nothing(policy: rebalance.Policy) -> None:
    decision = rebalance.plan(placement(), np.full((len(LAYERS), 8), FLAT), policy)
    assert (decision.placement, decision.result) == (None, "unchanged")


def test_a_small_gain_does_not_pay_for_the_moves() -> None:
    load = hot_load(tokens=FLAT * 1.5)  # barely hot: balancing it gains < one expert load (1 ms)
    for policy in rebalance.POLICIES:
        assert rebalance.plan(placement(), load, policy).placement is None


def test_full_servers_are_given_the_pools_slots_for_a_rebalance() -> None:
    full = planning.initial(
        planning.PoolShape(LAYERS, 8, 2), dict.fromkeys(range(4)), {}
    )  # auto slots: exactly R·L·E / servers = 8, no room to replicate
    assert {s.capacity for s in full.servers} == {8}
    decision = rebalance.plan(full, hot_load(), "cost_aware", capacity=12)
    assert decision.placement is not None
    assert {s.capacity for s in decision.placement.servers} == {12}
    assert len(decision.placement.servers_of(1, 3)) > 2


def test_the_move_budget_bounds_a_rebalance_that_still_gains() -> None:
    current = placement()
    load = hot_load()
    load[1, 5] = load[0, 6] = 4e5  # more hot experts: more moves pay
    free = rebalance.plan(current, load, "cost_aware")
    assert free.moves > 3
    for budget in (1, 2, free.moves - 1):
        decision = rebalance.plan(current, load, "cost_aware", max_moves=budget)
        assert decision.result == "rebalanced" and decision.placement is not None
        assert 0 < decision.moves <= budget and decision.gain_seconds > 0
        assert decision.moves == rebalance.diff(current, decision.placement).num_moves
    # EPLB's packing cannot be cut down: one that needs more loads is declined.
    declined = rebalance.plan(current, load, "eplb", max_moves=2)
    assert (declined.placement, declined.result) == (None, "unchanged")
    assert "maxExpertMovesPerRebalance=2" in declined.message


def test_an_unknown_policy_is_refused_with_the_allowed_values() -> None:
    with pytest.raises(rebalance.PlacementError, match="cost_aware, eplb"):
        rebalance.plan(placement(), hot_load(), "random")  # type: ignore[arg-type]


# -- /v1/stats documents and the window's load -----------------------------------------------------


def stats(
    tokens: np.ndarray, instance: str = "a", since: float = 0.0, busy: float | None = None
) -> dict[str, Any]:
    """A /v1/stats document as the expert server writes it (runtime/server/stats.py)."""
    return {
        "ordinal": 0,
        "instance": instance,
        "placement_version": 3,
        **({} if busy is None else {"busy_seconds": busy}),
        "since_unix_s": since,
        "layers": list(LAYERS),
        "num_experts": 8,
        "tokens": tokens.astype(int).tolist(),
        "total_tokens": int(tokens.sum()),
    }


def served(current: Placement, ordinal: int, load: np.ndarray) -> np.ndarray:
    """The tokens server `ordinal` counts when `load` [L, E] is split evenly over replicas."""
    shares = current.replica_shares()[:, :, current.server_index(ordinal)]  # [L, E]
    return load * shares


def scrape(at: float, documents: dict[int, dict[str, Any]]) -> rebalance.Scrape:
    return rebalance.Scrape(
        at, {o: rebalance.parse_stats(d, LAYERS, 8) for o, d in documents.items()}
    )  # fmt: skip


def test_the_window_load_is_the_difference_of_the_counters() -> None:
    current = placement()
    before = {o: stats(served(current, o, hot_load(tokens=4000))) for o in current.ordinals}
    after = {
        o: stats(served(current, o, hot_load(tokens=4000) + hot_load(tokens=2e5))) for o in current.ordinals
    }
    window = rebalance.window_load(scrape(100.0, before), scrape(160.0, after), current)
    np.testing.assert_allclose(window.load, hot_load(tokens=2e5))
    assert window.complete and window.seconds == 60.0 and window.counted == (0, 1, 2, 3)
    assert window.missing == () and window.restarted == ()
    np.testing.assert_allclose(rebalance.interval_load(window, 120), 2 * hot_load(tokens=2e5))


def test_a_restarted_server_counts_from_zero() -> None:
    current = placement()
    load = hot_load()
    before = {o: stats(served(current, o, 3 * load)) for o in current.ordinals}
    after = {o: stats(served(current, o, 4 * load)) for o in current.ordinals}
    after[1] = stats(
        served(current, 1, load), instance="b", since=130.0
    )  # crashed, came back, counted `load`
    after[2] = stats(served(current, 2, 0.5 * load))  # counters went down: also a restart
    window = rebalance.window_load(scrape(100.0, before), scrape(160.0, after), current)
    assert window.restarted == (1, 2) and window.complete
    expected = sum(served(current, o, load) for o in (0, 1, 3)) + served(current, 2, 0.5 * load)
    np.testing.assert_allclose(window.load, expected)


def test_missing_servers_are_made_up_by_their_replicas() -> None:
    current = placement()  # R = 2: every pair has a second host
    load = hot_load()
    before = {o: stats(np.zeros((2, 8))) for o in current.ordinals}
    after = {o: stats(served(current, o, load)) for o in current.ordinals}
    del after[1]  # did not answer now
    del before[3]  # did not answer at the window's start (and was already up)
    window = rebalance.window_load(scrape(100.0, before), scrape(160.0, after), current)
    assert window.counted == (0, 2) and window.missing == (1, 3)
    covered = current.hosting_matrix()[[0, 2]].any(axis=0)  # [L, E] pairs with a counted host
    assert window.complete == bool(covered.all())
    np.testing.assert_allclose(window.load[covered], load[covered])  # even split → exact estimate


def test_a_pair_without_any_counted_host_makes_the_window_incomplete() -> None:
    current = placement()
    before = {o: stats(np.zeros((2, 8))) for o in current.ordinals}
    window = rebalance.window_load(scrape(0.0, before), scrape(60.0, {}), current)
    assert not window.complete and window.missing == current.ordinals and window.total_tokens == 0


def test_a_server_started_during_the_window_counts_everything_it_served() -> None:
    current = placement()
    load = hot_load()
    before = {o: stats(np.zeros((2, 8))) for o in (0, 1, 2)}
    after = {o: stats(served(current, o, load), since=0.0) for o in (0, 1, 2)}
    after[3] = stats(served(current, 3, load), since=120.0)  # new pod, up after the baseline at 100
    window = rebalance.window_load(scrape(100.0, before), scrape(160.0, after), current)
    assert window.counted == (0, 1, 2, 3)
    np.testing.assert_allclose(window.load, load)


def test_the_cost_per_token_is_measured_from_the_servers_busy_time() -> None:
    """Busy seconds over routed tokens in the window; servers that do not report are left out of
    it (their tokens still count as load), and none reporting leaves it unknown."""
    current = placement()
    load = hot_load(tokens=4000)
    before = {o: stats(served(current, o, load), busy=10.0) for o in current.ordinals}
    after = {o: stats(served(current, o, 3 * load), busy=10.0 + 0.002 * o) for o in current.ordinals}
    after[3] = stats(served(current, 3, 3 * load))  # an older server without busy_seconds
    window = rebalance.window_load(scrape(100.0, before), scrape(160.0, after), current)
    timed = sum(float(served(current, o, 2 * load).sum()) for o in (0, 1, 2))
    assert window.seconds_per_token == pytest.approx((0.0 + 0.002 + 0.004) / timed)
    np.testing.assert_allclose(window.load, 2 * load)
    untimed = {o: stats(served(current, o, 3 * load)) for o in current.ordinals}
    assert (
        rebalance.window_load(scrape(100.0, before), scrape(160.0, untimed), current).seconds_per_token
        is None
    )


def test_tick_plans_with_the_measured_cost_per_token() -> None:
    """A skew that does not pay for its moves at the default (H100) cost per token does on
    servers measured 100x slower: the rebalance is then made, and says what it assumed. (Planned
    for the healthy state alone: the cold expert lowers the layer's mean, and with it the failover
    bound, which tests/placement covers.)"""
    current = placement()
    load = hot_load(tokens=400)
    decisions = {}
    for busy_per_token in (None, 25e-6):
        fake, _, rebalancer, urls = ticking(current, CostModel(failover_factor=0.0))
        for total in (load, 2 * load):
            for o in current.ordinals:
                tokens = served(current, o, total)
                seconds = None if busy_per_token is None else float(tokens.sum()) * busy_per_token
                fake.answers[f"{urls[o]}/v1/stats"] = stats(tokens, busy=seconds)
            decision = rebalancer.tick(("ns", "p"), current, urls, "cost_aware", 60)
            fake.now += 60
        decisions[busy_per_token] = decision
    assert decisions[None] is not None and decisions[None].result == "unchanged"
    assert decisions[None].message.endswith("0.25 us per routed token (assumed)")
    measured = decisions[25e-6]
    assert measured is not None and measured.result == "rebalanced"
    assert measured.message.endswith("25 us per routed token (measured)")


def test_tick_plans_with_the_pools_failover_factor() -> None:
    """The pool's ``placement.failoverFactorPercent`` reaches the plan: a rebalancer whose own
    cost has the bound, told 0 for this pool, plans what one without the bound plans, and the
    other way round. Here both move the same two experts, but with the bound the move also
    lowers the busiest survivor of a failure, so it is worth more (0.092 s against 0.041 s)."""
    current = placement()
    load = hot_load(tokens=400)

    def plan(own: float, told: float | None) -> rebalance.Decision | None:
        fake, _, rebalancer, urls = ticking(current, CostModel(failover_factor=own))
        decision = None
        for total in (load, 2 * load):
            for o in current.ordinals:
                tokens = served(current, o, total)
                fake.answers[f"{urls[o]}/v1/stats"] = stats(tokens, busy=float(tokens.sum()) * 25e-6)
            decision = rebalancer.tick(("ns", "p"), current, urls, "cost_aware", 60, failover_factor=told)
            fake.now += 60
        return decision

    def outcome(decision: rebalance.Decision | None) -> tuple[str, str | None, float]:
        assert decision is not None
        placed = None if decision.placement is None else decision.placement.to_json()
        return decision.result, placed, round(decision.gain_seconds, 9)

    healthy, bounded = outcome(plan(0.0, None)), outcome(plan(1.3, None))
    assert healthy[0] == bounded[0] == "rebalanced" and bounded[2] > 1.5 * healthy[2]
    assert outcome(plan(1.3, 0.0)) == healthy
    assert outcome(plan(0.0, 1.3)) == bounded


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layers": [0, 1]}, "layers"),
        ({"num_experts": 16}, "num_experts"),
        ({"tokens": [[1, 2]]}, "tokens"),
        ({"tokens": "many"}, "tokens"),
        ({"since_unix_s": "yesterday"}, "since_unix_s"),
        ({"busy_seconds": -1}, "busy_seconds"),
        ({"busy_seconds": "lots"}, "busy_seconds"),
    ],
)
def test_unusable_stats_documents_are_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(rebalance.StatsError, match=field):
        rebalance.parse_stats(stats(np.zeros((2, 8))) | change, LAYERS, 8)
    with pytest.raises(rebalance.StatsError, match="JSON object"):
        rebalance.parse_stats([1, 2], LAYERS, 8)


# -- the timer's tick (fake fetch and clock: the real HTTP path is in test_rebalance_live.py) ------


class FakeServers:
    """/v1/stats answers by URL; an exception instance is raised (a server that does not answer)."""

    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}
        self.now = 1000.0

    def fetch(self, url: str, timeout: float) -> Any:
        assert timeout <= 5
        answer = self.answers[url]
        if isinstance(answer, Exception):
            raise answer
        return answer


def counts(metrics: OperatorMetrics, name: str) -> dict[str, float]:
    """The results counted so far (every known result's series exists from the start, at 0)."""
    return {
        sample.labels["result"]: sample.value
        for metric in metrics.registry.collect()
        if metric.name == name
        for sample in metric.samples
        if sample.name == f"{name}_total" and sample.value
    }


def ticking(
    current: Placement, cost: CostModel | None = None
) -> tuple[FakeServers, OperatorMetrics, Rebalancer, dict[int, str]]:
    """Fake servers, the operator's metrics, a Rebalancer on the fake clock (planning with
    ``cost``, default `CostModel()`), and the control URLs of `current`'s servers."""
    fake = FakeServers()
    metrics = OperatorMetrics(CollectorRegistry())
    rebalancer = Rebalancer(
        metrics, fetch=fake.fetch, cost=cost or CostModel(), clock=lambda: fake.now, jobs=inline_jobs()
    )
    return fake, metrics, rebalancer, {o: f"http://10.0.0.{o}:9100" for o in current.ordinals}


def test_tick_baselines_waits_for_the_interval_then_plans() -> None:
    current = placement()
    fake, metrics, rebalancer, urls = ticking(current)
    for o in current.ordinals:
        fake.answers[f"{urls[o]}/v1/stats"] = stats(np.zeros((2, 8)))
    key = ("ns", "p")
    assert rebalancer.tick(key, current, urls, "cost_aware", 60).result == "baseline"  # type: ignore[union-attr]
    fake.now += 30
    assert rebalancer.tick(key, current, urls, "cost_aware", 60) is None  # not due yet
    fake.now += 30
    assert rebalancer.tick(key, current, urls, "cost_aware", 60).result == "idle"  # type: ignore[union-attr]

    for o in current.ordinals:
        fake.answers[f"{urls[o]}/v1/stats"] = stats(served(current, o, hot_load()))
    fake.answers[f"{urls[2]}/v1/stats"] = OSError("connection refused")  # one server does not answer
    fake.now += 60
    decision = rebalancer.tick(key, current, urls, "cost_aware", 60)
    assert decision is not None and decision.result == "rebalanced" and decision.placement is not None
    assert decision.placement.version == current.version + 1
    assert counts(metrics, "eaas_operator_stats_scrapes") == {"success": 11.0, "error": 1.0}
    assert counts(metrics, "eaas_operator_rebalances") == {"baseline": 1.0, "idle": 1.0}

    assert rebalancer.tick(key, current, urls, "cost_aware", 0) is None  # 0 = off, and forgets
    fake.now += 600
    assert rebalancer.tick(key, current, urls, "cost_aware", 60).result == "baseline"  # type: ignore[union-attr]


def test_tick_plans_with_the_error_of_the_last_windows_forecast() -> None:
    current = placement()
    fake, _, rebalancer, urls = ticking(current)
    key = ("ns", "p")
    windows = [np.zeros((2, 8)), hot_load(0, 3), hot_load(1, 5)]
    decisions = []
    total = np.zeros((2, 8))
    for window in windows:
        total = total + window
        for o in current.ordinals:
            fake.answers[f"{urls[o]}/v1/stats"] = stats(served(current, o, total))
        decisions.append(rebalancer.tick(key, current, urls, "cost_aware", 60))
        fake.now += 60
    assert [d.result for d in decisions if d is not None] == ["baseline", "rebalanced", "rebalanced"]
    assert decisions[1] is not None and decisions[1].load_error == 0.0  # nothing to check it against
    # The first window forecast the second: its error is what the second plan was made with.
    expected = prediction_error(windows[1], windows[2], 1, 1)
    assert expected > 0.5
    assert decisions[2] is not None and decisions[2].load_error == pytest.approx(expected)
    rebalancer.forget(*key)
    assert rebalancer.tick(key, current, urls, "cost_aware", 60).result == "baseline"  # type: ignore[union-attr]


def test_tick_with_no_server_answering_is_incomplete_and_never_raises() -> None:
    current = placement()
    fake, metrics, rebalancer, urls = ticking(current)
    for o in current.ordinals:
        fake.answers[f"{urls[o]}/v1/stats"] = ValueError("not JSON")
    assert rebalancer.tick(("ns", "p"), current, urls, "eplb", 60).result == "baseline"  # type: ignore[union-attr]
    fake.now += 60
    decision = rebalancer.tick(("ns", "p"), current, urls, "eplb", 60)
    assert decision is not None and decision.result == "incomplete" and decision.placement is None
    assert counts(metrics, "eaas_operator_stats_scrapes") == {"error": 8.0}


def test_control_urls_come_from_ready_pods_of_the_pool() -> None:
    def pod(name: str, ip: str | None, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name}
        if deleting:
            metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        condition = {"type": "Ready", "status": "True" if ready else "False"}
        return {"metadata": metadata, "status": {"podIP": ip, "conditions": [condition]}}

    pods = [
        pod("p-0", "10.0.0.5"),
        pod("p-1", "10.0.0.6", ready=False),
        pod("p-2", None),
        pod("p-3", "fd00::3"),
        pod("p-4", "10.0.0.9", deleting=True),
        pod("other-5", "10.0.0.7"),
    ]
    assert pod_control_urls("p", pods, 9100) == {0: "http://10.0.0.5:9100", 3: "http://[fd00::3]:9100"}


# -- the ExpertPool step ------------------------------------------------------------------------------


def observed(current: Placement, **overrides: Any) -> Observed:
    base: dict[str, Any] = {
        "pool": "p",
        "desired_replicas": current.num_servers,
        "shape": SHAPE,
        "template_hash": "h",
        "pods": {n: PodState(n, ready=True, template_hash="h") for n in current.ordinals},
        "committed": current,
        "pending": None,
    }
    return Observed(**(base | overrides))


def test_a_rebalance_is_published_as_pending_with_an_event() -> None:
    current = placement()
    assert idle(plan(observed(current)))
    proposal = rebalance.plan(current, hot_load(), "cost_aware")
    assert proposal.placement is not None
    step = plan(observed(current, rebalance=proposal.placement, rebalance_message=proposal.message))
    assert step.publish == (current, proposal.placement)  # pending.json; placement.json unchanged
    assert [e.reason for e in step.events] == ["Rebalanced"] and "gain" in step.events[0].message
    assert step.progressing == "Rebalancing" and not idle(step)
    assert not step.create_pods and not step.delete_pods


def test_a_rebalance_waits_for_every_server_and_ignores_stale_proposals() -> None:
    current = placement()
    proposal = rebalance.plan(current, hot_load(), "cost_aware").placement
    assert proposal is not None
    pods = {n: PodState(n, ready=n != 2, template_hash="h") for n in current.ordinals}
    assert plan(observed(current, rebalance=proposal, pods=pods)).publish is None  # server 2 is down
    newer = current.with_version(proposal.version)  # committed moved on since the proposal
    assert plan(observed(newer, rebalance=proposal)).publish is None
    pending = proposal.with_version(proposal.version + 1)  # a change already in flight wins
    step = plan(observed(current, rebalance=proposal, pending=pending))
    assert step.publish is None or step.publish[1] is not proposal
