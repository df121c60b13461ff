"""The Helm chart: lint, render, least-privilege RBAC, optional ServiceMonitor, documented values.

helm is the one the e2e control plane builds (``make k8s-bins``), found like the e2e fixtures
find it; without it these tests are skipped.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "eaas"
if str(ROOT) not in sys.path:  # e2e/ is a package at the repository root
    sys.path.insert(0, str(ROOT))

from e2e import binaries  # noqa: E402

# Exactly what the operator does (see eaas.operator.kube and the reconcilers); nothing more.
EXPECTED_RULES = {
    ("eaas.io", "moeservices"): {"list", "watch", "patch"},
    # delete: the pools of a model revision that no longer serves (blue/green)
    ("eaas.io", "attentionpools"): {"get", "list", "watch", "create", "patch", "delete"},
    ("eaas.io", "expertpools"): {"get", "list", "watch", "create", "patch", "delete"},
    ("eaas.io", "moeservices/status"): {"patch"},
    ("eaas.io", "attentionpools/status"): {"patch"},
    ("eaas.io", "expertpools/status"): {"patch"},
    ("eaas.io", "expertpools/scale"): {"patch"},
    ("", "pods"): {"list", "create", "delete"},
    # server-side apply that creates needs create too; get: the API Service's owner is checked first
    ("", "services"): {"get", "create", "patch"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "secrets"): {"create"},  # the data-token Secret: created once, never read
    ("apps", "deployments"): {"create", "patch"},
    ("policy", "poddisruptionbudgets"): {"create", "patch"},  # one server or attention pod evicted at a time
    # patch: a leaving server is told it may go; watch: a client's failover, a server's loaded placement
    ("coordination.k8s.io", "leases"): {"list", "watch", "patch"},
    ("autoscaling", "horizontalpodautoscalers"): {"list"},  # an HPA on a pool the operator scales
    ("networking.k8s.io", "networkpolicies"): {"create", "patch", "delete"},
    ("", "events"): {"create"},
}
# With runtimeRbac.create (the default): the pods' ServiceAccount, its RoleBinding and the Role that
# reads the MoEService's placement ConfigMaps by name, per MoEService. That Role grants list and
# watch on configmaps, which the operator must hold to grant (it holds no escalate).
RUNTIME_ACCESS_RULES = {
    ("", "serviceaccounts"): {"create"},
    ("rbac.authorization.k8s.io", "roles"): {"create"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"create"},
    ("rbac.authorization.k8s.io", "clusterroles"): {"bind"},
    ("", "configmaps"): {"list", "watch"},
}


def merged(*tables: dict[tuple[str, str], set[str]]) -> dict[tuple[str, str], set[str]]:
    result: dict[tuple[str, str], set[str]] = {}
    for table in tables:
        for key, verbs in table.items():
            result.setdefault(key, set()).update(verbs)
    return result


@pytest.fixture(scope="module")
def helm() -> str:
    try:
        return binaries.tool_path("helm")
    except binaries.MissingBinariesError as error:
        pytest.skip(str(error))


def render(helm: str, *args: str) -> list[dict[str, Any]]:
    command = [
        helm,
        "template",
        "eaas",
        str(CHART),
        "--namespace",
        "eaas-system",
        "--kube-version",
        "1.37.1",
        *args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def of_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents if doc["kind"] == kind]


def rules_table(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


def test_chart_lints(helm: str) -> None:
    result = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_default_render(helm: str) -> None:
    documents = render(helm)
    kinds = sorted(doc["kind"] for doc in documents)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Service",
            "ConfigMap",
        ]
    )
    (deployment,) = of_kind(documents, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "eaas-operator"
    (container,) = pod["containers"]
    assert container["command"] == ["eaas", "operator"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_grafana_dashboard_ships_as_a_configmap_the_sidecar_loads(helm: str) -> None:
    (config_map,) = of_kind(render(helm), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = CHART / "dashboards" / "eaas-overview.json"
    assert json.loads(config_map["data"]["eaas-overview.json"]) == json.loads(dashboard.read_text())
    custom = render(
        helm,
        "--set",
        "metrics.grafanaDashboard.labels.grafana_dashboard=null",
        "--set",
        "metrics.grafanaDashboard.labels.team=ml",
        "--set",
        "metrics.grafanaDashboard.annotations.grafana_folder=EaaS",
    )
    (config_map,) = of_kind(custom, "ConfigMap")
    assert (
        config_map["metadata"]["labels"]["team"] == "ml"
        and "grafana_dashboard" not in config_map["metadata"]["labels"]
    )
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "EaaS"}
    assert not of_kind(render(helm, "--set", "metrics.grafanaDashboard.enabled=false"), "ConfigMap")


def test_operator_rbac_is_exactly_what_it_uses(helm: str) -> None:
    documents = render(helm)
    roles = {doc["metadata"]["name"]: doc for doc in of_kind(documents, "ClusterRole")}
    assert rules_table(roles["eaas-operator"]["rules"]) == merged(EXPECTED_RULES, RUNTIME_ACCESS_RULES)
    (bind,) = [r for r in roles["eaas-operator"]["rules"] if "bind" in r["verbs"]]
    assert bind["resourceNames"] == ["eaas-runtime"]  # it may bind the runtime's role and no other
    for role in roles.values():
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
    (binding,) = of_kind(documents, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "eaas-operator", "namespace": "eaas-system"}
    ]


def test_watch_namespaces_uses_roles_only(helm: str) -> None:
    documents = render(helm, "--set", "watchNamespaces={team-a,team-b}", "--set", "runtimeRbac.create=false")
    assert not of_kind(documents, "ClusterRole") and not of_kind(documents, "ClusterRoleBinding")
    roles = of_kind(documents, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    assert all(rules_table(role["rules"]) == EXPECTED_RULES for role in roles)
    args = of_kind(documents, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_service_monitor_needs_the_flag_and_the_api(helm: str) -> None:
    assert not of_kind(render(helm, "--set", "metrics.serviceMonitor.enabled=true"), "ServiceMonitor")
    api = ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"]
    assert not of_kind(render(helm, *api), "ServiceMonitor")
    (monitor,) = of_kind(render(helm, *api, "--set", "metrics.serviceMonitor.enabled=true"), "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_replica_count_is_zero_or_one(helm: str) -> None:
    assert not of_kind(render(helm, "--set", "replicaCount=0"), "Deployment")
    command = [helm, "template", "eaas", str(CHART), "--kube-version", "1.37.1", "--set", "replicaCount=2"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode != 0 and "replicaCount must be 0 or 1" in result.stderr


def test_old_clusters_are_refused(helm: str) -> None:
    command = [helm, "template", "eaas", str(CHART), "--kube-version", "1.28.0"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode != 0 and "kubeVersion" in result.stderr


def test_crds_ship_in_the_chart() -> None:
    shipped = sorted(path.name for path in (CHART / "crds").glob("*.yaml"))
    assert shipped == sorted(path.name for path in (ROOT / "crds").glob("*.yaml"))
    assert len(shipped) == 3


def test_every_value_is_documented() -> None:
    """Every key of values.yaml has a comment right above it, or sits inside a documented key."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    key = re.compile(r"^(\s*)([A-Za-z][\w.-]*):")
    undocumented: list[str] = []
    documented_indents: list[int] = []  # indents of documented ancestors of the current line
    for index, line in enumerate(lines):
        match = key.match(line)
        if not match:
            continue
        indent = len(match.group(1))
        documented_indents = [i for i in documented_indents if i < indent]
        previous = lines[index - 1].strip() if index else ""
        if previous.startswith("#"):
            documented_indents.append(indent)
        elif not documented_indents and not _is_group(lines, index, indent):
            undocumented.append(match.group(2))
    assert not undocumented, f"values without a comment: {undocumented}"


def _is_group(lines: list[str], index: int, indent: int) -> bool:
    """A key with nested keys only (e.g. `operator:`): its children carry the comments."""
    return (
        lines[index].rstrip().endswith(":")
        and index + 1 < len(lines)
        and (len(lines[index + 1]) - len(lines[index + 1].lstrip()) > indent)
    )
