"""Pure builders: the objects the operator creates for a MoEService and its pools."""

from __future__ import annotations

from typing import Any

import pytest

from eaas.kernels import get_backend
from eaas.operator import naming
from eaas.operator.api import AttentionPoolSpec, ExpertPoolSpec, MoEServiceSpec
from eaas.operator.api.moeservice import NetworkPolicySpec
from eaas.operator.api.pools import SecretKeySelector
from eaas.operator.builders import attentionpool, expertpool, moeservice
from eaas.operator.builders.common import (
    data_token_secret,
    merge_patch,
    runtime_placement_role,
    runtime_placement_role_binding,
)
from eaas.operator.builders.network import network_policies
from eaas.operator.planning import PoolShape, initial
from eaas.runtime.placement import stored


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "<downward>") for item in container["env"]}


def test_moeservice_children_are_owned_named_and_carry_the_model(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec
) -> None:
    experts = moeservice.expert_pool(moes_body, moes_spec)
    attention = moeservice.attention_pool(moes_body, moes_spec)
    assert experts["metadata"]["name"] == "tiny-experts" and attention["metadata"]["name"] == "tiny-attention"
    for child in (experts, attention):
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "eaas.io/v1alpha1",
            "kind": "MoEService",
            "name": "tiny",
            "uid": "moes-uid",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "ns"
        assert child["metadata"]["labels"][naming.SERVICE_LABEL] == "tiny"
    expert_spec = ExpertPoolSpec.from_k8s(experts["spec"])
    assert expert_spec.model == moes_spec.model and expert_spec.replicas == 3
    attention_spec = AttentionPoolSpec.from_k8s(attention["spec"])
    assert attention_spec.placement_config_map == "tiny-experts-placement"
    assert attention_spec.expert_pool_name == "tiny-experts"


def test_the_pods_may_read_their_placement_config_maps_and_no_other(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec
) -> None:
    role = runtime_placement_role(moes_body)
    (rule,) = role["rules"]
    # what each slot's pods are told to watch (and mount): the ConfigMap of that slot's expert pool
    watched = [
        moeservice.attention_pool_spec(moes_body, moes_spec, slot).placement_config_map
        for slot in naming.SLOTS
    ]
    assert rule == {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["get", "list", "watch"],  # no write, and only these names
        "resourceNames": watched,
    }
    assert watched == ["tiny-experts-placement", "tiny-green-experts-placement"]
    assert (
        role["metadata"]["namespace"] == "ns" and role["metadata"]["ownerReferences"][0]["uid"] == "moes-uid"
    )
    binding = runtime_placement_role_binding(moes_body)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-runtime", "namespace": "ns"}]


@pytest.mark.parametrize(
    ("mode", "writer"), [("off", "moeservice"), ("builtin", "autoscaler"), ("external", "external")]
)
def test_one_writer_of_expert_replicas_per_mode(moes_spec: MoEServiceSpec, mode: str, writer: str) -> None:
    spec = moes_spec.model_copy(
        update={"autoscaling": moes_spec.autoscaling.model_copy(update={"mode": mode})}
    )
    assert moeservice.replicas_writer(spec) == writer


def test_expert_pod_has_stable_identity_and_its_assignment(
    pool_body: dict[str, Any], pool_spec: ExpertPoolSpec
) -> None:
    pod = expertpool.pod(pool_body, pool_spec, 2)
    metadata, spec = pod["metadata"], pod["spec"]
    assert metadata["name"] == "tiny-experts-2" == spec["hostname"]
    assert spec["subdomain"] == "tiny-experts"  # DNS tiny-experts-2.tiny-experts.ns.svc
    assert metadata["labels"][naming.ORDINAL_LABEL] == "2"
    assert expertpool.selector("tiny-experts").items() <= metadata["labels"].items()
    assert (
        metadata["ownerReferences"][0]["kind"] == "ExpertPool"
        and metadata["ownerReferences"][0]["uid"] == "pool-uid"
    )
    (container,) = spec["containers"]
    env = env_of(container)
    assert env[naming.ENV_ORDINAL] == "2"
    assert env[naming.ENV_PLACEMENT_CONFIGMAP] == "tiny-experts-placement"
    assert env[naming.ENV_PLACEMENT_FILE] == "/etc/eaas/placement/placement.json"
    assert env[naming.ENV_TRANSPORT] == "tcp"
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert volumes["placement"]["configMap"]["name"] == "tiny-experts-placement"
    assert volumes["checkpoint"]["hostPath"]["path"] == "/var/lib/eaas/tiny-mixtral"
    assert "nvidia.com/gpu" not in str(container["resources"])  # gpusPerPod: 0 in the tiny manifest
    command = container["command"]
    assert command[:2] == ["eaas", "expert-server"]
    assert command[command.index("--placement-dir") + 1] == naming.PLACEMENT_MOUNT
    assert command[command.index("--ordinal") + 1] == f"$({naming.ENV_ORDINAL})"
    # Every $(VAR) in the command is defined in the container's env (the kubelet expands them).
    referenced = {arg[2:-1] for arg in command if arg.startswith("$(")}
    assert referenced <= set(env_of(container))
    assert env_of(container)[naming.ENV_POD_UID] == "<downward>"
    assert (env[naming.ENV_DEVICE], env[naming.ENV_KERNEL_BACKEND]) == ("cpu", "torch")


