"""Models shared by the three kinds: the model identity, pod settings, heartbeats, conditions.

Numeric bounds of the model shape come from :class:`eaas.runtime.model.config.MoEConfig` (one type
per concept); the CRD repeats them so the API server enforces them on its own.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import Field, model_validator

from eaas.operator.api.base import CRDModel, Rule
from eaas.runtime.model.config import Family, MoEConfig
from eaas.runtime.model.presets import PRESETS, preset
from eaas.runtime.placement.cost import FAILOVER_FACTOR

# The runtime's transports (eaas.runtime.transport.registry, which needs torch; a test keeps the two
# lists equal), so the CRDs offer nothing the expert servers cannot do.
Transport = Literal["tcp", "shm", "cuda_ipc", "nixl"]
TRANSPORTS: tuple[Transport, ...] = ("tcp", "shm", "cuda_ipc", "nixl")
GPU_TRANSPORTS: tuple[Transport, ...] = ("cuda_ipc",)  # slots in GPU memory
PullPolicy = Literal["Always", "IfNotPresent", "Never"]

# Kubernetes name shapes (RFC 1123 label / subdomain) and resource quantities.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
RESOURCE_NAME = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
# A label's or taint's key (a qualified name: an optional DNS-subdomain prefix and '/', then at most 63
# characters) and a label's value (at most 63), as the core API checks them.
QUALIFIED_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]
Quantity = Annotated[int | str, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]
Port = Annotated[int, Field(ge=1, le=65535)]
# A model revision's name (the runtime's --model-revision accepts the same; a test keeps them equal).
REVISION = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"
# UCX's list syntax: names (``rc_x``, ``tcp``, ``cuda_copy``; ``ud:aux``), comma-separated, or a
# leading ``^`` to mean "all but these"; devices are ``name`` or ``name:port`` (``mlx5_0:1``).
UCX_TRANSPORTS = r"^\^?[a-z][a-z0-9_]*(:aux)?(,[a-z][a-z0-9_]*(:aux)?)*$"
UCX_DEVICES = r"^(\^?[A-Za-z0-9][-A-Za-z0-9_.]*(:[0-9]+)?(,[A-Za-z0-9][-A-Za-z0-9_.]*(:[0-9]+)?)*)?$"


def _moe_bounds(name: str) -> tuple[int, int]:
    """The (``ge``, ``le``) bounds MoEConfig puts on field `name`."""
    low = high = None
    for item in MoEConfig.model_fields[name].metadata:
        if isinstance(item, Ge):
            low = int(item.ge)  # type: ignore[call-overload]
        elif isinstance(item, Le):
            high = int(item.le)  # type: ignore[call-overload]
    assert low is not None and high is not None, f"MoEConfig.{name} has no ge/le bounds"
    return low, high


LAYERS_MIN, LAYERS_MAX = _moe_bounds("num_layers")
EXPERTS_MIN, EXPERTS_MAX = _moe_bounds("num_experts")
TOPK_MIN, TOPK_MAX = _moe_bounds("top_k")


class PersistentVolumeClaimSource(CRDModel):
    """A PersistentVolumeClaim in the object's namespace that holds the checkpoint."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    """Name of the PersistentVolumeClaim."""
    read_only: bool = True
    """Mount the claim read-only (servers only read weights)."""


class HostPathSource(CRDModel):
    """A directory on every node that may run a pool's pods (pre-staged weights)."""

    path: str = Field(min_length=1, max_length=4096, pattern=r"^/")
    """Absolute path on the node."""


class CheckpointSpec(CRDModel):
    """Where the model's safetensors checkpoint (with its ``config.json``) lives; exactly one source."""

    rules = (
        Rule(
            "has(self.persistentVolumeClaim) != has(self.hostPath)",
            "set exactly one of persistentVolumeClaim or hostPath",
            check=lambda c: (c.persistent_volume_claim is None) != (c.host_path is None),
        ),
        Rule(
            "!self.subPath.matches('(^|/)[.][.](/|$)')",
            "subPath must not contain '..' segments",
            field_path=".subPath",
            check=lambda c: ".." not in c.sub_path.split("/"),
        ),
    )

    persistent_volume_claim: PersistentVolumeClaimSource | None = None
    """The checkpoint is on this PersistentVolumeClaim."""
    host_path: HostPathSource | None = None
    """The checkpoint is in this directory on the node."""
    sub_path: str = Field(default="", max_length=1024, pattern=r"^([^/].*)?$")
    """Directory of the checkpoint inside the volume (relative; empty = the volume's root)."""


