"""What a server process's exit costs: the interpreter's teardown against ``end_process``.

A child process imports what an expert server and an attention client import (torch and the
runtime), computes a little, tells the parent it is done and ends, either by returning (the
interpreter tears its modules down, runs atexit handlers and collects its objects) or through
``eaas.runtime.server.daemon.end_process`` (logging and the standard streams flushed, then
``os._exit``), as the servers end since 2026-11-27. Measured in turns, in the same run: the wall
time from the child's "done" to its exit, and the CPU seconds the child used in that time (its
total CPU from ``wait4`` less what it had used when it said "done", read from /proc).

Why it matters: on a node where a retiring pool's servers exit beside pods that serve, their
teardown is CPU taken from those pods (drill 14 on the 2-core CPU machine: the three servers of
the old pair burned CPU for ~3 s after logging their exit, and a request on the new pair waited
1.5-1.8 s then). Target: ``end_process`` ends the process in under a quarter of the teardown's
wall time.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from _common import cpu_seconds, emit, parser, target

CHILD = r"""
import sys
import torch
import eaas.runtime.client.remote_experts, eaas.runtime.server.expert_server, eaas.runtime.serving.serve
from eaas.runtime.server.daemon import end_process
weights = [torch.randn(256, 256) for _ in range(32)]
out = weights[0] @ weights[1]
sys.stdout.write("done\n")
sys.stdout.flush()
sys.stdin.readline()  # the parent has read our CPU time
if sys.argv[1] == "end_process":
    end_process(0)
"""


def one(mode: str) -> tuple[float, float]:
    """(seconds from "done" to the exit, CPU seconds used meanwhile) of one child."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "done"
    before = cpu_seconds(child.pid)
    started = time.perf_counter()
    child.stdin.write("go\n")
    child.stdin.flush()
    _, status, usage = os.wait4(child.pid, 0)
    took = time.perf_counter() - started
    assert os.waitstatus_to_exitcode(status) == 0, status
    return took, usage.ru_utime + usage.ru_stime - before


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, help="children of each kind (default 5; quick 2)")
    args = p.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    measured: dict[str, list[tuple[float, float]]] = {"teardown": [], "end_process": []}
    for _ in range(rounds):  # in turns: load from other processes falls on both alike
        for mode in measured:
            measured[mode].append(one(mode))
    rows = []
    print(f"{'exit':>12} {'wall s (median)':>16} {'CPU s (median)':>15}  runs")
    for mode, runs in measured.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        rows.append({"exit": mode, "wall_s": wall, "cpu_s": cpu, "runs": runs})
        print(f"{mode:>12} {wall:>16.3f} {cpu:>15.3f}  {', '.join(f'{w:.3f}' for w, _ in runs)}")
    ratio = rows[1]["wall_s"] / rows[0]["wall_s"]
    print(f"end_process / teardown, wall time: {ratio:.3f}")
    emit(
        "process_exit",
        rows,
        {"end_process_over_teardown": target(ratio, 0.25, higher_is_better=False)},
        args.json_out,
    )


if __name__ == "__main__":
    main()
