"""The API models: what they accept, what they reject and how the rejection reads."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from eaas.operator.api import TRANSPORTS, ExpertPoolSpec, MoEServiceSpec
from eaas.operator.api.common import (
    EXPERTS_MAX,
    GPU_TRANSPORTS,
    LAYERS_MAX,
    TOPK_MAX,
    UCX_DEVICES,
    UCX_TRANSPORTS,
)
from eaas.operator.reconcile.context import describe_validation_error
from eaas.runtime.model.config import MoEConfig
from eaas.runtime.transport.registry import get_transport, transport_names

ROOT = Path(__file__).resolve().parents[2]


def tiny_manifest() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "manifests" / "moeservice-tiny-cpu.yaml").read_text())


def spec_with(**changes: Any) -> dict[str, Any]:
    """The tiny manifest's spec with dotted-path changes, e.g. ``{"model.topK": 9}``."""
    spec = copy.deepcopy(tiny_manifest()["spec"])
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = spec
        for parent in parents:
            node = node.setdefault(parent, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return spec


def rejection(spec: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        MoEServiceSpec.from_k8s(spec)
    return describe_validation_error(caught.value)


@pytest.mark.parametrize(
    "name", ["moeservice-tiny-cpu.yaml", "moeservice-deepseek-v3-gpu.yaml", "moeservice-nixl.yaml"]
)
def test_example_manifests_are_valid(name: str) -> None:
    document = yaml.safe_load((ROOT / "manifests" / name).read_text())
    assert document["apiVersion"] == "eaas.io/v1alpha1" and document["kind"] == "MoEService"
    spec = MoEServiceSpec.from_k8s(document["spec"])
    assert spec.expert_pool.replication_factor <= spec.expert_pool.replicas


def test_tiny_manifest_is_a_cpu_tcp_service(moes_spec: MoEServiceSpec) -> None:
    assert moes_spec.transport == "tcp"
    assert moes_spec.expert_pool.gpus_per_pod == 0 and moes_spec.attention_pool.gpus_per_pod == 0


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"model.topK": 9}, "spec.model.topK: topK must be <= numExperts"),
        ({"model.numDenseLayers": 3}, "spec.model.numDenseLayers: numDenseLayers must be < numLayers"),
        (
            {"expertPool.replicationFactor": 4},
            "spec.expertPool.replicationFactor: replicationFactor must be <= replicas",
        ),
        (
            {"autoscaling.minReplicas": 5, "autoscaling.maxReplicas": 4},
            "spec.autoscaling.minReplicas: minReplicas must be <= maxReplicas",
        ),
        (
            {"transport": "rdma"},
            "spec.transport: Input should be 'tcp', 'shm', 'cuda_ipc' or 'nixl'",
        ),
        # Not offered until the runtime has it (it once was, and a pool reported Ready without it).
        ({"transport": "nvshmem"}, "spec.transport: Input should be 'tcp', 'shm', 'cuda_ipc' or 'nixl'"),
        ({"transport": "cuda_ipc"}, "transport cuda_ipc needs expertPool.gpusPerPod = 1"),
        ({"attentionPool.microBatches": 4}, "spec.attentionPool.microBatches: microBatches must be 0 (auto"),
        ({"heartbeat.intervalSeconds": 10}, "timeoutSeconds must be greater than intervalSeconds"),
        (
            {"model.checkpoint.persistentVolumeClaim": {"claimName": "w"}},
            "spec.model.checkpoint: set exactly one of persistentVolumeClaim",
        ),
        ({"model.checkpoint.hostPath": None}, "set exactly one of persistentVolumeClaim"),
        ({"model.checkpoint.subPath": "a/../b"}, "subPath must not contain '..' segments"),
        ({"model.preset": "deepseek-v3"}, "spec.model.preset: mixtral has no preset 'deepseek-v3'"),
        ({"model.numExperts": 16}, "spec.model.numExperts: preset tiny (mixtral) has 8, got 16"),
        ({"expertPool.expertSlotsPerServer": 10}, "replicas * expertSlotsPerServer must be >="),
        ({"expertPool.gpusPerPod": 2}, "spec.expertPool.gpusPerPod: Input should be less than or equal to 1"),
        (
            {"autoscaling.mode": "builtin", "autoscaling.minReplicas": 1},
            "minReplicas must be >= expertPool.replicationFactor",
        ),
        ({"autoscaling.mode": "builtin", "autoscaling.maxReplicas": 2}, "expertPool.replicas must be within"),
        (
            {"autoscaling.metric": "expertWait"},
            "spec.autoscaling.targetExpertWaitMillis: metric expertWait needs targetExpertWaitMillis",
        ),
        (
            {"autoscaling.sloTimePerOutputTokenMillis": 0},
            "spec.autoscaling.sloTimePerOutputTokenMillis",
        ),
        (
            {"autoscaling.metric": "tokens"},
            "spec.autoscaling.metric: Input should be 'busy', 'expertWait' or 'tokenRate'",
        ),
        ({"expertPool.image": ""}, "spec.expertPool.image: String should have at least 1 character"),
        ({"expertPool.kernelBackend": "cuda"}, "spec.expertPool.kernelBackend: String should match pattern"),
        ({"expertPool.kernelBackend": "simulated:1"}, "spec.expertPool.kernelBackend: String should match"),
        ({"expertPool.kernelBackend": "triton"}, "spec.expertPool.kernelBackend: kernelBackend triton needs"),
        ({"ucx.transports": "tcp;rc"}, "spec.ucx.transports: String should match pattern"),
        ({"ucx.transports": "rc x"}, "spec.ucx.transports: String should match pattern"),
        ({"ucx.transports": ""}, "spec.ucx.transports: String should have at least 1 character"),
        ({"ucx.netDevices": "mlx5_0:one"}, "spec.ucx.netDevices: String should match pattern"),
        ({"ucx.netDevices": "eth0 eth1"}, "spec.ucx.netDevices: String should match pattern"),
        ({"ucx.tcpPortMax": 70000}, "spec.ucx.tcpPortMax: Input should be less than or equal to 65535"),
        ({"ucx.tcpPortMax": 20099.5}, "spec.ucx.tcpPortMax: Input should be a valid integer"),
        (
            {"placement.failoverFactorPercent": 50},
            "spec.placement.failoverFactorPercent: failoverFactorPercent must be 0 (off) or at least 100",
        ),
        (
            {"placement.failoverFactorPercent": 1001},
            "spec.placement.failoverFactorPercent: Input should be less than or equal to 1000",
        ),
        (
            {"ucx.tcpPortMin": 20100, "ucx.tcpPortMax": 20099},
            "spec.ucx.tcpPortMin: tcpPortMin must be <= tcpPortMax",
        ),
        (
            {"transport": "nixl", "ucx.tcpPortMin": 9000, "ucx.tcpPortMax": 9100},
            "spec.ucx: with transport nixl, [ucx.tcpPortMin, ucx.tcpPortMax] must not contain the pods'",
        ),
        (
            {"transport": "nixl", "ucx.tcpPortMin": 8000, "ucx.tcpPortMax": 8000},
            "must not contain the pods' ports (expertPool.port, expertPool.dataPort, attentionPool.port)",
        ),
        # Tolerations the core Pod API would refuse on every pod of the pool:
        ({"expertPool.tolerations": [{"effect": "NoSchedule"}]}, "operator must be Exists when key is empty"),
        (
            {"attentionPool.tolerations": [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 300}]},
            "tolerationSeconds needs effect NoExecute",
        ),
        (
            {"expertPool.tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]},
            "value must be empty when operator is Exists",
        ),
        (
            {"expertPool.tolerations": [{"key": "gpu node", "operator": "Exists"}]},
            "spec.expertPool.tolerations.0.key: String should match pattern",
        ),
        (
            {"expertPool.tolerations": [{"key": "gpu", "value": "a100 80gb"}]},
            "spec.expertPool.tolerations.0.value: String should match pattern",
        ),
        (
            {"attentionPool.nodeSelector": {"pool": "cpu only"}},
            "spec.attentionPool.nodeSelector.pool: String should match pattern",
        ),
        (
            {"expertPool.nodeSelector": {"gpu type": "h200"}},
            "spec.expertPool.nodeSelector: key 'gpu type' is not a label key",
        ),
        # 4 x 12 slots hold R = 2 of 3 x 8 experts; 2 x 12, where the autoscaler could go, do not.
        (
            {
                "expertPool.replicas": 4,
                "expertPool.expertSlotsPerServer": 12,
                "autoscaling": {"mode": "builtin", "minReplicas": 2, "maxReplicas": 8},
            },
            "spec.autoscaling.minReplicas: autoscaling.minReplicas * expertPool.expertSlotsPerServer must",
        ),
    ],
)
def test_invalid_specs_are_rejected_naming_the_field(changes: dict[str, Any], expected: str) -> None:
    assert expected in rejection(spec_with(**changes))


