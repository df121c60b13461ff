"""Scrape the expert servers' ``/v1/stats`` and decide, at most every rebalance interval, whether an
ExpertPool should move experts (the I/O half of :mod:`eaas.operator.rebalance`).

The ExpertPool's resync timer calls :meth:`Rebalancer.tick` with the committed placement and the
control URLs of its Ready servers. The first tick of a pool only records a baseline scrape; each
later one, once ``rebalanceIntervalSeconds`` have passed, scrapes again, turns the difference into
the window's load and submits the plan to the planning worker (:mod:`eaas.operator.plan_jobs`,
within ``maxExpertMovesPerRebalance``); a later tick picks the decision up, unless another
placement was committed meanwhile (then it is ``stale``). Scrapes run in parallel with
short timeouts; a server that does not answer (or answers garbage) is counted in
``eaas_operator_stats_scrapes_total{result="error"}`` and left out of the window, never raised.
The last scrape of every pool is kept in memory only: a restarted operator starts with a baseline.

Each window's load is also the forecast for the next interval; how far the next window lands from
it (`eaas.runtime.placement.prediction_error`) is the forecast error the planner is given
(``CostModel.load_error``: heavy shares count more when loads drift, see
`eaas.runtime.placement.cost`). The first window after a baseline has no forecast to check: 0.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from eaas.operator import naming, rebalance
from eaas.operator.metrics import OperatorMetrics
from eaas.operator.plan_jobs import PlanJobs
from eaas.runtime.placement import CostModel, Placement, prediction_error

logger = logging.getLogger("eaas.operator")

SCRAPE_TIMEOUT_SECONDS = 2.0
MAX_PARALLEL_SCRAPES = 16

Fetch = Callable[[str, float], Any]  # (url, timeout) -> parsed JSON; raises on any failure


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # pod IPs: never via a proxy


def fetch_json(url: str, timeout: float) -> Any:
    """GET `url` and parse its JSON body (raises ``OSError``/``ValueError`` on failure)."""
    with _DIRECT.open(url, timeout=timeout) as response:
        return json.loads(response.read())


def stats_url(base: str) -> str:
    """The stats endpoint of a server's control URL ``http://host:port``."""
    return f"{base.rstrip('/')}/v1/stats"


ServerUrls = Callable[[str, Sequence[Mapping[str, Any]], int], dict[int, str]]  # (pool, pods, port)


def pod_control_urls(
    pool: str, pods: Sequence[Mapping[str, Any]], port: int, ready_only: bool = True
) -> dict[int, str]:
    """``{ordinal: http://<pod IP>:<port>}`` of the pool's not terminating pods with an IP (only the
    Ready ones unless `ready_only` is false)."""
    urls = {}
    for pod in pods:
        metadata, status = pod["metadata"], pod.get("status") or {}
        ordinal = naming.ordinal_of(pool, metadata["name"])
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        ip = status.get("podIP")
        if ordinal is not None and (ready or not ready_only) and ip and not metadata.get("deletionTimestamp"):
            host = f"[{ip}]" if ":" in ip else ip
            urls[ordinal] = f"http://{host}:{port}"
    return urls