class ModelSpec(CRDModel):
    """The served model: family, shape and checkpoint. Its identity is immutable."""

    rules = (
        Rule(
            "self.topK <= self.numExperts",
            "topK must be <= numExperts (each token picks topK distinct experts)",
            field_path=".topK",
            check=lambda m: m.top_k <= m.num_experts,
        ),
        Rule(
            "self.numDenseLayers < self.numLayers",
            "numDenseLayers must be < numLayers (at least one layer must be MoE)",
            field_path=".numDenseLayers",
            check=lambda m: m.num_dense_layers < m.num_layers,
        ),
        Rule(
            "self.family == oldSelf.family && self.preset == oldSelf.preset"
            " && self.numLayers == oldSelf.numLayers && self.numDenseLayers == oldSelf.numDenseLayers"
            " && self.numExperts == oldSelf.numExperts && self.topK == oldSelf.topK",
            "model identity (family, preset, numLayers, numDenseLayers, numExperts, topK) is immutable;"
            " create a new MoEService to serve another model",
            reason="FieldValueForbidden",
        ),
    )

    family: Family
    """Model family (the Hugging Face ``model_type``)."""
    preset: str = Field(default="", max_length=63, pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$")
    """Named shape from ``eaas model presets`` (e.g. ``tiny``, ``deepseek-v3``); empty for a custom shape.
    When set, the operator checks that the shape fields below match it."""
    num_layers: int = Field(ge=LAYERS_MIN, le=LAYERS_MAX)
    """Decoder layers in total (dense and MoE)."""
    num_dense_layers: int = Field(default=0, ge=0, le=1024)
    """Leading layers with a dense FFN instead of experts; MoE layers are [numDenseLayers, numLayers)."""
    num_experts: int = Field(ge=EXPERTS_MIN, le=EXPERTS_MAX)
    """Routed experts per MoE layer."""
    top_k: int = Field(ge=TOPK_MIN, le=TOPK_MAX)
    """Experts each token is routed to."""
    checkpoint: CheckpointSpec
    """Where the weights are."""
    revision: str = Field(default="", max_length=63, pattern=REVISION)
    """A name for the checkpoint's revision (a date, a commit). On a MoEService, a change of it or
    of ``checkpoint`` is a new model revision, rolled out blue/green: a second pair of pools comes up
    beside the serving one, traffic moves when the new pair is Ready, and the old pair drains and
    goes. Empty: the revision is a hash of ``checkpoint``. The same name with another ``checkpoint``
    says the weights are the same: the pools are updated in place (one server at a time)."""

    @property
    def moe_layers(self) -> list[int]:
        """Ids of the MoE layers, in order."""
        return list(range(self.num_dense_layers, self.num_layers))

    @property
    def revision_id(self) -> str:
        """The revision pods are told and answers name: ``revision``, else ``ckpt-`` and 10 hex
        digits of the checkpoint's location."""
        if self.revision:
            return self.revision
        where = json.dumps(self.checkpoint.to_k8s(), sort_keys=True).encode()
        return f"ckpt-{hashlib.sha256(where).hexdigest()[:10]}"

    @model_validator(mode="after")
    def _match_preset(self) -> ModelSpec:
        """A named preset must agree with the shape fields (errors name the field and both values)."""
        if not self.preset:
            return self
        if self.preset not in PRESETS.get(self.family, {}):
            known = ", ".join(PRESETS.get(self.family, {}))
            raise ValueError(f"preset: {self.family} has no preset {self.preset!r} (known: {known})")
        config = preset(self.family, self.preset)
        expected = {
            "num_layers": config.num_layers,
            "num_dense_layers": config.num_dense_layers,
            "num_experts": config.num_experts,
            "top_k": config.top_k,
        }
        for field, value in expected.items():
            if getattr(self, field) != value:
                alias = type(self).model_fields[field].alias
                raise ValueError(
                    f"{alias}: preset {self.preset} ({self.family}) has {value}, got {getattr(self, field)}"
                )
        return self


class Toleration(CRDModel):
    """A pod toleration (as in the core Pod API), e.g. for tainted GPU nodes."""

    # The core Pod API's own checks: a toleration it refuses would fail every pod of the pool.
    rules = (
        Rule(
            "self.key != '' || self.operator == 'Exists'",
            "operator must be Exists when key is empty (a toleration of every taint)",
            field_path=".operator",
            check=lambda t: t.key != "" or t.operator == "Exists",
        ),
        Rule(
            "self.operator != 'Exists' || self.value == ''",
            "value must be empty when operator is Exists",
            field_path=".value",
            check=lambda t: t.operator != "Exists" or t.value == "",
        ),
        Rule(
            "!has(self.tolerationSeconds) || self.effect == 'NoExecute'",
            "tolerationSeconds needs effect NoExecute",
            field_path=".tolerationSeconds",
            check=lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
        ),
    )

    key: str = Field(default="", max_length=316, pattern=f"^({QUALIFIED_NAME[1:-1]})?$")
    """Taint key (a qualified name, as a label's); empty with operator Exists tolerates everything."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """How key and value are compared."""
    value: str = Field(default="", max_length=63, pattern=LABEL_VALUE)
    """Taint value (operator Equal)."""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""
    """Taint effect to tolerate; empty = all effects."""
    toleration_seconds: int | None = Field(default=None, ge=0)
    """For NoExecute: how long the pod stays bound after the taint appears."""


class ResourceRequirements(CRDModel):
    """Compute resources of one pod's container (GPUs are set by gpusPerPod, not here)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    """Minimum resources, e.g. ``cpu: 500m``, ``memory: 2Gi``."""
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    """Maximum resources."""


class PodSettings(CRDModel):
    """What every pool's pods share: image, resources, scheduling."""

    image: str = Field(min_length=1, max_length=1024)
    """Container image with the ``eaas`` command."""
    image_pull_policy: PullPolicy = "IfNotPresent"
    """When the kubelet pulls the image."""
    gpu_resource_name: str = Field(default="nvidia.com/gpu", max_length=253, pattern=RESOURCE_NAME)
    """Extended resource that counts GPUs on the nodes."""
    resources: ResourceRequirements = ResourceRequirements()
    """CPU/memory requests and limits of the container. The CPU request, rounded up to whole cores,
    is the number of torch threads the pod computes with; without one, torch takes one per core of
    the node."""
    service_account_name: str = Field(
        default="", max_length=253, pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$"
    )
    """ServiceAccount of the pods (it must be allowed to renew Leases for heartbeats); empty = the one
    the operator makes, ``<moeservice>-runtime``, bound to the chart's runtime ClusterRole."""
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, max_length=32)
    """Node labels the pods require (keys qualified names, values label values, as the core API
    checks them)."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Taints the pods tolerate."""
    termination_grace_period_seconds: int = Field(default=30, ge=10, le=3600)
    """How long a pod that is deleted, evicted or drained may take to leave. An expert server
    serves on until its experts are re-homed and its clients moved (it exits sooner when done); an
    attention client finishes its in-flight requests. Both keep 5 s of it for their exit."""
    startup_timeout_seconds: int = Field(default=1800, ge=30, le=86400)
    """How long a pod's process may take to start serving: loading its weights (an expert server
    also runs each of its experts once), before its liveness and readiness probes begin (a
    ``startupProbe`` on ``/healthz``). A container that does not answer within it is restarted.
    Size it for the slowest load of the checkpoint from its volume."""

    @model_validator(mode="after")
    def _node_selector_keys(self) -> PodSettings:
        """The core API's check of a label key, which the CRD cannot make on a map's keys (a CEL rule
        over unbounded keys exceeds the API server's cost budget): the operator refuses the spec."""
        for key in self.node_selector:
            if len(key) > 316 or not re.fullmatch(QUALIFIED_NAME, key):
                raise ValueError(
                    f"nodeSelector: key {key!r} is not a label key (an optional DNS-subdomain prefix "
                    "and '/', then at most 63 letters, digits, '-', '_' or '.', beginning and ending "
                    "with a letter or digit)"
                )
        return self


