# mypy: disable-error-code="union-attr,index,operator,arg-type,return-value,misc"
# (the kubernetes client types every model field as Optional; a None here is a test failure anyway.)
"""A MoEService's whole life on a real control plane, with `eaas operator` running as the chart's
ServiceAccount: create → Ready → scale up → scale down → operator restart → delete."""

from __future__ import annotations

import copy
import time
import urllib.request
from typing import Any

import pytest
import yaml
from kubernetes import client, watch

from e2e.cluster import Cluster
from e2e.operator.harness import ROOT, OperatorProcess, stored_placements
from e2e.waiting import wait_until
from eaas.runtime.placement.diff import diff
from eaas.runtime.placement.placement import Placement

pytestmark = pytest.mark.e2e

GROUP, VERSION = "eaas.io", "v1alpha1"
NAME, POOL, ATTENTION = "tiny", "tiny-experts", "tiny-attention"


KEYS_SECRET = "tiny-api-keys"


def tiny_gpu_manifest() -> dict[str, Any]:
    """manifests/moeservice-tiny-cpu.yaml with one GPU per expert server (the fake nodes have GPUs)."""
    manifest = yaml.safe_load((ROOT / "manifests" / "moeservice-tiny-cpu.yaml").read_text())
    manifest = copy.deepcopy(manifest)
    manifest["spec"]["expertPool"]["gpusPerPod"] = 1
    manifest["spec"]["attentionPool"]["apiKeysSecret"] = {"name": KEYS_SECRET}
    return manifest


def apply_tiny(
    cluster: Cluster, namespace: str, manifest: dict[str, Any] | None = None, keys: str = "sk-e2e"
) -> None:
    """The API-keys Secret the manifest names, then the tiny GPU MoEService (or `manifest`);
    skips the test on a cluster without GPU nodes."""
    if not cluster.gpu_nodes():
        pytest.skip("the cluster has no GPU node")
    secret = {"metadata": {"name": KEYS_SECRET}, "stringData": {"api-keys": keys}}
    cluster.core.create_namespaced_secret(namespace, secret)
    cluster.apply(yaml.safe_dump(manifest or tiny_gpu_manifest()), namespace)


def get(cluster: Cluster, plural: str, namespace: str, name: str) -> dict[str, Any]:
    return cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)


def condition(obj: dict[str, Any], type_: str) -> str | None:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item["type"] == type_:
            return str(item["status"])
    return None


def expert_pods(cluster: Cluster, namespace: str) -> dict[str, Any]:
    pods = cluster.core.list_namespaced_pod(namespace, label_selector=f"eaas.io/pool={POOL}").items
    return {pod.metadata.name: pod for pod in pods}


def committed(cluster: Cluster, namespace: str) -> Placement | None:
    config_map = cluster.core.read_namespaced_config_map(f"{POOL}-placement", namespace)
    return stored_placements(config_map)[0]


def wait_ready(cluster: Cluster, namespace: str, servers: int, timeout: float = 90) -> Placement:
    """Until the MoEService is Ready and the committed placement spans exactly `servers` servers."""

    def settled() -> Placement | None:
        service = get(cluster, "moeservices", namespace, NAME)
        placement = committed(cluster, namespace)
        pods = expert_pods(cluster, namespace)
        running = [
            p for p in pods.values() if p.status.phase == "Running" and not p.metadata.deletion_timestamp
        ]
        if (
            condition(service, "Ready") == "True"
            and condition(service, "Progressing") == "False"
            and placement is not None
            and placement.num_servers == servers
            and len(pods) == len(running) == servers
        ):
            return placement
        return None

    return wait_until(
        settled,
        timeout,
        f"MoEService Ready with {servers} expert servers",
        interval=0.3,
        ignore=(client.ApiException,),
    )