Probe = Literal["answers", "refused", "silent"]
PROBE_TIMEOUT_SECONDS = 0.5  # a server that answered its clients in milliseconds answers this in time


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_SECONDS) -> Probe:
    """Asks the server at `url` for ``/healthz``: ``answers`` (200 within `timeout_s`),
    ``refused`` (its host turned the connection away: nothing listens on the port, so the
    process is gone), or ``silent`` (no answer in time, an error, or another status: hung, busy,
    or cut off)."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout_s) as response:
            return "answers" if response.status == 200 else "silent"
    except urllib.error.URLError as error:
        return "refused" if isinstance(error.reason, ConnectionRefusedError) else "silent"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


@dataclass
class Rebalancer:
    """Per-pool scrape memory and the tick that may propose a new placement."""

    metrics: OperatorMetrics
    fetch: Fetch = fetch_json
    timeout_seconds: float = SCRAPE_TIMEOUT_SECONDS
    cost: CostModel = field(default_factory=CostModel)
    clock: Callable[[], float] = time.time
    _scrapes: dict[tuple[str, str], rebalance.Scrape] = field(default_factory=dict)
    _forecasts: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)  # last interval load
    jobs: PlanJobs = field(default_factory=PlanJobs)  # where plans are made (a worker process)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            self._scrapes.pop((namespace, name), None)
            self._forecasts.pop((namespace, name), None)
        self.jobs.forget((namespace, name))

    def has_plan(self, key: tuple[str, str]) -> bool:
        """Whether a plan for pool `key` (namespace, name) is ready to pick up (:meth:`tick`)."""
        return self.jobs.done(key)

    def scrape(self, urls: Mapping[int, str], layers: tuple[int, ...], num_experts: int) -> rebalance.Scrape:
        """Fetch every server's stats now (in parallel); failures are counted and left out."""
        at = self.clock()
        servers: dict[int, rebalance.ServerStats] = {}
        if urls:
            with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SCRAPES, len(urls))) as pool:
                futures = {
                    o: pool.submit(self.fetch, stats_url(u), self.timeout_seconds) for o, u in urls.items()
                }
            for ordinal, future in sorted(futures.items()):
                try:
                    servers[ordinal] = rebalance.parse_stats(future.result(), layers, num_experts)
                    self.metrics.stats_scrapes.labels("success").inc()
                except Exception as error:  # any failure of one server: left out, never raised
                    logger.info("stats of server %d at %s: %s", ordinal, urls[ordinal], error)
                    self.metrics.stats_scrapes.labels("error").inc()
        return rebalance.Scrape(at=at, servers=servers)

    def tick(
        self,
        key: tuple[str, str],
        committed: Placement,
        urls: Mapping[int, str],
        policy: rebalance.Policy,
        interval_seconds: int,
        capacity: int = 0,
        failover_factor: float | None = None,
        max_moves: int | None = None,
    ) -> rebalance.Decision | None:
        """A decision for pool `key` (namespace, name), or None when none is ready.

        committed: the placement being served (no change may be in flight); urls: ordinal →
        control URL of the Ready servers; interval_seconds: ``rebalanceIntervalSeconds`` (0 = off);
        failover_factor: ``CostModel.failover_factor`` for this pool (None: this rebalancer's);
        max_moves: ``maxExpertMovesPerRebalance``.

        The plan itself is a job (:attr:`jobs`, off the caller's thread): a tick whose window is
        due submits it and returns None unless it finished at once; a later tick picks its
        decision up (``stale`` when it was planned from another placement than `committed`).
        """
        if interval_seconds <= 0:
            self.forget(*key)
            return None
        finished = self.jobs.take(key, committed.version)
        if finished is not None:
            return self._count(key, finished)
        if self.jobs.running(key):
            return None
        with self._guard:
            previous = self._scrapes.get(key)
        if previous is not None and self.clock() < previous.at + interval_seconds:
            return None
        current = self.scrape(urls, committed.layers, committed.num_experts)
        with self._guard:
            self._scrapes[key] = current
        if previous is None:
            return self._count(key, rebalance.Decision(None, "baseline", "first scrape: baseline recorded"))
        window = rebalance.window_load(previous, current, committed)
        if not window.complete:
            return self._count(
                key,
                rebalance.Decision(
                    None,
                    "incomplete",
                    f"some experts have no counted server (missing: {list(window.missing)})",
                ),
            )
        if window.total_tokens <= 0:
            return self._count(key, rebalance.Decision(None, "idle", "no tokens routed in the window"))
        load = rebalance.interval_load(window, interval_seconds)  # [L, E]
        with self._guard:
            forecast = self._forecasts.get(key)
            self._forecasts[key] = load
        # Interval totals of Poisson-like counts: one "step" each for the noise correction.
        drift = 0.0
        if forecast is not None and forecast.shape == load.shape:
            drift = prediction_error(forecast, load, 1, 1)
        cost = replace(self.cost, load_error=drift)
        if failover_factor is not None:
            cost = replace(cost, failover_factor=failover_factor)
        if window.seconds_per_token is not None:  # measured on these servers: what a token costs here
            cost = replace(cost, seconds_per_token=window.seconds_per_token)
        self.jobs.submit(
            key,
            committed.version,
            rebalance.plan_job,
            committed,
            load,
            policy,
            cost,
            capacity=capacity,
            max_moves=max_moves,
            measured=window.seconds_per_token is not None,
        )
        finished = self.jobs.take(key, committed.version)  # done at once where jobs run inline
        return None if finished is None else self._count(key, finished)

    def _count(self, key: tuple[str, str], decision: rebalance.Decision) -> rebalance.Decision:
        if decision.result == "error":
            logger.warning("rebalance of %s/%s failed: %s", *key, decision.message)
        logger.info(
            "rebalance of ExpertPool %s/%s: %s: %s (forecast error %.3f)",
            *key, decision.result, decision.message, decision.load_error,
        )  # fmt: skip
        if decision.result != "rebalanced":  # a published one is counted when it is published
            self.metrics.rebalances.labels(decision.result).inc()
        return decision
