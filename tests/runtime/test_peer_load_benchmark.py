"""benchmarks/peer_load.py runs end to end (a new server from its peers and from the checkpoint)
and ends with the JSON line."""

from __future__ import annotations

from pathlib import Path

from benchmark_runs import run_quick


def test_peer_load_quick(tmp_path: Path) -> None:
    last = run_quick("peer_load.py", tmp_path, "--repeats", "1")
    modes = {row["mode"]: row for row in last["results"]}
    assert set(modes) == {"checkpoint", "peer"}
    assert modes["peer"]["experts"] == modes["checkpoint"]["experts"] == 12
    assert modes["peer"]["share_mib"] == modes["checkpoint"]["share_mib"] > 100
