"""Planning jobs that run in the caller (for unit tests of what the operator does with a
decision; the worker process itself is tested in test_plan_jobs.py)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from eaas.operator.plan_jobs import PlanJobs


class InlineExecutor(Executor):
    """Runs each job at submission, in the caller's thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # the job's failure is its future's, as in a worker
            future.set_exception(error)
        return future


def inline_jobs() -> PlanJobs:
    return PlanJobs(InlineExecutor)
