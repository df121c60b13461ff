"""MoEService: a served MoE model, split into an AttentionPool and an ExpertPool."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from eaas.operator.api.base import CRDModel, Rule
from eaas.operator.api.common import (
    DNS_LABEL,
    GPU_TRANSPORTS,
    Condition,
    HeartbeatSpec,
    ModelSpec,
    PlacementSpec,
    Transport,
    UCXSpec,
    conditions_field,
)
from eaas.operator.api.pools import (
    AttentionPoolTemplate,
    ExpertPoolTemplate,
    capacity_rule,
    holds_every_expert,
)
from eaas.operator.naming import Slot

AutoscalingMode = Literal["off", "builtin", "external"]
AutoscalingMetric = Literal["busy", "expertWait", "tokenRate"]


class NetworkPolicySpec(CRDModel):
    """Who may reach the pods (``networking.k8s.io/v1`` NetworkPolicies, enforced by the cluster's
    network plugin)."""

    enabled: bool = True
    """Create the two NetworkPolicies (expert servers, attention clients); false removes them."""
    monitoring_namespaces: list[Annotated[str, Field(max_length=63, pattern=DNS_LABEL)]] = Field(
        default_factory=list, max_length=32
    )
    """Namespaces whose pods may scrape ``/metrics`` (the expert servers' control port, the API port)."""
    api_from_namespaces: list[Annotated[str, Field(max_length=63, pattern=DNS_LABEL)]] = Field(
        default_factory=list, max_length=32
    )
    """Namespaces (besides this one) whose pods may call the OpenAI-compatible API; empty = anywhere."""


class AutoscalingSpec(CRDModel):
    """Who changes the number of expert servers (exactly one writer of ``ExpertPool.spec.replicas``)."""

    rules = (
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "minReplicas must be <= maxReplicas",
            field_path=".minReplicas",
            check=lambda a: a.min_replicas <= a.max_replicas,
        ),
        Rule(
            "self.metric != 'expertWait' || has(self.targetExpertWaitMillis)",
            "metric expertWait needs targetExpertWaitMillis",
            field_path=".targetExpertWaitMillis",
            check=lambda a: a.metric != "expertWait" or a.target_expert_wait_millis is not None,
        ),
    )

    mode: AutoscalingMode = "off"
    """``off``: replicas follow ``spec.expertPool.replicas`` of this MoEService.
    ``builtin``: the operator scales on ``metric``, within [minReplicas, maxReplicas].
    ``external``: an HPA, KEDA or ``kubectl scale`` owns the ExpertPool's ``/scale``; the MoEService
    sets replicas only when it creates the pool."""
    min_replicas: int = Field(default=2, ge=1, le=4096)
    """Fewest expert servers (builtin mode)."""
    max_replicas: int = Field(default=16, ge=1, le=4096)
    """Most expert servers (builtin mode)."""
    metric: AutoscalingMetric = "tokenRate"
    """What the builtin autoscaler holds at its target. ``tokenRate`` (the default): the expert
    servers' mean routed (token, expert) entries per second (their Leases): the load itself,
    falling as 1 / servers when one is added whatever a batch's fixed costs. Its target is 0.9 x
    what one server carries at the SLO (``sloTimePerOutputTokenMillis``), learned from the pool's
    own readings (the servers' token rate against the attention clients' p99 time per output
    token), or ``targetTokensPerSecond`` when given. ``busy``: the expert servers' mean busy
    fraction (their Leases; the same metric the chart's adapter rule serves an HPA); it is not
    monotone in the load where a batch's fixed costs dominate (docs/scaling.md).
    ``expertWait``: the attention clients' mean time per decoder step spent on the expert
    servers (their Leases), for a target derived from a time-per-token objective; experimental:
    it falls as servers are added only where the servers' compute dominates it. HPA and KEDA (mode
    external) scale on what they are given."""
    slo_time_per_output_token_millis: int = Field(default=100, ge=1, le=60000)
    """With ``metric: tokenRate`` and no ``targetTokensPerSecond``: the SLO, p99 time per output
    token in milliseconds, at which the operator learns what one server carries."""
    target_utilization_milli: int = Field(default=700, ge=1, le=1000)
    """With ``metric: busy``: mean busy fraction to aim for, in thousandths (700 = 70%)."""
    target_expert_wait_millis: int | None = Field(default=None, ge=1, le=60000)
    """With ``metric: expertWait``: the expert time per decoder step to aim for, in milliseconds
    (for example 0.85 x what a step may spend on the experts while meeting the time per token)."""
    target_tokens_per_second: int | None = Field(default=None, ge=1, le=100_000_000)
    """With ``metric: tokenRate``: routed (token, expert) entries per second per expert server to
    aim for, set by hand (for example 0.9 x what a server carried in a load test that met the time
    per token); without it the operator learns the target from ``sloTimePerOutputTokenMillis``."""
    scale_up_stabilization_seconds: int = Field(default=0, ge=0, le=3600)
    """Builtin: scale up to the lowest recommendation of this window (0 = at once)."""
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=3600)
    """Builtin: scale down to the highest recommendation of this window."""