class HeartbeatSpec(CRDModel):
    """Liveness of servers and clients through ``coordination.k8s.io/v1`` Leases."""

    rules = (
        Rule(
            "self.timeoutSeconds > self.intervalSeconds",
            "timeoutSeconds must be greater than intervalSeconds (a Lease must survive one missed renewal)",
            field_path=".timeoutSeconds",
            check=lambda h: h.timeout_seconds > h.interval_seconds,
        ),
    )

    interval_seconds: int = Field(default=2, ge=1, le=300)
    """How often each pod renews its Lease."""
    timeout_seconds: int = Field(default=10, ge=2, le=3600)
    """A Lease not renewed for this long marks its pod dead."""


class UCXSpec(CRDModel):
    """UCX settings of transport ``nixl``, given to every pod as ``UCX_*`` environment variables
    (other transports ignore them). The defaults work on a plain pod network; for RDMA NICs see
    docs/rdma.md."""

    rules = (
        Rule(
            "self.tcpPortMin <= self.tcpPortMax",
            "tcpPortMin must be <= tcpPortMax",
            field_path=".tcpPortMin",
            check=lambda u: u.tcp_port_min <= u.tcp_port_max,
        ),
    )

    transports: str = Field(default="tcp", min_length=1, max_length=256, pattern=UCX_TRANSPORTS)
    """``UCX_TLS``: the UCX transports, comma-separated. ``tcp`` works on any pod network; RDMA NICs:
    ``rc,tcp`` (InfiniBand or RoCE verbs), ``rc_x,tcp`` or ``dc_x,tcp`` (ConnectX, mlx5). On a
    node with NVIDIA GPUs, a list naming neither ``cuda`` nor ``cuda_copy`` gets ``cuda_copy`` (NIXL
    refuses to start without one there)."""
    net_devices: str = Field(default="", max_length=256, pattern=UCX_DEVICES)
    """``UCX_NET_DEVICES``: the network devices UCX may use, comma-separated (``eth0``,
    ``mlx5_0:1``); empty = not set, UCX takes every device it finds."""
    tcp_port_min: Port = 20000
    """First port of ``UCX_TCP_PORT_RANGE``: UCX's TCP transport listens in
    [tcpPortMin, tcpPortMax] (one port per network device and process), which the NetworkPolicies
    open between this MoEService's expert and attention pods."""
    tcp_port_max: Port = 20099
    """Last port of ``UCX_TCP_PORT_RANGE``."""

    def contains(self, port: int) -> bool:
        """Whether `port` is in the TCP port range."""
        return self.tcp_port_min <= port <= self.tcp_port_max