def resource_versions(cluster: Cluster, namespace: str) -> dict[str, str]:
    """resourceVersion of everything the operator owns or writes."""
    versions = {}
    for plural, name in (("moeservices", NAME), ("attentionpools", ATTENTION), ("expertpools", POOL)):
        versions[f"{plural}/{name}"] = get(cluster, plural, namespace, name)["metadata"]["resourceVersion"]
    for pod in cluster.core.list_namespaced_pod(namespace, label_selector="eaas.io/moeservice=tiny").items:
        versions[f"pod/{pod.metadata.name}"] = pod.metadata.resource_version
    for kind, read in (
        ("service", cluster.core.read_namespaced_service),
        ("configmap", cluster.core.read_namespaced_config_map),
        ("deployment", cluster.apps.read_namespaced_deployment),
    ):
        for name in (POOL, ATTENTION, NAME, f"{POOL}-placement"):
            try:
                versions[f"{kind}/{name}"] = read(name, namespace).metadata.resource_version
            except client.ApiException as error:
                assert error.status == 404
    return versions


def history(cluster: Cluster, list_call: Any, namespace: str, since: str) -> list[tuple[int, str, Any]]:
    """(resourceVersion, event type, object) of every change in `namespace` after `since`, replayed
    by a watch. resourceVersions are etcd revisions: they order changes across kinds."""
    stream = watch.Watch().stream(list_call, namespace, resource_version=since, timeout_seconds=2)
    return [(int(e["object"].metadata.resource_version), e["type"], e["object"]) for e in stream]