@pytest.mark.parametrize(
    ("transports", "devices"),
    [
        ("tcp", ""),
        ("rc,tcp", "mlx5_0:1"),
        ("rc_x,tcp", "mlx5_0:1,mlx5_1:1"),
        ("^cma", "eth0"),
        ("rc,ud:aux", ""),
    ],
)
def test_nixl_takes_ucx_transports_and_devices_in_ucx_syntax(transports: str, devices: str) -> None:
    spec = MoEServiceSpec.from_k8s(
        spec_with(**{"transport": "nixl", "ucx.transports": transports, "ucx.netDevices": devices})
    )
    assert (spec.transport, spec.ucx.transports, spec.ucx.net_devices) == ("nixl", transports, devices)


def test_ucx_defaults_work_on_a_plain_pod_network() -> None:
    spec = MoEServiceSpec.from_k8s(spec_with(transport="nixl"))
    assert spec.ucx.transports == "tcp" and spec.ucx.net_devices == ""
    # Clear of the pods' default ports and below Linux's ephemeral range (32768-60999), so
    # UCX's listeners never collide with the ports of outgoing connections.
    assert (spec.ucx.tcp_port_min, spec.ucx.tcp_port_max) == (20000, 20099)
    # Other transports ignore ucx: its ports may then overlap the pods' ones.
    assert MoEServiceSpec.from_k8s(spec_with(**{"ucx.tcpPortMin": 9000, "ucx.tcpPortMax": 9200}))


