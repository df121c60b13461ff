"""What every benchmark shares: the common flags, timing by medians, and the final JSON line.

Each ``benchmarks/<name>.py`` prints a readable table, then ends with one JSON line
``{"benchmark", "device", "commit", "results", "targets": {name: {"value", "target", "met"}}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes; finishes in under a minute on 2 cores")
    p.add_argument("--json-out", type=Path, help="also write the final JSON line to this file")
    return p


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device() -> str:
    """The GPU's name when CUDA is available, else the CPU and core count."""
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except ImportError:
        pass
    import os

    return f"cpu {platform.processor() or platform.machine()} x{os.cpu_count()}"


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` ran so far, all its threads (the scheduler's count, in ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def median_seconds(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def target(value: float, goal: float, higher_is_better: bool = True) -> dict[str, Any]:
    """One entry of ``targets``: ``met`` is computed from the measured ``value``."""
    met = value >= goal if higher_is_better else value <= goal
    return {"value": value, "target": goal, "met": bool(met)}


def emit(
    name: str, results: list[dict[str, Any]], targets: dict[str, dict[str, Any]], json_out: Path | None
) -> None:
    """Prints the final JSON line (and writes it to ``json_out`` when given)."""
    line = json.dumps(
        {"benchmark": name, "device": device(), "commit": commit(), "results": results, "targets": targets},
        sort_keys=False,
    )
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(line + "\n")
    print(line, flush=True)