def _ucx_ports_free(spec: MoEServiceSpec) -> bool:
    ports = (spec.expert_pool.port, spec.expert_pool.data_port, spec.attention_pool.port)
    return spec.transport != "nixl" or not any(spec.ucx.contains(port) for port in ports)


def _replicas_in_range(spec: MoEServiceSpec) -> bool:
    scaling = spec.autoscaling
    return (
        scaling.mode != "builtin" or scaling.min_replicas <= spec.expert_pool.replicas <= scaling.max_replicas
    )


class MoEServiceSpec(CRDModel):
    """Desired state of a served model."""

    rules = (
        Rule(
            "self.transport != 'cuda_ipc' || self.expertPool.gpusPerPod == 1",
            "transport cuda_ipc needs expertPool.gpusPerPod = 1 (its slots are in one GPU's memory)",
            field_path=".transport",
            check=lambda s: s.transport not in GPU_TRANSPORTS or s.expert_pool.gpus_per_pod == 1,
        ),
        Rule(
            "self.autoscaling.mode != 'builtin'"
            " || self.autoscaling.minReplicas >= self.expertPool.replicationFactor",
            "autoscaling.minReplicas must be >= expertPool.replicationFactor",
            field_path=".autoscaling.minReplicas",
            check=lambda s: (
                s.autoscaling.mode != "builtin"
                or s.autoscaling.min_replicas >= s.expert_pool.replication_factor
            ),
        ),
        Rule(
            "self.autoscaling.mode != 'builtin' || (self.expertPool.replicas >= self.autoscaling.minReplicas"
            " && self.expertPool.replicas <= self.autoscaling.maxReplicas)",
            "expertPool.replicas must be within [autoscaling.minReplicas, autoscaling.maxReplicas]",
            field_path=".expertPool.replicas",
            check=_replicas_in_range,
        ),
        Rule(
            "self.transport != 'nixl' || [self.expertPool.port, self.expertPool.dataPort,"
            " self.attentionPool.port].all(p, p < self.ucx.tcpPortMin || p > self.ucx.tcpPortMax)",
            "with transport nixl, [ucx.tcpPortMin, ucx.tcpPortMax] must not contain the pods' ports"
            " (expertPool.port, expertPool.dataPort, attentionPool.port)",
            field_path=".ucx",
            check=_ucx_ports_free,
        ),
        capacity_rule(".expertPool"),
        Rule(
            "self.autoscaling.mode != 'builtin' || self.expertPool.expertSlotsPerServer == 0"
            " || self.expertPool.expertSlotsPerServer * self.autoscaling.minReplicas >="
            " self.expertPool.replicationFactor * (self.model.numLayers - self.model.numDenseLayers)"
            " * self.model.numExperts",
            "autoscaling.minReplicas * expertPool.expertSlotsPerServer must be >= replicationFactor * MoE "
            "layers * numExperts (the autoscaler must not shrink the pool below R copies of every expert)",
            field_path=".autoscaling.minReplicas",
            check=lambda s: (
                s.autoscaling.mode != "builtin"
                or holds_every_expert(s.expert_pool, s.model, s.autoscaling.min_replicas)
            ),
        ),
    )

    model: ModelSpec
    """The model and where its checkpoint is."""
    attention_pool: AttentionPoolTemplate
    """The attention clients (OpenAI-compatible front)."""
    expert_pool: ExpertPoolTemplate
    """The expert servers."""
    transport: Transport = "tcp"
    """How attention clients reach expert servers: ``tcp`` (CPU or GPU pods, across nodes), ``shm``
    (CPU, one node), ``cuda_ipc`` (GPU, one node), ``nixl`` (NIXL one-sided writes over UCX into
    host memory: CPU or GPU pods, across nodes, RDMA where the NICs have it; set up by ``ucx``).
    GPU-initiated transfers across nodes (NVSHMEM) are planned, not offered."""
    ucx: UCXSpec = UCXSpec()
    """UCX transports, devices and TCP ports of transport ``nixl`` (ignored by the others)."""
    heartbeat: HeartbeatSpec = HeartbeatSpec()
    """Lease heartbeats of every pod."""
    placement: PlacementSpec = PlacementSpec()
    """Expert placement policy."""
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    """Scaling of the expert pool."""
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    """Expert servers accept their ports only from this MoEService's attention pods, the operator and
    monitoring; attention pods accept the API from anywhere or the namespaces listed."""


