"""The chart's Grafana dashboard reads only series that EaaS exports, and is well formed.

(That every panel shows data on a running system is checked end to end, under load, by
``e2e/operator/system/test_autoscaling.py::test_every_dashboard_panel_has_data_under_load``.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from eaas.operator.metrics import OperatorMetrics
from eaas.runtime.server.metrics import ServerMetrics
from eaas.runtime.serving.metrics import AttentionMetrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "charts" / "eaas" / "dashboards" / "eaas-overview.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
SERIES = re.compile(r"\b(eaas_[a-z_]+)\b")


def panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def exported_series() -> set[str]:
    """Every series name the attention clients, expert servers and operator can export."""
    names: set[str] = set()
    registries = [
        AttentionMetrics("m").registry,
        ServerMetrics().registry,
        OperatorMetrics(CollectorRegistry()).registry,
    ]
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
            names.update(sample.name for sample in family.samples)
    return names


def test_every_panel_reads_series_that_eaas_exports() -> None:
    exported = exported_series()
    assert len(panels()) >= 13
    for panel in panels():
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(SERIES.findall(target["expr"]))
            assert used, (panel["title"], target["expr"])
            assert used <= exported, (panel["title"], sorted(used - exported))


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "eaas-overview"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert set(re.findall(r"\$(\w+)", target["expr"])) <= variables | {"__rate_interval"}, target
            # Pods' series are filtered by the namespace variable; the operator's are cluster-wide.
            if "eaas_operator_" not in target["expr"]:
                assert 'namespace=~"$namespace"' in target["expr"], target["expr"]


def test_operator_counters_exist_at_zero_before_anything_happened() -> None:
    """So that increase() sees a pool's first scale or placement change (and the panels have data)."""
    text = "\n".join(
        f"{s.name}{s.labels} {s.value}"
        for family in OperatorMetrics(CollectorRegistry()).registry.collect()
        for s in family.samples
    )
    for line in (
        "eaas_operator_scale_writes_total{'writer': 'autoscaler'} 0.0",
        "eaas_operator_placement_changes_total{'stage': 'committed'} 0.0",
        "eaas_operator_rebalances_total{'result': 'rebalanced'} 0.0",
    ):
        assert line in text
