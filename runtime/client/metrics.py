"""Prometheus metrics of a serving attention client (its own registry, so several fit in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

RESULTS = ("ok", "bad_request", "rejected", "unavailable", "timeout", "error")
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


class AttentionMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "eaas_attention_requests_total",
            "Completion requests answered, by result (ok, bad_request, rejected = queue full, "
            "unavailable = no expert server for an expert, timeout, error)",
            ["result"],
            registry=r,
        )
        for result in RESULTS:
            self.requests.labels(result=result)  # every series exists from the start
        self.generated_tokens = Counter(
            "eaas_attention_generated_tokens_total", "Tokens generated for successful requests", registry=r
        )
        self.prompt_tokens = Counter(
            "eaas_attention_prompt_tokens_total", "Prompt tokens of successful requests", registry=r
        )
        self.request_seconds = Histogram(
            "eaas_attention_request_seconds",
            "Time from receiving a completion request to answering it",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.batch_sequences = Histogram(
            "eaas_attention_batch_sequences",
            "Sequences in one decoder step (continuous batching) or one generate() batch (static)",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "eaas_attention_time_to_first_token_seconds",
            "Time from receiving a request to its first generated token",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "eaas_attention_time_per_output_token_seconds",
            "Mean time between the generated tokens of a sequence after the first",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.step_expert_seconds = Histogram(
            "eaas_attention_step_expert_seconds",
            "Time one decoder step (continuous batching) spent in its MoE layers' expert calls: sending "
            "to the expert servers, waiting for their answers, combining them (what the pool adds to a step)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "eaas_attention_queue_seconds",
            "Time a sequence waited before its first step",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.queued = Gauge("eaas_attention_queued_sequences", "Sequences waiting for a batch", registry=r)
        self.running = Gauge("eaas_attention_running_sequences", "Sequences in the running batch", registry=r)
        self.kv_cache_usage = Gauge(
            "eaas_attention_kv_cache_usage", "Fraction of the paged KV cache's blocks in use", registry=r
        )
        self.ready = Gauge("eaas_attention_ready", "1 when every expert has a connected server", registry=r)
        self.live_servers = Gauge(
            "eaas_attention_live_expert_servers", "Expert servers of the placement connected", registry=r
        )
        self.prefix_cache = PrefixCacheCounters()
        r.register(self.prefix_cache)

    def bind(
        self,
        queued: Callable[[], float],
        ready: Callable[[], float],
        live_servers: Callable[[], float],
        running: Callable[[], float] = lambda: 0.0,
        kv_cache_usage: Callable[[], float] = lambda: 0.0,
        prefix_cache: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        """Gauges (and the prefix cache's counters) read at scrape time."""
        self.prefix_cache.read = prefix_cache
        self.running.set_function(running)
        self.kv_cache_usage.set_function(kv_cache_usage)
        self.queued.set_function(queued)
        self.ready.set_function(ready)
        self.live_servers.set_function(live_servers)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCounters(Collector):
    """``eaas_attention_prefix_cache_{queries,hits}_total``: tokens of admitted sequences looked up
    in the prefix cache, and those found computed (read from the engine at scrape time)."""

    def __init__(self) -> None:
        self.read: Callable[[], tuple[int, int]] = lambda: (0, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        queries, hits = self.read()
        yield CounterMetricFamily(
            "eaas_attention_prefix_cache_queries",
            "Tokens of admitted sequences looked up in the prefix cache (a preempted one is looked up again)",
            value=queries,
        )
        yield CounterMetricFamily(
            "eaas_attention_prefix_cache_hits",
            "Of those, tokens found computed (not computed again)",
            value=hits,
        )