class PoolSummary(CRDModel):
    """Replica counts of one pool, as its status reports them."""

    replicas: int = Field(default=0, ge=0)
    """Pods that exist."""
    ready_replicas: int = Field(default=0, ge=0)
    """Pods that are Ready."""


class CapacityBand(CRDModel):
    """One 5%-wide band of the token rate in the built-in autoscaler's readings."""

    tokens_per_second: float = Field(ge=0)
    """Median routed tokens per second per server of the band's readings."""
    time_per_output_token_micros: int = Field(ge=0)
    """Median of the attention clients' p99 time per output token at those readings."""
    readings: int = Field(ge=1, le=15)
    """How many readings the band holds (the newest 15 are kept)."""


class LearnedCapacity(CRDModel):
    """What the built-in tokenRate autoscaler learned of one expert server's capacity at the SLO
    (a learned target only): kept here so that a restarted operator scales on it at once, instead
    of learning again."""

    slo_time_per_output_token_micros: int = Field(ge=1)
    """The SLO the readings were judged against; another SLO starts afresh."""
    tokens_per_second: float | None = Field(default=None, ge=0)
    """The estimate: routed tokens per second one server carries at the SLO (the target is 0.9 x this)."""
    bands: list[CapacityBand] = Field(default_factory=list, max_length=512)
    """The readings, by band of the token rate, lowest first."""


class SlotRevision(CRDModel):
    """A pair of pools (one slot) that serves a model revision other than the serving one."""

    revision: str = Field(max_length=63)
    """The model revision (``spec.model.revision``, else a hash of the checkpoint's location)."""
    slot: Slot
    """Which pair of pools: ``blue`` (``<name>-attention``, ``<name>-experts``) or ``green``
    (``<name>-green-attention``, ``<name>-green-experts``)."""
    message: str = Field(default="", max_length=1024)
    """What it waits for."""


class MoEServiceStatus(CRDModel):
    """Observed state of a served model."""

    observed_generation: int = Field(default=0, ge=0)
    """``metadata.generation`` the operator last reconciled."""
    attention: PoolSummary = PoolSummary()
    """The AttentionPool's pods."""
    experts: PoolSummary = PoolSummary()
    """The ExpertPool's pods."""
    placement_version: int = Field(default=0, ge=0)
    """Version of the ExpertPool's published placement."""
    endpoint: str = Field(default="", max_length=1024)
    """In-cluster URL of the OpenAI-compatible API: the Service named after the MoEService, which
    selects the serving slot's attention pods."""
    revision: str = Field(default="", max_length=63)
    """The model revision serving (every answer names it in ``system_fingerprint``)."""
    serving_slot: Slot = "blue"
    """The pair of pools that serves: traffic moves to the other one when a new revision in it is Ready."""
    rollout: SlotRevision | None = None
    """A new model revision coming up in the other slot (blue/green), until it serves."""
    retiring: SlotRevision | None = None
    """The previous revision's pools after a switch: its attention pods finish their requests and go,
    then its expert servers."""
    learned_capacity: LearnedCapacity | None = None
    """The built-in tokenRate autoscaler's readings (a learned target only)."""
    conditions: list[Condition] = conditions_field()
    """``Ready``, ``Progressing``, ``Degraded``."""
