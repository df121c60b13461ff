"""benchmarks/scale_steps.py's loop at a small shape: the operator's step planner scales a pool
up and down in batches (few commits), and one server per change when bounded to 1."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
from benchmark_runs import benchmark_module

from eaas.operator import planning


@pytest.fixture(scope="module")
def scale_steps() -> Iterator[ModuleType]:
    with benchmark_module("scale_steps.py") as module:
        yield module


SHAPE = planning.PoolShape(layers=tuple(range(4)), num_experts=16, replication=2)


def test_batched_scaling_commits_once_per_doubling_and_halving(scale_steps: ModuleType) -> None:
    up, top = scale_steps.scale("p", SHAPE, scale_steps.first_placement(SHAPE, 4), 40, bound=0)
    assert top.ordinals == tuple(range(40))
    assert (up.direction, up.commits) == ("up", 4)  # 4 -> 8 -> 16 -> 32 -> 40
    down, bottom = scale_steps.scale("p", SHAPE, top, 4, bound=0)
    assert bottom.ordinals == (0, 1, 2, 3)
    assert (down.direction, down.commits) == ("down", 4)  # 40 -> 20 -> 10 -> 5 -> 4


def test_a_bound_of_one_adds_one_server_per_commit(scale_steps: ModuleType) -> None:
    up, top = scale_steps.scale("p", SHAPE, scale_steps.first_placement(SHAPE, 4), 9, bound=1)
    assert up.commits == 5 and top.ordinals == tuple(range(9))
    bounded, _ = scale_steps.scale("p", SHAPE, top, 4, bound=2)
    assert bounded.commits == 3  # 9 -> 7 -> 5 -> 4
