"""Prometheus metrics of one expert server (its own registry, so several servers fit in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
REQUEST_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
SECONDS_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "eaas_expert_server_requests_total",
            "Requests answered, by transport and status",
            ["transport", "status"],
            registry=r,
        )
        self.tokens = Counter("eaas_expert_server_tokens_total", "Tokens computed", registry=r)
        self.expert_tokens = Counter(
            "eaas_expert_server_expert_tokens_total",
            "Token-expert pairs computed (tokens x experts applied)",
            registry=r,
        )
        self.batches = Counter("eaas_expert_server_batches_total", "Batches computed", registry=r)
        self.batch_tokens = Histogram(
            "eaas_expert_server_batch_tokens", "Tokens per batch", buckets=TOKEN_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "eaas_expert_server_batch_requests", "Requests per batch", buckets=REQUEST_BUCKETS, registry=r
        )
        self.step_seconds = Histogram(
            "eaas_expert_server_step_seconds",
            "Time from picking up a batch to publishing its responses",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.attached_slots = Gauge(
            "eaas_expert_server_attached_slots", "Slots attached to clients", ["transport"], registry=r
        )
        self.reaped_slots = Counter(
            "eaas_expert_server_reaped_slots_total",
            "Slots freed without their client's release: its connection or process ended (client_gone) "
            "or its Lease expired (lease_expired)",
            ["reason"],
            registry=r,
        )
        self.hosted_experts = Gauge(
            "eaas_expert_server_hosted_experts", "(layer, expert) pairs hosted", registry=r
        )
        self.placement_version = Gauge(
            "eaas_expert_server_placement_version",
            "Version of the newest placement whose experts this server has loaded",
            registry=r,
        )
        self.placement_errors = Counter(
            "eaas_expert_server_placement_errors_total",
            "Placement changes that could not be read or loaded (the server kept its experts)",
            registry=r,
        )
        self.ready = Gauge("eaas_expert_server_ready", "1 when the server serves requests", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