def test_crd_admits_nixl_and_checks_ucx_with_the_same_patterns() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "eaas.io_moeservices.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "nixl" in spec["properties"]["transport"]["enum"]
    ucx = spec["properties"]["ucx"]["properties"]
    assert ucx["transports"]["pattern"] == UCX_TRANSPORTS and ucx["netDevices"]["pattern"] == UCX_DEVICES
    assert ucx["tcpPortMin"]["type"] == "integer" == ucx["tcpPortMax"]["type"]
    rules = [rule["rule"] for rule in spec["x-kubernetes-validations"]]
    assert any("self.ucx.tcpPortMin" in rule for rule in rules)


def test_the_failover_bound_defaults_to_the_planners_and_may_be_turned_off() -> None:
    assert MoEServiceSpec.from_k8s(spec_with()).placement.failover_factor_percent == 130  # 1.3x
    for percent in (0, 100, 250):
        spec = MoEServiceSpec.from_k8s(spec_with(**{"placement.failoverFactorPercent": percent}))
        assert spec.placement.failover_factor_percent == percent
    for name in ("eaas.io_moeservices.yaml", "eaas.io_expertpools.yaml"):  # the API server checks it too
        crd = yaml.safe_load((ROOT / "crds" / name).read_text())
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        placement = spec["properties"]["placement"]
        assert placement["properties"]["failoverFactorPercent"]["default"] == 130
        assert any("failoverFactorPercent" in r["rule"] for r in placement["x-kubernetes-validations"])


def test_the_move_budget_has_a_default_and_a_range_the_api_server_checks() -> None:
    assert MoEServiceSpec.from_k8s(spec_with()).placement.max_expert_moves_per_rebalance == 2048
    spec = MoEServiceSpec.from_k8s(spec_with(**{"placement.maxExpertMovesPerRebalance": 100}))
    assert spec.placement.max_expert_moves_per_rebalance == 100
    with pytest.raises(ValidationError, match="maxExpertMovesPerRebalance"):
        MoEServiceSpec.from_k8s(spec_with(**{"placement.maxExpertMovesPerRebalance": 0}))
    for name in ("eaas.io_moeservices.yaml", "eaas.io_expertpools.yaml"):
        crd = yaml.safe_load((ROOT / "crds" / name).read_text())
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        budget = spec["properties"]["placement"]["properties"]["maxExpertMovesPerRebalance"]
        assert (budget["default"], budget["minimum"]) == (2048, 1)