def test_gpu_expert_pod_requests_exactly_one_gpu(
    pool_body: dict[str, Any], pool_spec: ExpertPoolSpec
) -> None:
    spec = pool_spec.model_copy(update={"gpus_per_pod": 1, "gpu_resource_name": "amd.com/gpu"})
    container = expertpool.pod(pool_body, spec, 0)["spec"]["containers"][0]
    resources = container["resources"]
    assert resources["limits"]["amd.com/gpu"] == "1" == resources["requests"]["amd.com/gpu"]
    # A GPU server keeps its experts on the GPU and computes with the Triton kernels.
    env = env_of(container)
    assert (env[naming.ENV_DEVICE], env[naming.ENV_KERNEL_BACKEND]) == ("cuda", "triton")
    assert resources["requests"]["cpu"] == "250m"


@pytest.mark.parametrize(("gpus", "backend"), [(1, "grouped_mm"), (0, "simulated:200:3000"), (0, "torch")])
def test_expert_pod_runs_the_kernel_backend_the_spec_names(
    pool_body: dict[str, Any], pool_spec: ExpertPoolSpec, gpus: int, backend: str
) -> None:
    spec = pool_spec.model_copy(update={"gpus_per_pod": gpus, "kernel_backend": backend})
    container = expertpool.pod(pool_body, spec, 0)["spec"]["containers"][0]
    assert env_of(container)[naming.ENV_KERNEL_BACKEND] == backend
    assert expertpool.template_hash(spec) != expertpool.template_hash(pool_spec)  # the pods are replaced
    get_backend(backend)  # a name the pattern admits is one the server accepts