MAX_EXPERT_MOVES_PER_REBALANCE = 2048
"""Default `PlacementSpec.max_expert_moves_per_rebalance`: about 7% of DeepSeek-V3's slots at
R = 2 (29,696), 3% of Kimi-K2's at R = 3 (69,120). On DeepSeek-V3 x 64 servers from round-robin
with the skewed trace of benchmarks/placement.py, 2048 loads bought about 85% of the predicted
gain that an unbounded rebalance (about 4,500 loads) found."""


class PlacementSpec(CRDModel):
    """How experts are placed on expert servers and re-balanced."""

    rules = (
        Rule(
            "self.failoverFactorPercent == 0 || self.failoverFactorPercent >= 100",
            "failoverFactorPercent must be 0 (off) or at least 100 (the healthy peak)",
            field_path=".failoverFactorPercent",
            check=lambda p: p.failover_factor_percent == 0 or p.failover_factor_percent >= 100,
        ),
    )

    policy: Literal["cost_aware", "eplb"] = "cost_aware"
    """``cost_aware``: few expert moves, skips a rebalance whose cost exceeds its gain;
    ``eplb``: DeepSeek EPLB-style replicate-and-pack."""
    rebalance_interval_seconds: int = Field(default=300, ge=0, le=86400)
    """How often the operator scrapes the servers' per-expert load and re-plans; 0 = only on scaling
    (docs/scaling.md, "Load-based rebalancing")."""
    max_expert_moves_per_rebalance: int = Field(default=MAX_EXPERT_MOVES_PER_REBALANCE, ge=1, le=1048576)
    """The most expert loads one load-based rebalance may plan: (layer, expert, server) slots a
    server hosts in the new placement and not in the committed one. When more would pay, the
    rebalance takes the moves with the best predicted gain per load; the next interval may take
    more (docs/placement.md, "The move budget")."""
    failover_factor_percent: int = Field(default=round(100 * FAILOVER_FACTOR), ge=0, le=1000)
    """``cost_aware`` with ``replicationFactor`` >= 2: how far above a layer's mean load its busiest
    server may go after any one server fails, in percent (130 = 1.3x), counted in the rebalance's
    objective so that replicas are placed (and hot experts given more) for the failure the pool
    must absorb; 0 = plan for the healthy pool only (docs/placement.md, "Planning for the failure
    it must absorb")."""


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(CRDModel):
    """One observation in ``status.conditions`` (the shape of ``metav1.Condition``)."""

    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    """``Ready``, ``Progressing`` or ``Degraded``."""
    status: ConditionStatus
    """Whether the condition holds."""
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    """One CamelCase word for machines."""
    message: str = Field(default="", max_length=32768)
    """What happened, for humans."""
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    """When status last changed (RFC 3339)."""
    observed_generation: int = Field(default=0, ge=0)
    """``metadata.generation`` this condition was computed from."""


def conditions_field() -> Any:
    """``status.conditions``: a list-map keyed by type."""
    return Field(
        default_factory=list,
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
