"""AttentionPool and ExpertPool: the two halves of a served model, each owned by its MoEService.

The ``*Template`` models are what a user writes inside a MoEService; the ``*Spec`` models add what
the MoEService copies down (model, transport, heartbeat, placement) so each pool reconciles alone.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from eaas.operator.api.base import CRDModel, Rule
from eaas.operator.api.common import (
    DNS_SUBDOMAIN,
    Condition,
    HeartbeatSpec,
    ModelSpec,
    PlacementSpec,
    PodSettings,
    Port,
    Transport,
    UCXSpec,
    conditions_field,
)

# The kernel backends a pod may name (eaas.kernels.registry; simulated takes two numbers).
KERNEL_BACKEND = r"^(torch|triton|grouped_mm|simulated:[0-9]+(\.[0-9]+)?:[0-9]+(\.[0-9]+)?)?$"


class SecretKeySelector(CRDModel):
    """One key of a Secret in the object's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    """Name of the Secret."""
    key: str = Field(default="api-keys", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    """Key in the Secret's data."""


class AttentionPoolTemplate(PodSettings):
    """Attention clients: embeddings, attention with KV cache, router, LM head; the OpenAI-compatible API."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.microBatches >= 0 && self.microBatches <= 3",
            "microBatches must be 0 (auto: measured on live steps), 1, 2 or 3",
            field_path=".microBatches",
            check=lambda p: 0 <= p.micro_batches <= 3,
        ),
    )

    replicas: int = Field(default=1, ge=1, le=1024)
    """Attention-client pods (each holds whole sequences; scale on requests)."""
    gpus_per_pod: int = Field(default=1, ge=0, le=16)
    """GPUs of one attention-client pod; 0 runs on CPU."""
    port: Port = 8000
    """Port of the OpenAI-compatible HTTP API."""
    api_keys_secret: SecretKeySelector | None = None
    """Secret key holding the bearer API keys the OpenAI-compatible API requires on ``/v1/``
    (whitespace-separated: put the old and the new key during a rotation); unset: no key."""
    micro_batches: int = 1
    """Micro-batches each decoder step is cut into, pipelined so that one's attention runs while
    another's experts compute (2 or 3 hide the expert round trip); 0: auto, each tried on live
    steps and the fastest kept."""


class ExpertPoolTemplate(PodSettings):
    """Expert servers: one pod per GPU, each hosting the (layer, expert) pairs the placement gives it."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.replicationFactor <= self.replicas",
            "replicationFactor must be <= replicas: every expert needs that many distinct expert servers",
            field_path=".replicationFactor",
            check=lambda p: p.replication_factor <= p.replicas,
        ),
        Rule(
            "self.kernelBackend != 'triton' || self.gpusPerPod == 1",
            "kernelBackend triton needs gpusPerPod = 1 (on CPU it runs only under the Triton interpreter)",
            field_path=".kernelBackend",
            check=lambda p: p.kernel_backend != "triton" or p.gpus_per_pod == 1,
        ),
    )

    replicas: int = Field(default=2, ge=1, le=4096)
    """Expert-server pods, i.e. GPUs: the pool scales by whole GPUs, any number of them, in batches
    of at most ``maxServersPerChange``."""
    gpus_per_pod: int = Field(default=1, ge=0, le=1)
    """1: one GPU per expert server (the unit of scaling); 0: CPU expert servers (tcp/shm transports)."""
    replication_factor: int = Field(default=2, ge=1, le=16)
    """R: every expert is hosted on at least R distinct servers, so R-1 server failures lose nothing."""
    max_servers_per_change: int = Field(default=0, ge=0, le=4096)
    """Servers one placement change may add or remove when ``replicas`` changes; 0 = a change at
    most doubles or halves the pool (64 -> 320 servers in three changes, 320 -> 64 in three).
    A change commits once all of its new servers have loaded, so a smaller bound adds capacity in
    smaller, earlier steps; 1 adds and removes one server per change."""
    port: Port = 9100
    """Control port of each expert server (handshake, health, metrics)."""
    data_port: Port = 9101
    """Data port of the tcp transport (slot frames)."""
    expert_slots_per_server: int = Field(default=0, ge=0, le=1048576)
    """(layer, expert) weights one server can hold; 0 = as many as the placement needs
    (``ceil(R * MoE layers * experts / replicas)``)."""
    kernel_backend: str = Field(default="", max_length=64, pattern=KERNEL_BACKEND)
    """Expert compute: empty = ``triton`` on GPU servers, ``torch`` on CPU servers; or ``torch``,
    ``triton``, ``grouped_mm`` (``torch._grouped_mm``). ``simulated:EXPERT_US:ENTRY_US`` computes
    as ``torch``, then sleeps to a modelled device time (microseconds per expert read plus per
    routed token): capacity and autoscaling tests on machines without GPUs, never serving."""