def test_tolerations_the_pod_api_takes_are_accepted() -> None:
    tolerations = [
        {"operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "moe", "effect": "NoExecute", "tolerationSeconds": 60},
    ]
    assert MoEServiceSpec.from_k8s(spec_with(**{"expertPool.tolerations": tolerations}))


def test_the_builtin_autoscalers_floor_must_hold_every_expert_r_times() -> None:
    builtin = {"mode": "builtin", "minReplicas": 4, "maxReplicas": 8}
    assert MoEServiceSpec.from_k8s(
        spec_with(**{"expertPool.replicas": 4, "expertPool.expertSlotsPerServer": 12, "autoscaling": builtin})
    )


def test_capacity_rule_accepts_exactly_enough_slots() -> None:
    # tiny: 3 MoE layers x 8 experts x R=2 = 48 slots over 3 servers -> 16 each.
    assert MoEServiceSpec.from_k8s(spec_with(**{"expertPool.expertSlotsPerServer": 16}))
    assert "expertSlotsPerServer" in rejection(spec_with(**{"expertPool.expertSlotsPerServer": 15}))


def test_expert_pool_spec_checks_capacity_too(pool_spec: ExpertPoolSpec) -> None:
    data = pool_spec.to_k8s() | {"expertSlotsPerServer": 15}
    with pytest.raises(ValidationError, match="expertSlotsPerServer"):
        ExpertPoolSpec.from_k8s(data)


def test_crd_transports_are_the_runtime_registry() -> None:
    """The CRDs offer every transport the runtime has and nothing it lacks (a transport offered
    without a runtime once made a pool report Ready that could never serve)."""
    assert sorted(TRANSPORTS) == transport_names()
    assert set(GPU_TRANSPORTS) == {name for name in transport_names() if get_transport(name).needs_gpu}


def test_model_bounds_come_from_moeconfig() -> None:
    def bound(field: str, kind: str) -> int:
        return next(int(getattr(m, kind)) for m in MoEConfig.model_fields[field].metadata if hasattr(m, kind))

    assert (
        bound("num_layers", "le"),
        bound("num_experts", "le"),
        bound("top_k", "le"),
    ) == (LAYERS_MAX, EXPERTS_MAX, TOPK_MAX)


def test_round_trip_is_lossless(moes_spec: MoEServiceSpec) -> None:
    assert MoEServiceSpec.from_k8s(moes_spec.to_k8s()) == moes_spec
    assert moes_spec.model.moe_layers == [0, 1, 2]


def test_autoscaler_manifests_target_the_tiny_expert_pool_on_a_real_metric() -> None:
    from eaas.operator import naming
    from eaas.runtime.server.metrics import ServerMetrics

    histograms = {m.name for m in ServerMetrics().registry.collect() if m.type == "histogram"}
    assert "eaas_expert_server_step_seconds" in histograms  # its _sum is the busy time
    tiny = MoEServiceSpec.from_k8s(tiny_manifest()["spec"])
    hpa, adapter = yaml.safe_load_all((ROOT / "manifests" / "expertpool-hpa.yaml").read_text())
    (keda,) = yaml.safe_load_all((ROOT / "manifests" / "expertpool-keda.yaml").read_text())
    for target in (hpa["spec"]["scaleTargetRef"], keda["spec"]["scaleTargetRef"]):
        assert target == {
            "apiVersion": "eaas.io/v1alpha1",
            "kind": "ExpertPool",
            "name": naming.expert_pool_name("tiny"),
        }
    assert hpa["spec"]["minReplicas"] >= tiny.expert_pool.replication_factor
    assert keda["spec"]["minReplicaCount"] >= tiny.expert_pool.replication_factor
    assert tiny.autoscaling.mode == "external"  # the HPA/KEDA is then the one writer of replicas
    rule, tokens = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    assert "eaas_expert_server_step_seconds_sum" in rule["seriesQuery"]
    assert rule["name"]["as"] == hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    counters = {m.name for m in ServerMetrics().registry.collect() if m.type == "counter"}
    assert "eaas_expert_server_expert_tokens" in counters  # its rate: metric tokenRate's quantity
    assert "eaas_expert_server_expert_tokens_total" in tokens["seriesQuery"]
    assert tokens["name"]["as"] == "eaas_expert_server_tokens_per_second"
    assert "eaas_expert_server_step_seconds_sum" in keda["spec"]["triggers"][0]["metadata"]["query"]
    # Both aim at the built-in autoscaler's default busy fraction.
    target = hpa["spec"]["metrics"][0]["pods"]["target"]
    assert target == {"type": "AverageValue", "averageValue": f"{tiny.autoscaling.target_utilization_milli}m"}
    assert float(keda["spec"]["triggers"][0]["metadata"]["threshold"]) * 1000 == (
        tiny.autoscaling.target_utilization_milli
    )
