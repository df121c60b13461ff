"""Prometheus metrics of a serving attention client (its own registry, so several fit in one process)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from eaas.runtime.lease import RecentP99

RESULTS = ("ok", "bad_request", "rejected", "unavailable", "timeout", "error")
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


class AttentionMetrics:
    def __init__(self, model_name: str = "") -> None:
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
        self.recent_tpot = RecentP99()  # the same times over the last 30 s: the Lease's p99 (autoscaling)
        self.recent_tpot_p99 = Gauge(
            "eaas_attention_time_per_output_token_p99_seconds",
            "p99 time per output token of the requests finished in the last 30 s, as the Lease carries it "
            "for the built-in autoscaler (NaN when none finished)",
            registry=r,
        )
        self.recent_tpot_p99.set_function(
            lambda: micros / 1e6 if (micros := self.recent_tpot.micros()) is not None else math.nan
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
        self.inter_token_latency = Histogram(
            "eaas_attention_inter_token_latency_seconds",
            "Time between two consecutive generated tokens of a sequence",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.engine = EngineCounters()
        r.register(self.engine)
        self.failovers = FailoverCounters()
        r.register(self.failovers)
        r.register(VllmNames(self, model_name))

    def bind(
        self,
        queued: Callable[[], float],
        ready: Callable[[], float],
        live_servers: Callable[[], float],
        running: Callable[[], float] = lambda: 0.0,
        kv_cache_usage: Callable[[], float] = lambda: 0.0,
        engine: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0),
        failovers: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        """Gauges (and the engine's and the data path's counters) read at scrape time."""
        self.engine.read = engine
        self.failovers.read = failovers
        self.running.set_function(running)
        self.kv_cache_usage.set_function(kv_cache_usage)
        self.queued.set_function(queued)
        self.ready.set_function(ready)
        self.live_servers.set_function(live_servers)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCounters(Collector):
    """The engine's own counters, read at scrape time: ``eaas_attention_prefix_cache_queries_total``
    and ``..._hits_total`` (tokens of admitted sequences looked up in the prefix cache, and those
    found computed; ``BlockAllocator.admitted`` counts them once an admission holds, so a scrape
    never sees them go down) and ``eaas_attention_preemptions_total``."""

    def __init__(self) -> None:
        self.read: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)  # queries, hits, preemptions

    def collect(self) -> Iterator[CounterMetricFamily]:
        queries, hits, preemptions = self.read()
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
        yield CounterMetricFamily(
            "eaas_attention_preemptions",
            "Running sequences preempted for lack of KV blocks (recomputed when admitted again)",
            value=preemptions,
        )


class FailoverCounters(Collector):
    """The data path's counters, read at scrape time: ``eaas_attention_failovers_total`` (expert
    servers this client stopped using because they failed: closed, gone, timed out) and
    ``eaas_attention_rejoins_total`` (failed servers it connected to again), since it started."""

    def __init__(self) -> None:
        self.read: Callable[[], tuple[int, int]] = lambda: (0, 0)  # failovers, rejoins

    def collect(self) -> Iterator[CounterMetricFamily]:
        failovers, rejoins = self.read()
        yield CounterMetricFamily(
            "eaas_attention_failovers",
            "Expert servers this client failed over from (closed, gone or timed out)",
            value=failovers,
        )
        yield CounterMetricFamily(
            "eaas_attention_rejoins", "Failed expert servers this client connected to again", value=rejoins
        )


# The names vLLM's metrics carry, which the Gateway API Inference Extension's endpoint picker,
# KEDA recipes and vLLM dashboards read: ours -> theirs, the same numbers (``VllmNames``).
VLLM_NAMES = {
    "eaas_attention_running_sequences": "vllm:num_requests_running",
    "eaas_attention_queued_sequences": "vllm:num_requests_waiting",
    "eaas_attention_kv_cache_usage": "vllm:kv_cache_usage_perc",
    "eaas_attention_prefix_cache_queries": "vllm:prefix_cache_queries",
    "eaas_attention_prefix_cache_hits": "vllm:prefix_cache_hits",
    "eaas_attention_preemptions": "vllm:num_preemptions",
    "eaas_attention_prompt_tokens": "vllm:prompt_tokens",
    "eaas_attention_generated_tokens": "vllm:generation_tokens",
    "eaas_attention_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "eaas_attention_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "eaas_attention_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "eaas_attention_request_seconds": "vllm:e2e_request_latency_seconds",
}


class VllmNames(Collector):
    """Our series again under vLLM's names, with its ``model_name`` label: collected from the same
    metrics at scrape time, so the two never disagree."""

    def __init__(self, metrics: AttentionMetrics, model_name: str) -> None:
        self.metrics = metrics
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for collector in (
            self.metrics.running,
            self.metrics.queued,
            self.metrics.kv_cache_usage,
            self.metrics.engine,
            self.metrics.prompt_tokens,
            self.metrics.generated_tokens,
            self.metrics.time_to_first_token,
            self.metrics.inter_token_latency,
            self.metrics.time_per_output_token,
            self.metrics.request_seconds,
        ):
            for family in collector.collect():
                theirs = VLLM_NAMES.get(family.name)
                if theirs is None:
                    continue
                renamed = Metric(theirs, family.documentation, family.type)
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    name = theirs + sample.name[len(family.name) :]
                    labels = {**sample.labels, "model_name": self.model_name}
                    renamed.add_sample(name, labels, sample.value, sample.timestamp, sample.exemplar)
                yield renamed