def test_moeservice_lifecycle(cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    apply_tiny(cluster, namespace, keys="sk-e2e-one sk-e2e-two")
    gpu_nodes = set(cluster.gpu_nodes())

    # -- created: pools, pods on GPU nodes, Services, placement; Ready -----------------------------
    first = wait_ready(cluster, namespace, servers=3)
    assert first.version >= 1 and first.ordinals == (0, 1, 2) and first.replication == 2
    assert first.replica_counts().min() >= 2
    pods = expert_pods(cluster, namespace)
    assert sorted(pods) == [f"{POOL}-0", f"{POOL}-1", f"{POOL}-2"]
    for pod in pods.values():
        assert pod.spec.node_name in gpu_nodes
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
        assert pod.metadata.owner_references[0].kind == "ExpertPool"
    headless = cluster.core.read_namespaced_service(POOL, namespace)
    assert headless.spec.cluster_ip == "None"
    assert cluster.core.read_namespaced_service(ATTENTION, namespace).spec.ports[0].port == 8000
    api = cluster.core.read_namespaced_service(NAME, namespace)  # the MoEService's: the serving slot's pods
    assert api.spec.selector == {"eaas.io/pool": ATTENTION, "app.kubernetes.io/component": "attention-client"}
    assert api.metadata.owner_references[0].kind == "MoEService" and api.spec.ports[0].port == 8000
    moe_status = get(cluster, "moeservices", namespace, NAME)["status"]
    assert (
        moe_status["endpoint"] == f"http://{NAME}.{namespace}.svc:8000/v1"
        and moe_status["servingSlot"] == "blue"
    )
    assert moe_status["revision"].startswith("ckpt-")
    deployment = cluster.apps.read_namespaced_deployment(ATTENTION, namespace)
    volumes = {v.name: v for v in deployment.spec.template.spec.volumes}
    assert volumes["placement"].config_map.name == f"{POOL}-placement"
    # -- the pods' own ServiceAccount: their Leases and placement ConfigMaps (kubectl auth can-i) -
    account = f"system:serviceaccount:{namespace}:{NAME}-runtime"
    assert {p.spec.service_account_name for p in pods.values()} == {f"{NAME}-runtime"}
    assert deployment.spec.template.spec.service_account_name == f"{NAME}-runtime"

    def runtime_can(*args: str, where: str = namespace) -> bool:
        result = cluster.kubectl("auth", "can-i", *args, "-n", where, "--as", account, check=False)
        return result.stdout.strip() == "yes"

    for verb in ("get", "create", "update", "list"):  # list: an expert server reads its clients' Leases
        assert runtime_can(verb, "leases.coordination.k8s.io"), verb
    assert not runtime_can("delete", "leases.coordination.k8s.io")  # one step beyond
    assert not runtime_can("watch", "leases.coordination.k8s.io")
    assert not runtime_can("get", "secrets") and not runtime_can("list", "pods")
    assert not runtime_can("create", "leases.coordination.k8s.io", where="default")  # this namespace only
    # their placement ConfigMaps (both slots'), watched by name, and no other ConfigMap
    for config_map in (f"{POOL}-placement", f"{NAME}-green-experts-placement"):
        for verb in ("get", "list", "watch"):
            assert runtime_can(verb, f"configmaps/{config_map}"), (verb, config_map)
        assert not runtime_can("update", f"configmaps/{config_map}")
    assert not runtime_can("list", "configmaps") and not runtime_can("get", "configmaps/kube-root-ca.crt")
    # -- NetworkPolicies: stored and validated by the real API server (nothing enforces them here) --
    policies = client.NetworkingV1Api(cluster.api_client).list_namespaced_network_policy(namespace).items
    by_name = {p.metadata.name: p for p in policies}
    assert set(by_name) == {f"{NAME}-expert-servers", f"{NAME}-attention"}
    expert_rules = by_name[f"{NAME}-expert-servers"].spec.ingress
    assert expert_rules[0]._from[0].pod_selector.match_labels == {
        "eaas.io/moeservice": NAME,
        "app.kubernetes.io/component": "attention-client",
    }
    assert expert_rules[1]._from[0].namespace_selector.match_labels == {
        "kubernetes.io/metadata.name": operator.namespace
    }
    off = {"spec": {"networkPolicy": {"enabled": False}}}
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "moeservices", NAME, off)
    wait_until(
        lambda: (
            not client.NetworkingV1Api(cluster.api_client).list_namespaced_network_policy(namespace).items
        ),
        30,
        "the NetworkPolicies removed (networkPolicy.enabled: false)",
        interval=0.3,
    )
    token = cluster.core.read_namespaced_secret(f"{NAME}-data-token", namespace)
    assert token.metadata.owner_references[0].kind == "MoEService" and set(token.data) == {"tokens"}
    assert volumes["data-token"].secret.secret_name == f"{NAME}-data-token"
    (keys,) = [e for e in deployment.spec.template.spec.containers[0].env if e.name == "EAAS_API_KEYS"]
    assert keys.value is None and keys.value_from.secret_key_ref.name == KEYS_SECRET
    pool = get(cluster, "expertpools", namespace, POOL)
    assert pool["status"]["selector"] == "app.kubernetes.io/component=expert-server,eaas.io/pool=tiny-experts"
    assert condition(get(cluster, "attentionpools", namespace, ATTENTION), "Ready") == "True"
    table = cluster.kubectl("get", "moeservices", "-n", namespace).stdout.split()
    assert table[:6] == ["NAME", "READY", "EXPERTS", "ATTENTION", "PLACEMENT", "AGE"]
    assert table[6:10] == [NAME, "True", "3", "1"]
    table = cluster.kubectl("get", "expertpools", "-n", namespace).stdout.split()
    assert table[:6] == ["NAME", "READY", "DESIRED", "REPLICAS", "PLACEMENT", "AGE"]
    assert table[6:10] == [POOL, "True", "3", "3"]

    # -- scale up through /scale: exactly one more pod, a new placement that keeps R ---------------
    uids = {name: pod.metadata.uid for name, pod in pods.items()}
    cluster.kubectl("scale", f"expertpool/{POOL}", "-n", namespace, "--replicas=4")
    grown = wait_ready(cluster, namespace, servers=4)
    assert grown.version > first.version and grown.ordinals == (0, 1, 2, 3)
    assert grown.replica_counts().min() >= 2
    pods = expert_pods(cluster, namespace)
    assert sorted(pods) == [f"{POOL}-{n}" for n in range(4)]
    assert all(pods[name].metadata.uid == uid for name, uid in uids.items())  # nobody restarted
    assert diff(first, grown).num_moves == len(grown.experts_of(3))  # only the new server loads

    # -- scale down: experts re-homed and the placement published before the pod goes ------------
    since = cluster.core.list_namespaced_pod(namespace).metadata.resource_version
    cluster.kubectl("scale", f"expertpool/{POOL}", "-n", namespace, "--replicas=3")
    shrunk = wait_ready(cluster, namespace, servers=3)
    pod_changes = history(cluster, cluster.core.list_namespaced_pod, namespace, since)
    deleted = min(
        rv
        for rv, kind, pod in pod_changes
        if pod.metadata.name == f"{POOL}-3" and (kind == "DELETED" or pod.metadata.deletion_timestamp)
    )
    placements = [
        (rv, placement)
        for rv, _, config_map in history(cluster, cluster.core.list_namespaced_config_map, namespace, since)
        if config_map.metadata.name == f"{POOL}-placement"
        and (placement := stored_placements(config_map)[0]) is not None
    ]
    drained = min(rv for rv, placement in placements if 3 not in placement.ordinals)
    assert drained < deleted, "the pod went away before the placement without it was committed"
    assert shrunk.ordinals == (0, 1, 2) and shrunk.replica_counts().min() >= 2
    assert shrunk.version > grown.version
    reasons = [
        event.reason
        for event in cluster.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={POOL}"
        ).items
    ]
    assert {"ScalingUp", "ScalingDown", "PlacementCommitted", "ServerRemoved"} <= set(reasons)

    # -- below R is refused by the API server (CEL on the scale subresource's object) -------------
    refused = cluster.kubectl("scale", f"expertpool/{POOL}", "-n", namespace, "--replicas=1", check=False)
    assert refused.returncode != 0 and "replicationFactor must be <= replicas" in refused.stderr

    # -- autoscaling mode off: the MoEService is the one writer and uses /scale itself -------------
    patch = {"spec": {"autoscaling": {"mode": "off"}, "expertPool": {"replicas": 4}}}
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "moeservices", NAME, patch)
    final = wait_ready(cluster, namespace, servers=4)
    managers = {
        entry["manager"]
        for entry in get(cluster, "expertpools", namespace, POOL)["metadata"]["managedFields"]
    }
    assert "eaas-operator" in managers

    # -- metrics and liveness of the operator process ---------------------------------------------
    scrape = (
        urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5).read().decode()
    )
    assert 'eaas_operator_reconcile_total{kind="ExpertPool",result="success"}' in scrape
    assert 'eaas_operator_placement_changes_total{stage="committed"}' in scrape
    assert 'eaas_operator_scale_writes_total{writer="moeservice"} 1.0' in scrape
    health = urllib.request.urlopen(f"http://127.0.0.1:{operator.health_port}/healthz", timeout=5)
    assert health.status == 200

    # -- restart (SIGKILL) changes nothing -----------------------------------------------------------
    time.sleep(3)  # let the last status writes land
    before = resource_versions(cluster, namespace)
    operator.kill()
    operator.start()
    operator.wait_started()
    time.sleep(6)  # several resync periods and the initial listing
    assert resource_versions(cluster, namespace) == before
    assert committed(cluster, namespace) == final

    assert "Traceback" not in operator.log_path.read_text(), operator.log_tail()

    # -- delete: garbage collection removes everything ---------------------------------------------
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "moeservices", NAME)

    wait_until(
        lambda: not leftovers(cluster, namespace),
        60,
        "every child of the MoEService to be garbage-collected",
        interval=0.5,
    )
    assert not operator.forbidden(), operator.forbidden()


def leftovers(cluster: Cluster, namespace: str) -> dict[str, str]:
    """Names of the MoEService's objects that still exist."""
    left: dict[str, str] = {}
    for plural in ("moeservices", "attentionpools", "expertpools"):
        items = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)["items"]
        left.update({f"{plural}/{item['metadata']['name']}": "" for item in items})
    selector = "eaas.io/moeservice=tiny"
    lists: dict[str, Any] = {
        "pod": cluster.core.list_namespaced_pod,
        "service": cluster.core.list_namespaced_service,
        "configmap": cluster.core.list_namespaced_config_map,
        "deployment": cluster.apps.list_namespaced_deployment,
    }
    for kind, list_call in lists.items():
        for obj in list_call(namespace, label_selector=selector).items:
            left[f"{kind}/{obj.metadata.name}"] = ""
    return left