def capacity_rule(prefix: str) -> Rule:
    """Fixed server slots must hold R copies of every (layer, expert); `prefix` locates the pool."""
    pool = f"self{prefix}"
    return Rule(
        f"{pool}.expertSlotsPerServer == 0 || {pool}.expertSlotsPerServer * {pool}.replicas >= "
        f"{pool}.replicationFactor * (self.model.numLayers - self.model.numDenseLayers)"
        " * self.model.numExperts",
        "replicas * expertSlotsPerServer must be >= replicationFactor * MoE layers * numExperts "
        "(every expert needs R slots)",
        field_path=f"{prefix}.replicas",
        check=lambda spec: _has_capacity(spec, prefix),
    )


def _has_capacity(spec: object, prefix: str) -> bool:
    pool = getattr(spec, "expert_pool", spec) if prefix else spec
    return holds_every_expert(pool, spec.model, pool.replicas)  # type: ignore[attr-defined]


def holds_every_expert(pool: Any, model: Any, replicas: int) -> bool:
    """Whether ``replicas`` servers of ``pool`` have slots for R copies of every (MoE layer, expert)
    (always, for servers without a fixed number of slots)."""
    slots = pool.expert_slots_per_server
    needed = pool.replication_factor * len(model.moe_layers) * model.num_experts
    return slots == 0 or slots * replicas >= needed


class ExpertPoolSpec(ExpertPoolTemplate):
    """Desired state of an ExpertPool (written by its MoEService; ``replicas`` also through ``/scale``)."""

    rules = (*ExpertPoolTemplate.rules, capacity_rule(""))

    model: ModelSpec
    """The served model (copied from the MoEService)."""
    transport: Transport = "tcp"
    """How attention clients reach expert servers (``tcp``, ``shm``, ``cuda_ipc``, ``nixl``; see
    MoEService ``spec.transport``)."""
    ucx: UCXSpec = UCXSpec()
    """UCX settings of transport ``nixl`` (copied from the MoEService)."""
    heartbeat: HeartbeatSpec = HeartbeatSpec()
    """Lease renewal of the expert servers."""
    placement: PlacementSpec = PlacementSpec()
    """Placement policy."""


class AttentionPoolSpec(AttentionPoolTemplate):
    """Desired state of an AttentionPool (written by its MoEService)."""

    model: ModelSpec
    """The served model (copied from the MoEService)."""
    transport: Transport = "tcp"
    """How attention clients reach expert servers (``tcp``, ``shm``, ``cuda_ipc``, ``nixl``; see
    MoEService ``spec.transport``)."""
    ucx: UCXSpec = UCXSpec()
    """UCX settings of transport ``nixl`` (copied from the MoEService)."""
    heartbeat: HeartbeatSpec = HeartbeatSpec()
    """Lease renewal of the attention clients."""
    expert_pool_name: str = Field(min_length=1, max_length=253)
    """The ExpertPool whose servers these clients route to."""
    expert_pool_port: Port = 9100
    """Control (handshake) port of that ExpertPool's servers."""
    placement_config_map: str = Field(min_length=1, max_length=253)
    """ConfigMap with the ExpertPool's placement, mounted into every client."""


class PoolStatus(CRDModel):
    """Observed state shared by both pools."""

    observed_generation: int = Field(default=0, ge=0)
    """``metadata.generation`` the operator last reconciled."""
    replicas: int = Field(default=0, ge=0)
    """Pods that exist."""
    ready_replicas: int = Field(default=0, ge=0)
    """Pods that are Ready."""
    selector: str = Field(default="", max_length=4096)
    """Label selector of the pool's pods, as a string (for the scale subresource and HPAs)."""
    conditions: list[Condition] = conditions_field()
    """``Ready``, ``Progressing``, ``Degraded``."""


class AttentionPoolStatus(PoolStatus):
    """Observed state of an AttentionPool."""

    endpoint: str = Field(default="", max_length=1024)
    """In-cluster URL of the OpenAI-compatible API."""


class ExpertPoolStatus(PoolStatus):
    """Observed state of an ExpertPool."""

    placement_version: int = Field(default=0, ge=0)
    """Version of the published placement (increases with every change)."""
    placement_config_map: str = Field(default="", max_length=253)
    """ConfigMap holding the placement JSON."""
    servers: list[int] = Field(default_factory=list, max_length=4096)
    """Ordinals of the expert servers in the published placement."""
    down_servers: list[int] = Field(default_factory=list, max_length=4096)
    """Servers of the published placement that are not live (pod not Ready, or heartbeat expired);
    a server that received SIGTERM and serves on while it is drained is not down."""
    fewest_live_replicas: int = Field(default=0, ge=0)
    """The fewest live replicas any (layer, expert) has (0: some expert cannot be served)."""
    utilization_milli: int | None = Field(default=None, ge=0, le=1000)
    """Mean busy fraction (0-1000) of the servers that carry the load and keep it (committed and not
    leaving in a pending change), from their heartbeats; absent when none report."""
    tokens_per_second: int | None = Field(default=None, ge=0)
    """Mean routed (token, expert) entries per second over the same servers, from their heartbeats
    (each over its last 10 s); absent when none report."""
