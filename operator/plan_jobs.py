"""Planning off the handlers: a rebalance is planned in a worker process, not in the reconcile
that asked for it, and never under the pool's lock.

A reconcile hands the planner's work to :meth:`PlanJobs.submit`, keyed by the pool and the version
of the committed placement it plans from, and returns at once. A later reconcile of the pool
(:meth:`PlanJobs.take`) picks the decision up when it is done, or drops it when another placement
was committed meanwhile (a scale-up, a lost server, another change): a plan made for a placement
that is no longer served would undo that change. A job that raised becomes a decision ``error``
(logged and counted by the caller), never an exception in the handler. One job per pool at a time.

The worker is one process of a :class:`~concurrent.futures.ProcessPoolExecutor` started with
``spawn`` (a fork of the operator's threads could inherit a lock another thread held), at the
first job; it imports numpy and `eaas.runtime.placement` (no torch) and plans one pool at a time,
in submission order. A process, not a thread: the search is many short numpy calls, which hold
the GIL between them; on the 2-core development machine a DeepSeek-V3 x 64 rebalance in a thread
beside a busy Python thread (a handler) took 1.9-2.3 times its time alone, and the busy thread ran
at 0.64-1.04 of its speed alone (3 runs, a loaded machine). When a job finishes,
``on_done(key)`` runs (the operator schedules a reconcile of the pool then, so the decision does
not wait for the next resync). A worker that died (killed for memory) fails its job with an error
and is started again for the next.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from eaas.operator.rebalance import Decision

logger = logging.getLogger("eaas.operator")

Key = tuple[str, str]  # (namespace, ExpertPool name)


@dataclass(frozen=True)
class _Job:
    version: int  # the committed placement's version it plans from
    future: Future[Decision]
    submitted: float  # time.monotonic()


def worker() -> Executor:
    """The planning worker: one spawned process."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))


class PlanJobs:
    """Planning jobs per pool.

    executor: where jobs run; a factory called at the first job, and again after the executor
    broke (default: `worker`, a process). Tests may pass one that runs jobs in the caller.
    on_done: called with the pool's key when its job finishes (in the executor's thread).
    """

    def __init__(
        self,
        executor: Callable[[], Executor] = worker,
        on_done: Callable[[Key], None] | None = None,
    ) -> None:
        self._make_executor = executor
        self._executor: Executor | None = None
        self.on_done = on_done
        self._jobs: dict[Key, _Job] = {}
        self._guard = threading.Lock()

    def submit(
        self, key: Key, version: int, function: Callable[..., Decision], *args: Any, **kwargs: Any
    ) -> bool:
        """Start ``function(*args, **kwargs)`` for pool `key`, planned from committed placement
        `version`, unless the pool has a job already (running or not yet picked up): False then."""
        with self._guard:
            if key in self._jobs:
                return False
            if self._executor is None:
                self._executor = self._make_executor()
            try:
                future = self._executor.submit(function, *args, **kwargs)
            except BrokenProcessPool:  # the worker died since the last job: start another
                self._executor = self._make_executor()
                future = self._executor.submit(function, *args, **kwargs)
            self._jobs[key] = _Job(version, future, time.monotonic())
        future.add_done_callback(lambda _: self._finished(key))
        return True

    def _finished(self, key: Key) -> None:
        if self.on_done is not None:
            try:
                self.on_done(key)
            except Exception:  # a failed notice only delays the pick-up until the next resync
                logger.exception("planning of %s/%s finished; scheduling its pick-up failed", *key)

    def running(self, key: Key) -> bool:
        """Whether pool `key` has a job that has not finished."""
        with self._guard:
            job = self._jobs.get(key)
        return job is not None and not job.future.done()

    def done(self, key: Key) -> bool:
        """Whether pool `key` has a finished job to pick up."""
        with self._guard:
            job = self._jobs.get(key)
        return job is not None and job.future.done()

    def take(self, key: Key, version: int) -> Decision | None:
        """Pool `key`'s finished job's decision, removed from here; None when none is finished.

        A job planned from another version than `version` (the placement committed now) is
        dropped: the decision is ``stale``, with no placement. A job that raised gives ``error``.
        """
        with self._guard:
            job = self._jobs.get(key)
            if job is None or not job.future.done():
                return None
            del self._jobs[key]
        seconds = time.monotonic() - job.submitted
        error = job.future.exception()
        if error is not None:
            logger.warning("planning of %s/%s failed: %r", *key, error)
            if isinstance(error, BrokenProcessPool):
                with self._guard:
                    self._executor = None  # started again at the next job
            return Decision(None, "error", f"planning failed: {error!r}")
        if job.version != version:
            return Decision(
                None,
                "stale",
                f"dropped a plan made from placement v{job.version}: v{version} is committed now",
            )
        decision = job.future.result()
        logger.debug("planning of %s/%s took %.2f s", *key, seconds)
        return decision

    def forget(self, key: Key) -> None:
        """Drop pool `key`'s job (a running one finishes in the worker; its result is discarded)."""
        with self._guard:
            job = self._jobs.pop(key, None)
        if job is not None:
            job.future.cancel()

    def shutdown(self) -> None:
        """Stop the worker (jobs not yet started are cancelled)."""
        with self._guard:
            executor, self._executor = self._executor, None
            self._jobs.clear()
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def loaded_modules() -> list[str]:
    """The modules imported in the process that runs this (the worker's import footprint)."""
    return sorted(sys.modules)
