"""Runs a ``benchmarks/`` script with ``--quick`` and checks the JSON line every benchmark ends with,
or loads one as a module to test its pure parts (imported by the benchmark tests of several test
directories)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_quick(script: str, tmp_path: Path, *extra: str, timeout: float = 300) -> dict[str, Any]:
    json_out = tmp_path / f"{script}.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--json-out", str(json_out), *extra],
        capture_output=True, text=True, timeout=timeout, cwd=BENCHMARKS.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    last: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == json.loads(json_out.read_text())
    assert set(last) == {"benchmark", "device", "commit", "results", "targets"}
    for entry in last["targets"].values():
        assert set(entry) == {"value", "target", "met"} and isinstance(entry["met"], bool)
    return last


@contextlib.contextmanager
def benchmark_module(script: str) -> Iterator[ModuleType]:
    """``benchmarks/<script>`` as a module named ``<stem>_benchmark`` (it imports its siblings, such
    as ``_common``, while it loads), registered in ``sys.modules`` while the block runs (its
    dataclasses look their module up there)."""
    name = f"{Path(script).stem}_benchmark"
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    try:
        yield module
    finally:
        sys.modules.pop(name, None)
