"""Planning off the handlers (`eaas.operator.plan_jobs`): a job is submitted, picked up by a later
pass, dropped when another placement was committed meanwhile, and a failing job (or a dead worker)
becomes the decision "error" rather than an exception. The worker process itself runs in the last
tests: a real spawned process, which must not load the GPU stack."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np
import pytest
from inline_jobs import InlineExecutor
from prometheus_client import CollectorRegistry
from test_import_footprint import HEAVY
from test_rebalance import FakeServers, counts, hot_load, placement, served, stats

from eaas.operator import plan_jobs, rebalance
from eaas.operator.collector import Rebalancer
from eaas.operator.metrics import OperatorMetrics
from eaas.operator.plan_jobs import PlanJobs
from eaas.runtime.placement import CostModel

KEY = ("ns", "pool")
DONE = rebalance.Decision(None, "unchanged", "kept")


class HeldExecutor(Executor):
    """Jobs wait until the test runs them (`finish`): a worker that is still thinking."""

    def __init__(self) -> None:
        self.held: list[tuple[Future[Any], Callable[[], Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.held.append((future, lambda: fn(*args, **kwargs)))
        return future

    def finish(self) -> None:
        for future, run in self.held:
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it ran
            try:
                future.set_result(run())
            except Exception as error:
                future.set_exception(error)
        self.held.clear()


def held_jobs() -> tuple[PlanJobs, HeldExecutor, list[tuple[str, str]]]:
    executor = HeldExecutor()
    finished: list[tuple[str, str]] = []
    return PlanJobs(lambda: executor, on_done=finished.append), executor, finished


def test_a_job_is_picked_up_once_when_it_is_done() -> None:
    jobs, executor, finished = held_jobs()
    assert jobs.submit(KEY, 3, lambda: DONE)
    assert jobs.running(KEY) and not jobs.done(KEY)
    assert not jobs.submit(KEY, 3, lambda: DONE)  # one job per pool
    assert jobs.take(KEY, 3) is None  # still thinking: nothing to pick up
    executor.finish()
    assert finished == [KEY]  # the operator is told, to reconcile the pool soon
    assert jobs.done(KEY) and not jobs.running(KEY)
    assert jobs.take(KEY, 3) is DONE
    assert jobs.take(KEY, 3) is None and not jobs.done(KEY)  # picked up once
    assert jobs.submit(KEY, 3, lambda: DONE)  # the pool may plan again


def test_a_plan_from_a_placement_no_longer_committed_is_dropped() -> None:
    jobs, executor, _ = held_jobs()
    jobs.submit(KEY, 3, lambda: rebalance.Decision(placement(), "rebalanced", "v4 pending"))
    executor.finish()
    decision = jobs.take(KEY, 4)  # v4 was committed meanwhile (a scale-up, a lost server)
    assert decision is not None and decision.placement is None
    assert decision.result == "stale" and "v3" in decision.message and "v4" in decision.message
    assert jobs.take(KEY, 3) is None  # gone


def test_a_failing_job_becomes_an_error_decision() -> None:
    def broken() -> rebalance.Decision:
        raise ValueError("the planner tripped")

    jobs = PlanJobs(InlineExecutor)
    assert jobs.submit(KEY, 3, broken)
    decision = jobs.take(KEY, 3)
    assert decision is not None and (decision.placement, decision.result) == (None, "error")
    assert "the planner tripped" in decision.message


def test_forget_drops_the_pools_job() -> None:
    jobs, executor, _ = held_jobs()
    jobs.submit(KEY, 3, lambda: DONE)
    jobs.forget(KEY)
    executor.finish()
    assert not jobs.done(KEY) and jobs.take(KEY, 3) is None


@pytest.mark.parametrize(("committed_later", "result"), [(3, "rebalanced"), (4, "stale")])
def test_tick_submits_then_a_later_tick_picks_the_plan_up(committed_later: int, result: str) -> None:
    """The Rebalancer with a worker that is still thinking: the due tick returns nothing (the
    handler is not held up), ticks meanwhile neither scrape nor plan again, and the first tick
    after the job finished returns its decision, counted; with another placement committed by
    then, the decision is dropped as stale."""
    current = placement()  # version 3
    jobs, executor, _ = held_jobs()
    fake = FakeServers()
    metrics = OperatorMetrics(CollectorRegistry())
    rebalancer = Rebalancer(metrics, fetch=fake.fetch, clock=lambda: fake.now, jobs=jobs)
    urls = {o: f"http://10.0.0.{o}:9100" for o in current.ordinals}
    for o in current.ordinals:
        fake.answers[f"{urls[o]}/v1/stats"] = stats(np.zeros((2, 8)))
    rebalancer.tick(KEY, current, urls, "cost_aware", 60)  # baseline
    for o in current.ordinals:
        fake.answers[f"{urls[o]}/v1/stats"] = stats(served(current, o, hot_load()))
    fake.now += 60
    assert rebalancer.tick(KEY, current, urls, "cost_aware", 60, max_moves=64) is None  # submitted
    assert len(executor.held) == 1 and not rebalancer.has_plan(KEY)
    fake.now += 60
    assert rebalancer.tick(KEY, current, urls, "cost_aware", 60) is None  # still thinking
    assert len(executor.held) == 1  # not planned twice
    executor.finish()
    assert rebalancer.has_plan(KEY)
    later = current.with_version(committed_later)
    decision = rebalancer.tick(KEY, later, urls, "cost_aware", 60)
    assert decision is not None and decision.result == result
    assert (decision.placement is not None) == (result == "rebalanced")
    if result == "rebalanced":
        assert decision.placement is not None and decision.placement.version == 4
        assert 0 < decision.moves <= 64
    else:
        assert counts(metrics, "eaas_operator_rebalances").get("stale") == 1.0


def wait_done(jobs: PlanJobs, key: tuple[str, str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not jobs.done(key):
        assert time.monotonic() < deadline, "the planning worker did not finish"
        time.sleep(0.05)


def test_the_worker_process_plans_without_the_gpu_stack() -> None:
    """A real spawned worker: it plans a rebalance (the result comes back whole) and, having done
    so, has loaded none of the GPU stack (the chart's memory limit holds the operator's pod)."""
    jobs = PlanJobs()
    try:
        current = placement()
        jobs.submit(KEY, 3, rebalance.plan_job, current, hot_load(), "cost_aware", CostModel())
        wait_done(jobs, KEY)
        decision = jobs.take(KEY, 3)
        assert decision is not None and decision.result == "rebalanced" and decision.placement is not None
        assert decision.placement.version == 4 and "us per routed token (assumed)" in decision.message
        jobs.submit(KEY, 4, plan_jobs.loaded_modules)
        wait_done(jobs, KEY)
        loaded = jobs.take(KEY, 4)
        assert isinstance(loaded, list) and "eaas.runtime.placement.search" in loaded
        heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
        assert not heavy, f"the planning worker loads {heavy}"
    finally:
        jobs.shutdown()


def test_a_dead_worker_is_an_error_decision_and_is_replaced() -> None:
    jobs = PlanJobs()
    try:
        jobs.submit(KEY, 3, os._exit, 1)  # the worker dies mid-job (as when killed for memory)
        wait_done(jobs, KEY)
        decision = jobs.take(KEY, 3)
        assert decision is not None and (decision.placement, decision.result) == (None, "error")
        jobs.submit(KEY, 3, rebalance.plan_job, placement(), hot_load(), "cost_aware", CostModel())
        wait_done(jobs, KEY)
        again = jobs.take(KEY, 3)
        assert again is not None and again.result == "rebalanced"
    finally:
        jobs.shutdown()
