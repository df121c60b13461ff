"""MoEService → its two NetworkPolicies: who may reach the expert servers and the attention clients.

* ``<m>-expert-servers``: the control and data ports only from this MoEService's attention pods;
  the control port also from the operator's pod (it reads ``/v1/stats`` to rebalance), from the
  monitoring namespaces (``/metrics``) and from the pool's other expert servers (a new server
  fetches the experts they hold, ``/v1/experts``). Nothing else, other MoEServices included.
* ``<m>-attention``: the API port from anywhere, or only from this namespace and the namespaces
  listed (plus monitoring).
* With transport ``nixl``, each also admits UCX's TCP port range (``spec.ucx``) from the other
  pool's pods: UCX connects in whichever direction an endpoint is first needed, so a server that
  writes an answer may open the connection to its client.

Policies select pods by the MoEService's and the component's labels (the pods of both slots of a
blue/green rollout); they only restrict ingress. A cluster whose network
plugin does not enforce NetworkPolicies ignores them (the API server stores them all the same).
"""

from __future__ import annotations

from typing import Any

from eaas.operator import naming
from eaas.operator.api.moeservice import MoEServiceSpec
from eaas.operator.builders.common import Body, owned

OPERATOR_POD = {naming.NAME_LABEL: naming.APP, naming.COMPONENT_LABEL: "operator"}  # the chart's labels


def _namespace(name: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}


def _ports(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _port_range(first: int, last: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": first, "endPort": last}]


def _policy(service: Body, name: str, pods: dict[str, str], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    body = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": name,
            "namespace": service["metadata"]["namespace"],
            "labels": naming.common_labels(service["metadata"]["name"], "network-policy"),
        },
        "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": ingress},
    }
    return owned(body, service)


def network_policies(
    service: Body, spec: MoEServiceSpec, operator_namespace: str | None
) -> list[dict[str, Any]]:
    """The expert servers' and the attention clients' NetworkPolicies."""
    name = service["metadata"]["name"]
    # Both slots' pods (blue/green): a pool's attention clients reach only its own servers anyway.
    expert_pods = {naming.SERVICE_LABEL: name, naming.COMPONENT_LABEL: naming.EXPERT_COMPONENT}
    attention_pods = {naming.SERVICE_LABEL: name, naming.COMPONENT_LABEL: naming.ATTENTION_COMPONENT}
    control, data = spec.expert_pool.port, spec.expert_pool.data_port
    monitoring = [_namespace(ns) for ns in spec.network_policy.monitoring_namespaces]

    ucx = _port_range(spec.ucx.tcp_port_min, spec.ucx.tcp_port_max) if spec.transport == "nixl" else []

    expert_ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": attention_pods}}], "ports": _ports(control, data) + ucx}
    ]
    if operator_namespace:
        operator = {**_namespace(operator_namespace), "podSelector": {"matchLabels": OPERATOR_POD}}
        expert_ingress.append({"from": [operator], "ports": _ports(control)})
    if monitoring:
        expert_ingress.append({"from": monitoring, "ports": _ports(control)})
    expert_ingress.append({"from": [{"podSelector": {"matchLabels": expert_pods}}], "ports": _ports(control)})

    api = _ports(spec.attention_pool.port)
    allowed = spec.network_policy.api_from_namespaces
    if allowed:
        sources = [{"podSelector": {}}, *(_namespace(ns) for ns in allowed), *monitoring]
        attention_ingress = [{"from": sources, "ports": api}]
    else:
        attention_ingress = [{"ports": api}]  # no "from": any source
    if ucx:
        attention_ingress.append({"from": [{"podSelector": {"matchLabels": expert_pods}}], "ports": ucx})
    return [
        _policy(service, f"{name}-expert-servers", expert_pods, expert_ingress),
        _policy(service, f"{name}-attention", attention_pods, attention_ingress),
    ]