def test_single_node_transports_co_locate_pods(pool_body: dict[str, Any], pool_spec: ExpertPoolSpec) -> None:
    shm = expertpool.pod(pool_body, pool_spec.model_copy(update={"transport": "shm"}), 0)["spec"]
    assert shm["hostIPC"] is True
    term = shm["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["labelSelector"]["matchLabels"] == {naming.SERVICE_LABEL: "tiny"}
    tcp = expertpool.pod(pool_body, pool_spec, 0)["spec"]
    assert "hostIPC" not in tcp and "affinity" not in tcp


def test_template_hash_tracks_the_pod_template_only(pool_spec: ExpertPoolSpec) -> None:
    base = expertpool.template_hash(pool_spec)
    assert expertpool.template_hash(pool_spec.model_copy(update={"replicas": 7})) == base
    assert expertpool.template_hash(pool_spec.model_copy(update={"replication_factor": 3})) == base
    assert expertpool.template_hash(pool_spec.model_copy(update={"image": "eaas:2"})) != base


def test_headless_service_publishes_every_server(
    pool_body: dict[str, Any], pool_spec: ExpertPoolSpec
) -> None:
    service = expertpool.headless_service(pool_body, pool_spec)
    assert service["metadata"]["name"] == "tiny-experts"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == expertpool.selector("tiny-experts")
    assert {port["name"]: port["port"] for port in service["spec"]["ports"]} == {
        "control": 9100,
        "data": 9101,
    }


def test_placement_config_map_holds_both_placements_packed(
    pool_body: dict[str, Any], pool_spec: ExpertPoolSpec
) -> None:
    committed = initial(PoolShape.of(pool_spec), dict.fromkeys(range(3)), {})
    pending = committed.with_version(2)
    config_map = expertpool.placement_config_map(pool_body, committed, pending)
    assert config_map["metadata"]["name"] == "tiny-experts-placement"
    assert "data" not in config_map  # an older operator's JSON keys are dropped by the apply
    assert set(config_map["binaryData"]) == {naming.PLACEMENT_KEY, naming.PENDING_KEY}
    assert stored.read_config_map(config_map) == (committed, pending)
    assert config_map["metadata"]["annotations"][naming.PLACEMENT_VERSION_ANNOTATION] == "1"
    only_pending = expertpool.placement_config_map(pool_body, None, committed)
    assert set(only_pending["binaryData"]) == {naming.PENDING_KEY}


def test_attention_deployment_mounts_the_placement(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec
) -> None:
    pool = moeservice.attention_pool(moes_body, moes_spec)
    pool["metadata"]["uid"] = "attention-uid"
    spec = AttentionPoolSpec.from_k8s(pool["spec"])
    deployment = attentionpool.deployment(pool, spec)
    assert deployment["spec"]["replicas"] == 1
    template = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
    assert volumes["placement"]["configMap"]["name"] == "tiny-experts-placement"
    (container,) = template["spec"]["containers"]
    assert env_of(container)[naming.ENV_EXPERT_SERVICE] == "tiny-experts.ns.svc"
    assert env_of(container)[naming.ENV_EXPERT_PORT] == "9100"
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    service = attentionpool.service(pool, spec)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert attentionpool.endpoint(pool, spec) == "http://tiny-attention.ns.svc:8000/v1"


def test_attention_clients_get_the_expert_pool_port(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec
) -> None:
    custom = moes_spec.model_copy(
        update={"expert_pool": moes_spec.expert_pool.model_copy(update={"port": 9300})}
    )
    pool = moeservice.attention_pool(moes_body, custom)
    pool["metadata"]["uid"] = "attention-uid"
    spec = AttentionPoolSpec.from_k8s(pool["spec"])
    (container,) = attentionpool.deployment(pool, spec)["spec"]["template"]["spec"]["containers"]
    assert env_of(container)[naming.ENV_EXPERT_PORT] == "9300"


def test_attention_clients_read_api_keys_from_the_users_secret(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec
) -> None:
    def container(attention: dict[str, Any]) -> dict[str, Any]:
        custom = moes_spec.model_copy(
            update={"attention_pool": moes_spec.attention_pool.model_copy(update=attention)}
        )
        pool = moeservice.attention_pool(moes_body, custom)
        pool["metadata"]["uid"] = "attention-uid"
        spec = AttentionPoolSpec.from_k8s(pool["spec"])
        (found,) = attentionpool.deployment(pool, spec)["spec"]["template"]["spec"]["containers"]
        return found

    assert naming.ENV_API_KEYS not in {e["name"] for e in container({})["env"]}
    secret = SecretKeySelector(name="tiny-keys")
    (entry,) = [e for e in container({"api_keys_secret": secret})["env"] if e["name"] == naming.ENV_API_KEYS]
    assert entry["valueFrom"]["secretKeyRef"] == {"name": "tiny-keys", "key": "api-keys", "optional": False}
    assert "value" not in entry  # the key itself never appears in the Deployment


def test_attention_clients_get_their_micro_batches(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec
) -> None:
    def micro_batches(count: int) -> str:
        custom = moes_spec.model_copy(
            update={"attention_pool": moes_spec.attention_pool.model_copy(update={"micro_batches": count})}
        )
        pool = moeservice.attention_pool(moes_body, custom)
        pool["metadata"]["uid"] = "attention-uid"
        spec = AttentionPoolSpec.from_k8s(pool["spec"])
        (found,) = attentionpool.deployment(pool, spec)["spec"]["template"]["spec"]["containers"]
        return env_of(found)[naming.ENV_MICRO_BATCHES]

    assert moes_spec.attention_pool.micro_batches == 1 and micro_batches(1) == "1"
    assert micro_batches(3) == "3" and micro_batches(0) == "auto"  # what eaas attention-client takes


def test_merge_patch_turns_old_into_new() -> None:
    old = {"a": 1, "keep": {"x": 1, "gone": 2}, "list": [1, 2], "drop": {"y": 1}}
    new = {"a": 2, "keep": {"x": 1}, "list": [1], "add": {"z": 3}}
    assert merge_patch(old, new) == {
        "a": 2,
        "keep": {"gone": None},
        "list": [1],
        "drop": None,
        "add": {"z": 3},
    }
    assert merge_patch(new, new) is None


def both_pod_specs(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec, pool_body: dict[str, Any], pool_spec: ExpertPoolSpec
) -> list[dict[str, Any]]:
    """The pod specs of an attention pod (the Deployment's template) and of expert server 0."""
    attention = moeservice.attention_pool(moes_body, moes_spec)
    attention["metadata"]["uid"] = "attention-uid"
    deployment = attentionpool.deployment(attention, AttentionPoolSpec.from_k8s(attention["spec"]))
    return [deployment["spec"]["template"]["spec"], expertpool.pod(pool_body, pool_spec, 0)["spec"]]


def test_both_pools_mount_the_data_token_secret_and_read_it_from_the_file(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec, pool_body: dict[str, Any], pool_spec: ExpertPoolSpec
) -> None:
    for spec in both_pod_specs(moes_body, moes_spec, pool_body, pool_spec):
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["data-token"]["secret"]["secretName"] == "tiny-data-token"
        (container,) = spec["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert (
            mounts["data-token"]["mountPath"] == naming.DATA_TOKEN_MOUNT and mounts["data-token"]["readOnly"]
        )
        assert env_of(container)[naming.ENV_DATA_TOKEN_FILE] == f"{naming.DATA_TOKEN_MOUNT}/tokens"
    secret = data_token_secret(moes_body)
    assert secret["metadata"]["name"] == "tiny-data-token" and secret["metadata"]["ownerReferences"]
    token = secret["stringData"]["tokens"]
    assert len(token) >= 40 and token != data_token_secret(moes_body)["stringData"]["tokens"]


def test_network_policies_admit_only_this_services_clients_the_operator_and_monitoring(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec
) -> None:
    spec = moes_spec.model_copy(
        update={"network_policy": NetworkPolicySpec(monitoring_namespaces=["monitoring"])}
    )
    experts, attention = network_policies(moes_body, spec, "eaas-system")
    assert experts["metadata"]["name"] == "tiny-expert-servers" and experts["metadata"]["ownerReferences"]
    # Both slots' pods (blue/green): selected by the MoEService and the component, not the pool.
    server_pods = {"eaas.io/moeservice": "tiny", "app.kubernetes.io/component": "expert-server"}
    client_pods = {"eaas.io/moeservice": "tiny", "app.kubernetes.io/component": "attention-client"}
    for slot in naming.SLOTS:
        assert server_pods.items() <= expertpool.labels(moeservice.expert_pool(moes_body, spec, slot)).items()
        pool = moeservice.attention_pool(moes_body, spec, slot)
        assert client_pods.items() <= attentionpool.labels(pool).items()
    assert experts["spec"]["podSelector"]["matchLabels"] == server_pods
    assert experts["spec"]["policyTypes"] == ["Ingress"]
    clients, operator, monitoring, peers = experts["spec"]["ingress"]
    assert clients["from"] == [{"podSelector": {"matchLabels": client_pods}}]
    assert {p["port"] for p in clients["ports"]} == {9100, 9101}
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "eaas-system"
    }
    assert operator["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert [p["port"] for p in operator["ports"]] == [9100] == [p["port"] for p in monitoring["ports"]]
    assert peers["from"] == [{"podSelector": {"matchLabels": server_pods}}]
    assert [p["port"] for p in peers["ports"]] == [9100]  # weights from peers: the control port only
    (anyone,) = attention["spec"]["ingress"]
    assert "from" not in anyone and [p["port"] for p in anyone["ports"]] == [8000]

    # Without the operator's namespace (it runs outside the cluster) it gets no rule; the API can
    # be limited to this namespace and the ones listed (monitoring keeps its scrape).
    limited = spec.model_copy(
        update={
            "network_policy": NetworkPolicySpec(
                monitoring_namespaces=["monitoring"], api_from_namespaces=["apps"]
            )
        }
    )
    experts, attention = network_policies(moes_body, limited, None)
    assert len(experts["spec"]["ingress"]) == 3  # clients, monitoring, peers
    (rule,) = attention["spec"]["ingress"]
    names = [
        s.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
        for s in rule["from"]
    ]
    assert rule["from"][0] == {"podSelector": {}} and names[1:] == ["apps", "monitoring"]


UCX_VARIABLES = {"UCX_TLS", "UCX_NET_DEVICES", "UCX_TCP_PORT_RANGE"}


def nixl_service(spec: MoEServiceSpec, **ucx: Any) -> MoEServiceSpec:
    return spec.model_copy(update={"transport": "nixl", "ucx": spec.ucx.model_copy(update=ucx)})


def pod_envs(moes_body: dict[str, Any], spec: MoEServiceSpec) -> tuple[dict[str, str], dict[str, str]]:
    """The environment of an expert-server pod and of an attention pod of MoEService `spec`."""
    experts = moeservice.expert_pool(moes_body, spec)
    attention = moeservice.attention_pool(moes_body, spec)
    experts["metadata"]["uid"] = attention["metadata"]["uid"] = "pool-uid"
    expert_pod = expertpool.pod(experts, ExpertPoolSpec.from_k8s(experts["spec"]), 0)
    deployment = attentionpool.deployment(attention, AttentionPoolSpec.from_k8s(attention["spec"]))
    (expert_container,) = expert_pod["spec"]["containers"]
    (attention_container,) = deployment["spec"]["template"]["spec"]["containers"]
    return env_of(expert_container), env_of(attention_container)


def test_nixl_pods_get_ucx_settings_from_the_spec(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec
) -> None:
    for env in pod_envs(moes_body, nixl_service(moes_spec)):
        assert env[naming.ENV_TRANSPORT] == "nixl"
        # The defaults: TCP on whatever devices the pod has, listening in the range the policies open.
        assert {k: v for k, v in env.items() if k.startswith("UCX_")} == {
            "UCX_TLS": "tcp",
            "UCX_TCP_PORT_RANGE": "20000-20099",
        }
    rdma = nixl_service(
        moes_spec, transports="rc_x,tcp", net_devices="mlx5_0:1", tcp_port_min=21000, tcp_port_max=21009
    )
    for env in pod_envs(moes_body, rdma):
        assert (env["UCX_TLS"], env["UCX_NET_DEVICES"], env["UCX_TCP_PORT_RANGE"]) == (
            "rc_x,tcp",
            "mlx5_0:1",
            "21000-21009",
        )


def test_other_transports_get_no_ucx_settings(moes_body: dict[str, Any], moes_spec: MoEServiceSpec) -> None:
    tcp = moes_spec.model_copy(update={"ucx": moes_spec.ucx.model_copy(update={"net_devices": "eth0"})})
    for env in pod_envs(moes_body, tcp):
        assert env[naming.ENV_TRANSPORT] == "tcp" and not UCX_VARIABLES & env.keys()


def test_ucx_settings_replace_expert_pods_only_under_nixl(pool_spec: ExpertPoolSpec) -> None:
    other_devices = pool_spec.ucx.model_copy(update={"net_devices": "eth1"})
    tcp = expertpool.template_hash(pool_spec)
    assert expertpool.template_hash(pool_spec.model_copy(update={"ucx": other_devices})) == tcp
    nixl = pool_spec.model_copy(update={"transport": "nixl"})
    assert expertpool.template_hash(nixl) != tcp
    assert expertpool.template_hash(nixl.model_copy(update={"ucx": other_devices})) != (
        expertpool.template_hash(nixl)
    )


def test_nixl_network_policies_open_the_ucx_ports_between_the_two_pools(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec
) -> None:
    spec = nixl_service(moes_spec, tcp_port_min=21000, tcp_port_max=21009)
    experts, attention = network_policies(moes_body, spec, "eaas-system")
    ucx_range = {"protocol": "TCP", "port": 21000, "endPort": 21009}
    service = {naming.SERVICE_LABEL: "tiny"}
    attention_pods = {"podSelector": {"matchLabels": {**service, naming.COMPONENT_LABEL: "attention-client"}}}
    expert_pods = {"podSelector": {"matchLabels": {**service, naming.COMPONENT_LABEL: "expert-server"}}}
    clients, operator, peers = experts["spec"]["ingress"]
    assert clients["from"] == [attention_pods] and ucx_range in clients["ports"]
    assert {p["port"] for p in clients["ports"]} == {9100, 9101, 21000}
    assert ucx_range not in operator["ports"] and ucx_range not in peers["ports"]
    # UCX may connect from the server's side too: attention pods take the range from expert pods.
    api, from_servers = attention["spec"]["ingress"]
    assert [p["port"] for p in api["ports"]] == [8000]
    assert from_servers == {"from": [expert_pods], "ports": [ucx_range]}

    experts, attention = network_policies(moes_body, moes_spec, "eaas-system")  # tcp: no range
    assert "endPort" not in str(experts) + str(attention) and len(attention["spec"]["ingress"]) == 1


@pytest.mark.parametrize(("replicas", "replication", "min_available"), [(3, 2, 2), (5, 3, 3), (4, 1, 3)])
def test_expert_disruption_budget_never_lets_a_drain_take_the_last_replica(
    pool_body: dict[str, Any], pool_spec: ExpertPoolSpec, replicas: int, replication: int, min_available: int
) -> None:
    """At most max(1, R-1) servers out by eviction at once: with R distinct hosts per expert, a
    drain can never take every replica; R = 1 still drains (the leaving server moves its experts)."""
    spec = pool_spec.model_copy(update={"replicas": replicas, "replication_factor": replication})
    budget = expertpool.disruption_budget(pool_body, spec)
    assert budget["apiVersion"] == "policy/v1" and budget["kind"] == "PodDisruptionBudget"
    assert budget["spec"]["minAvailable"] == min_available
    assert budget["spec"]["selector"]["matchLabels"] == expertpool.selector("tiny-experts")
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert budget["metadata"]["ownerReferences"][0]["uid"] == pool_body["metadata"]["uid"]


def test_pods_have_their_startup_timeout_before_liveness_probes_begin(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec, pool_body: dict[str, Any], pool_spec: ExpertPoolSpec
) -> None:
    """A process that loads a large checkpoint answers /healthz only once loaded: without a
    startup probe the liveness probe (6 x 5 s) would restart it in a loop."""
    pool = moeservice.attention_pool(moes_body, moes_spec)
    pool["metadata"]["uid"] = "attention-uid"
    attention = AttentionPoolSpec.from_k8s(pool["spec"])
    template = attentionpool.deployment(pool, attention)["spec"]["template"]
    for spec, container, port in (
        (pool_spec, expertpool.pod(pool_body, pool_spec, 0)["spec"]["containers"][0], "control"),
        (attention, template["spec"]["containers"][0], "http"),
    ):
        startup, readiness = container["startupProbe"], container["readinessProbe"]
        assert startup["httpGet"] == {"path": "/healthz", "port": port}
        assert startup["periodSeconds"] == readiness["periodSeconds"] == spec.heartbeat.interval_seconds == 2
        assert startup["periodSeconds"] * startup["failureThreshold"] == spec.startup_timeout_seconds == 1800
    slow = pool_spec.model_copy(update={"startup_timeout_seconds": 3601})
    startup = expertpool.pod(pool_body, slow, 0)["spec"]["containers"][0]["startupProbe"]
    assert startup["failureThreshold"] == 1801  # rounded up: never less than asked for
    assert expertpool.template_hash(slow) != expertpool.template_hash(pool_spec)
    with pytest.raises(ValueError, match=r"startup_?[tT]imeout_?[sS]econds"):
        ExpertPoolSpec.from_k8s({**pool_spec.to_k8s(), "startupTimeoutSeconds": 5})


def test_pods_get_their_grace_period_and_serve_through_most_of_it(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec, pool_body: dict[str, Any], pool_spec: ExpertPoolSpec
) -> None:
    spec = pool_spec.model_copy(update={"termination_grace_period_seconds": 120})
    expert = expertpool.pod(pool_body, spec, 0)
    assert expert["spec"]["terminationGracePeriodSeconds"] == 120
    assert env_of(expert["spec"]["containers"][0])[naming.ENV_DRAIN_TIMEOUT] == "115"
    assert expertpool.template_hash(spec) != expertpool.template_hash(pool_spec)
    pool = moeservice.attention_pool(moes_body, moes_spec)
    pool["metadata"]["uid"] = "attention-uid"
    attention = AttentionPoolSpec.from_k8s(pool["spec"])
    template = attentionpool.deployment(pool, attention)["spec"]["template"]
    assert template["spec"]["terminationGracePeriodSeconds"] == 30  # Kubernetes' default, said
    assert env_of(template["spec"]["containers"][0])[naming.ENV_DRAIN_TIMEOUT] == "25"
    budget = attentionpool.disruption_budget(pool, attention)
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == attentionpool.deployment(pool, attention)["spec"]["selector"]


def test_both_pools_give_torch_the_containers_cpu_request_in_threads(
    moes_body: dict[str, Any], moes_spec: MoEServiceSpec, pool_body: dict[str, Any], pool_spec: ExpertPoolSpec
) -> None:
    for spec in both_pod_specs(moes_body, moes_spec, pool_body, pool_spec):
        (container,) = spec["containers"]
        (threads,) = [item for item in container["env"] if item["name"] == naming.ENV_THREADS]
        # whole cores, rounded up by kubelet (500m -> 1; no request -> 0, torch's default)
        assert threads["valueFrom"] == {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}
