"""An ExpertPool's pass decodes its placement ConfigMap only when its resourceVersion changed."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from eaas.operator.reconcile import expertpool
from eaas.runtime.contract import PLACEMENT_KEY
from eaas.runtime.placement import round_robin, stored


def config_map(version: str, placement_version: int = 1) -> dict[str, Any]:
    placement = round_robin(range(3, 61), 256, 16, 2, version=placement_version)
    return {
        "metadata": {"name": "p-placement", "namespace": "ns", "resourceVersion": version},
        "binaryData": {PLACEMENT_KEY: base64.b64encode(stored.pack(placement)).decode()},
    }


def test_a_placement_is_decoded_once_per_resource_version(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = []
    read = stored.read_config_map

    def counting(config_map: Any) -> Any:
        decoded.append(config_map["metadata"]["resourceVersion"])
        return read(config_map)

    monkeypatch.setattr(stored, "read_config_map", counting)
    parsed: dict[tuple[str, str], tuple[str, Any]] = {}
    first = expertpool.read_placements(config_map("5"), parsed)
    for _ in range(3):  # resyncs: the same ConfigMap
        assert expertpool.read_placements(config_map("5"), parsed) is first
    assert first[0] is not None and first[0].version == 1 and decoded == ["5"]
    changed = expertpool.read_placements(config_map("6", placement_version=2), parsed)
    assert changed[0] is not None and changed[0].version == 2 and decoded == ["5", "6"]
    expertpool.read_placements(config_map("7"), None)  # no cache: decoded every time
    assert decoded == ["5", "6", "7"]


def test_an_unreadable_placement_is_remembered_as_unreadable_until_it_changes() -> None:
    broken = {"metadata": {"name": "p-placement", "namespace": "ns", "resourceVersion": "9"}, "data": {}}
    broken["binaryData"] = {PLACEMENT_KEY: "bm90IGEgcGxhY2VtZW50"}
    parsed: dict[tuple[str, str], tuple[str, Any]] = {}
    committed, pending, error = expertpool.read_placements(broken, parsed)
    assert committed is None and pending is None and "p-placement" in error
    assert expertpool.read_placements(broken, parsed)[2] == error
