"""How many placement changes an ExpertPool takes to scale 64 -> 320 servers and back, and what
each costs the operator to plan: batched changes (the default, ``maxServersPerChange: 0``) against
one server per change (``maxServersPerChange: 1``, the baseline), in the same run.

The operator's own step planner (:func:`eaas.operator.expert_step.plan`) is driven as the
reconciler drives it, with every pod it creates becoming Ready on the next pass (8 servers per
node) and no Leases (so a server counts as loaded once Ready): what is counted is the operator's
decisions, not pod start-up. A placement change is one commit. Per shape: the commits up and
down, the planner's CPU seconds for the slowest pass and in all, and the expert copies loaded per
change (pairs a server gains).

Shapes: DeepSeek-V3 (58 MoE layers x 256 experts, R = 2) and Kimi-K2 (60 x 384, R = 3). The
baseline (256 serial changes) runs at DeepSeek-V3 only; ``--quick`` runs a small shape (8 x 64,
R = 2, 8 -> 40 servers) for both.

Prints a table, then one JSON line (``_common.emit``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import _common

from eaas.operator import planning
from eaas.operator.expert_step import Observed, PodState, plan
from eaas.runtime.placement.diff import diff

TEMPLATE = "t"
SERVERS_PER_NODE = 8


@dataclass
class Run:
    shape: str
    direction: str
    bound: int  # maxServersPerChange
    commits: int
    passes: int
    slowest_pass_s: float
    planner_s: float
    loaded_per_change: int  # the most expert copies one change loads


def node(ordinal: int) -> str:
    return f"node-{ordinal // SERVERS_PER_NODE}"


def scale(
    name: str, shape: planning.PoolShape, committed: planning.Placement, desired: int, bound: int
) -> tuple[Run, planning.Placement]:
    """Drives the planner from `committed` until the pool is `desired` servers and idle."""
    direction = "up" if desired > len(committed.ordinals) else "down"
    pods = {n: PodState(n, ready=True, template_hash=TEMPLATE, node=node(n)) for n in committed.ordinals}
    pending: planning.Placement | None = None
    commits = passes = loaded = 0
    most_passes = 8 * abs(desired - len(committed.ordinals)) + 64
    slowest = total = 0.0
    while True:
        observed = Observed(
            pool=name,
            desired_replicas=desired,
            shape=shape,
            template_hash=TEMPLATE,
            pods=dict(pods),
            committed=committed,
            pending=pending,
            last_version=max(committed.version, pending.version if pending else 0),
            max_servers_per_change=bound,
        )
        start = time.process_time()
        step = plan(observed)
        took = time.process_time() - start
        passes += 1
        slowest, total = max(slowest, took), total + took
        for n in step.create_pods:
            pods[n] = PodState(n, ready=True, template_hash=TEMPLATE, node=node(n))
        for n in step.delete_pods:
            del pods[n]
        if step.publish is not None:
            new_committed, pending = step.publish
            if pending is None:  # a commit
                assert new_committed is not None
                loaded = max(loaded, diff(committed, new_committed).num_moves)
                committed = new_committed
                commits += 1
        elif not (step.create_pods or step.delete_pods or step.progressing):
            break
        if passes > most_passes:
            raise RuntimeError(f"{name}: no progress after {passes} passes ({step.progress_message})")
    assert len(committed.ordinals) == desired and committed.replica_counts().min() >= shape.replication
    return Run(name, direction, bound, commits, passes, slowest, total, loaded), committed


def first_placement(shape: planning.PoolShape, servers: int) -> planning.Placement:
    names = {n: f"p-{n}" for n in range(servers)}
    return planning.initial(shape, {n: node(n) for n in range(servers)}, names)


def main() -> None:
    args = _common.parser(__doc__.splitlines()[0]).parse_args()
    if args.quick:
        shapes = [("small", planning.PoolShape(tuple(range(8)), 64, 2), 8, 40, True)]
    else:
        shapes = [
            ("deepseek-v3", planning.PoolShape(tuple(range(3, 61)), 256, 2), 64, 320, True),
            ("kimi-k2", planning.PoolShape(tuple(range(1, 61)), 384, 3), 64, 320, False),
        ]
    runs: list[Run] = []
    for name, shape, low, high, with_baseline in shapes:
        for bound in (0, 1) if with_baseline else (0,):
            up, top = scale(name, shape, first_placement(shape, low), high, bound)
            down, _ = scale(name, shape, top, low, bound)
            runs += [up, down]
    print(
        f"{'shape':<12} {'dir':<5} {'bound':>5} {'commits':>7} {'passes':>6} "
        f"{'slowest pass s':>14} {'planner s':>9} {'copies/change':>13}"
    )
    for r in runs:
        print(
            f"{r.shape:<12} {r.direction:<5} {r.bound:>5} {r.commits:>7} {r.passes:>6} "
            f"{r.slowest_pass_s:>14.3f} {r.planner_s:>9.2f} {r.loaded_per_change:>13}"
        )
    targets = {}
    for r in runs:
        if r.bound == 0:
            targets[f"commits@{r.shape}.{r.direction}"] = _common.target(r.commits, 8, higher_is_better=False)
    for name, *_ in shapes:
        batched = {r.direction: r for r in runs if r.shape == name and r.bound == 0}
        single = {r.direction: r for r in runs if r.shape == name and r.bound == 1}
        for direction, one in single.items():
            ratio = batched[direction].planner_s / one.planner_s
            print(f"{name} {direction}: batched planner time / one-at-a-time = {ratio:.3f}")
            targets[f"planner_vs_single@{name}.{direction}"] = _common.target(
                ratio, 1.0, higher_is_better=False
            )
    _common.emit("scale_steps", [vars(r) for r in runs], targets, args.json_out)


if __name__ == "__main__":
    main()
