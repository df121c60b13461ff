"""Autoscale trace: a compressed diurnal day of requests through a local expert pool scaled by the
operator's built-in autoscaler, against a fixed pool sized for the peak, in the same run.

**What runs (real processes).** Expert-server processes (tcp, one thread each) host the serving
benchmarks' random mixtral-family model (``_load.serving_config``: 4 MoE layers x 8 experts, top-2;
``--experts`` and ``--top-k`` change them, DeepSeek-style fine-grained experts being e.g. 64 and 8:
``model_config`` then narrows each expert so a token's expert FLOPs stay the same) with R =
``--replication`` (2), behind one ``eaas attention-client`` process (continuous batching, one torch
thread); ``_load.run_mode`` streams the requests to it.
The servers follow a placement directory (``placement.json`` committed, ``pending.json`` being
loaded: ``LocalCluster``'s ``follow_placement_dir``) as pods follow the mounted placement
ConfigMap. ``LocalCluster`` cannot add or remove a server at run time: ``ElasticCluster`` below
adds that (ports of every ordinal up to the maximum are reserved up front, so the client, started
with all of them, reaches servers added later as it would through the headless Service).

**The operator, on its own pure code.** ``LocalOperator`` does for the pool what the operator's
ExpertPool and MoEService reconciles do, with Kubernetes replaced by the processes: every
``TICK_S`` it observes them (a pod is Ready once ``/readyz`` answers 200; its Lease's loaded
version is ``placement_version`` of ``/v1/stats``), calls ``eaas.operator.expert_step.plan`` and
applies the step: a server is added one at a time (pending = committed + server k, its process
started, committed once it has loaded its experts) and removed highest ordinal first (pending =
committed without it, its experts re-homed with R kept, its process sent SIGTERM only after that
placement is committed). Every ``--resync-seconds`` (5 s, the Lease heartbeat's default interval)
it calls ``Autoscaler.recommend`` as ``set_expert_replicas`` does: current = the pool's replicas;
utilization = the ExpertPool's ``utilizationMilli`` (``expert_step.serving_utilization``: the mean
over the servers that carry the load and keep it) of each server's busy fraction over the last
10 s as its Lease reports it (``runtime.lease.Utilization`` of ``busy_seconds`` in ``/v1/stats`` =
``eaas_expert_server_step_seconds_sum``); ready = Ready servers not stopping. Load-based
rebalancing is not run (its default interval, 300 s, is longer than an arm). ``--placement
round-robin`` (a diagnostic, not what the operator does) replaces every scale step's pending
placement by a round-robin one over the new set of servers. The sizing lines print how many
servers share a layer's work (``layer_balance`` x servers: 2 = two servers' worth) for the
committed placement and for a round-robin one: the operator's ``planning.add_server`` once gave a
new server whole layers (1.8 servers' worth at 2, 3 and 4 servers); it now spreads it over every
layer, on par with round-robin.

**Simulated: the accelerator.** On this 2-core machine more server processes add no compute, so
there would be no capacity for autoscaling to buy. Every server runs the ``simulated`` kernel
backend (:mod:`eaas.kernels.simulated`): the real expert computation (the torch reference:
outputs stay right), then a sleep up to a modelled device time of ``--sim-expert-us`` (200) per
expert whose weights the batch reads plus ``--sim-entry-us`` (3000) per routed (token, expert)
entry, prefill and decode alike (a server that many attention clients share computes large
batches, whose time grows with their tokens). A sleep holds no core, so n servers have n times the
device time; it counts in the busy fraction the autoscaler sees. ``0 0`` turns it off (CPU compute
only).

**The trace.** ``elasticity.diurnal_trace``'s ``peaked`` day (``1 + 0.6 cos + 0.2 cos 2x``, peak at
14:00, AR(1) noise of 3%, seeded; with seed 0 and 180 s, peak / trough 3.3, mean / peak 0.55)
compressed into ``--duration-s`` (180 s; quick 45 s) from 00:00, one rate per second, scaled to peak at
``--peak-rps`` (1.5). Arrivals are Poisson within each second (seeded); prompt and output lengths
as ``_load.workload`` (8-48 and 8-64 tokens). Both arms replay the same requests.

**The SLO.** The p99 time per output token (TPOT, after the first) of the requests that arrive in a
``--window-s`` (15 s) window must not exceed the target, else the window is *violating*. The target
is ``--slo-factor`` (2) x the p99 TPOT measured first in this run, ``--sizing-s`` (30 s; quick 9 s)
of Poisson load at the trough's rate on the smallest pool (what the autoscaled pool serves at
night; the first third not counted, while the batch fills up), or ``--slo-tpot-ms``.

**The fixed pool (baseline), measured on the trace's peak.** The trace's own requests around its
peak (``peak_segment``: the SLO windows whose mean rate is at least ``PEAK_FRACTION`` (0.8) x the
peak: 90-120 s of the 180 s day), replayed with the window before them as a lead-in (so that the
peak meets the backlog the rise leaves), on n = min, min + 1, ... servers, until one meets the target
in every judged window with no failed request: the fixed pool is the smallest that does. If none
does, it is the smallest whose p50 and p99 are both within 10% of the best measured (more servers
than that buy no latency, typical or tail, so sizing above it would only inflate the baseline);
the output says which rule applied. (The p99 alone, over the ~57 requests of the judged windows,
is close to their maximum: one run took 5 servers, p99 224 ms against 6's 215 ms, though their
p50s were 173 and 147 ms, and that pool of 5 then violated 5 of the trace's 12 windows, at up to
477 ms, where the autoscaled pool at 6 read 170-196 ms.) Until 2026-11-27 the sizing ran
``--sizing-s`` of a constant Poisson load at the peak rate, 1.5 req/s, with its own seed. The
trace's own draws are what the arms replay, and at seed 0 its peak windows (90-135 s) hold 85
requests, 1.9 req/s where the rate is 1.2-1.5: so the sizing loaded a server less than the trace
(410 against 540-620 tokens/s per server in one run), its answer flipped between 3 and 4 servers
from run to run on this machine, and the pools it chose violated 6-9 of the trace's 12 windows.

**Ours.** The autoscaler between ``--min-servers`` (2, = R) and ``--max-servers`` (4), scale-up
window 0 s (the CRD's default), scale-down window ``--scale-down-window-s`` (20 s: the default 300 s
belongs to full days and GPU servers that take minutes to start; server start-up and placement
changes are not compressed with the day, so neither is the window). By default (``--metric
token-rate``) it runs the operator's default, ``metric: tokenRate`` with its target learned at the
run's SLO (``sloTimePerOutputTokenMillis``): the servers' routed (token, expert) entries per second
(``runtime.lease.TokenRate`` of ``total_tokens`` in ``/v1/stats``, averaged as
``ExpertPool.status.tokensPerSecond`` is) against the client's p99 time per output token over the
last 30 s (``eaas_attention_time_per_output_token_p99_seconds``, what its Lease carries). It
starts from what the operator would have learned while this pool ran the sizing runs
(``learned_from_sizing``) and goes on learning during the arm. ``--hand-set-target`` sets
``targetTokensPerSecond`` to ``--headroom`` x what a server of the fixed pool carried at the peak
instead. With ``--metric busy`` its target utilization, as a user would set it after a load test,
is ``elasticity.BUSY_HEADROOM`` (0.85) x the busy fraction the fixed pool had at the peak, unless
``--target-utilization-milli``. With ``--metric expert-wait`` it scales as
``spec.autoscaling.metric: expertWait`` does, on the attention client's expert time per decoder
step (``runtime.lease.ExpertWait`` of its ``eaas_attention_step_expert_seconds``, as its Lease
carries it), target HEADROOM x the fixed pool's at the peak unless ``--target-expert-wait-ms``.
``--headroom`` (default HEADROOM) applies to the targets set by hand and to ``--ceilings``. Both arms start
the replay with their pool settled (ours at the minimum); they run one after the other, fixed first.

**Reported** per arm: GPU-seconds (over servers, the time from starting a server's process until it
has exited, within the replay's ``--duration-s``), violating windows, the requests in them,
requests whose own TPOT is above the target, failed requests; saved = 1 - ours / fixed; and, for
scale, what an oracle could save on this trace (``oracle_saving``: no autoscaler saves more than the
trace's shape and the floor of ``--min-servers`` allow; 32% against 4 servers here) and what the
built-in autoscaler with the run's settings could save at most (``controller_ceiling``: its own
``recommend`` fed an ideal metric, servers starting at once; 24% against 4 servers). Beside the
busy fraction, sizing and each window show the attention client's expert wait per decoder step
(``eaas_attention_step_expert_seconds``: what the pool adds to a step). ``--ceilings`` prints only
``controller_ceiling`` over day lengths, pool sizes and scale-down windows. Targets (the issue):
saved >= 30% with no more violating windows than the fixed pool, and no failed request.

**Known limits.** The machine is shared and has 2 cores: the client's CPU time, which no number of
servers changes, is part of every TPOT and moves with other load, so absolute times mean little,
and the arms, run one after the other, do not see the same background load (the load average is
printed per phase). The client runs one torch thread (``OMP_NUM_THREADS=1``): with the default two,
OpenMP threads spinning against other work made its p50 TPOT 10x worse under load. A local server
starts in a second or two, not the minutes a GPU server needs to load its weights, which favours
scaling. With about one request per second, a window holds few requests at night and its p99 is
close to its maximum.

Usage: python benchmarks/autoscale_trace.py [--quick] [--peak-rps R] [--duration-s S] [--json-out PATH]
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import emit, parser, target
from _load import OUTPUT_LEN, PROMPT_LEN, percentile, run_mode, serving_config, start_client
from elasticity import BUSY_HEADROOM as HEADROOM
from elasticity import DAY_S, diurnal_trace

from eaas.operator import expert_step
from eaas.operator.api.moeservice import AutoscalingSpec
from eaas.operator.autoscaler import HEADROOM as AUTOSCALER_HEADROOM
from eaas.operator.autoscaler import Autoscaler, Capacity
from eaas.operator.planning import PoolShape, initial
from eaas.runtime.client.routing import RoutingTable
from eaas.runtime.contract import PENDING_KEY
from eaas.runtime.lease import UTILIZATION_WINDOW_S, ExpertWait, TokenRate, Utilization
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import MoEConfig, write_random_checkpoint
from eaas.runtime.placement import Placement
from eaas.runtime.placement.source import MountedFiles
from eaas.runtime.server.daemon import DaemonLoop
from eaas.runtime.transport.shm_segment import remove_segments_of

TICK_S = 0.5  # the local operator's reconcile period (the real one reacts to events within ~1 s)
TEMPLATE = "local"  # every server runs the same pod template
PEAK_FRACTION = 0.8  # the sizing judges the SLO windows at >= this x the peak rate (``peak_segment``)
BALANCE_TOKENS = 16  # decode batch for ``layer_balance`` (about the batch at the peak)
Request = tuple[float, list[int], int]  # (arrival offset s, prompt ids, max_tokens), as _load's


# --- the trace and its requests (pure) ----------------------------------------------------------------
def rate_trace(peak_rps: float, duration_s: int, seed: int) -> np.ndarray:
    """Requests/s for each second of the replay [S] (S = ``duration_s``): the ``peaked`` day from
    00:00, one step per second, maximum exactly ``peak_rps``."""
    step_s = DAY_S // duration_s
    return diurnal_trace(peak_rps, seed, "peaked", step_s=step_s, day_s=step_s * duration_s)


def trace_requests(rates: np.ndarray, seed: int, vocab: int) -> list[Request]:
    """Poisson arrivals at ``rates[s]`` within each second s, lengths drawn as ``_load.workload``."""
    counts = np.random.default_rng(seed).poisson(rates)  # [S]
    rng = random.Random(seed)
    requests = []
    for second, count in enumerate(counts.tolist()):
        for offset in sorted(rng.random() for _ in range(count)):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_LEN))]
            requests.append((second + offset, prompt, rng.randint(*OUTPUT_LEN)))
    return requests


def poisson_requests(rate: float, seconds: float, seed: int, vocab: int) -> list[Request]:
    """A constant ``rate`` for ``seconds`` (the sizing runs)."""
    return trace_requests(np.full(math.ceil(seconds), rate), seed, vocab)


def peak_segment(
    rates: np.ndarray, window_s: float, fraction: float = PEAK_FRACTION
) -> tuple[float, float, float]:
    """What the sizing runs replay of the trace [S] req/s: (start, judged_from, end) s. Judged: the
    SLO windows (as the arms count them, from 0) around the busiest whose mean rate is at least
    ``fraction`` x the peak rate (the busiest always); replayed from one window before them (a
    lead-in: the backlog the rise leaves for the peak), or from 0."""
    count = math.ceil(len(rates) / window_s)
    means = [float(rates[int(i * window_s) : int((i + 1) * window_s)].mean()) for i in range(count)]
    floor = fraction * float(rates.max())
    first = last = int(np.argmax(means))
    while first > 0 and means[first - 1] >= floor:
        first -= 1
    while last + 1 < count and means[last + 1] >= floor:
        last += 1
    judged_from = first * window_s
    return max(0.0, judged_from - window_s), judged_from, min(float(len(rates)), (last + 1) * window_s)


def segment(requests: list[Request], start: float, end: float) -> list[Request]:
    """The requests arriving in [start, end), their arrivals counted from ``start``."""
    return [
        (arrival - start, prompt, tokens) for arrival, prompt, tokens in requests if start <= arrival < end
    ]


# --- accounting (pure) --------------------------------------------------------------------------------
def tpot(result: dict[str, Any]) -> float | None:
    """Seconds per output token after the first; None for a failed request or a single token."""
    if "error" in result or result.get("count", 0) < 2:
        return None
    return float((result["end"] - result["first"]) / (result["count"] - 1))


def gpu_seconds(lifetimes: list[tuple[float, float | None]], start: float, end: float) -> float:
    """Server-seconds within [start, end]; a lifetime is (started, stopped), stopped None = running."""
    return sum(
        max(0.0, min(end, stop if stop is not None else end) - max(start, begin)) for begin, stop in lifetimes
    )


def slo_windows(
    results: list[dict[str, Any]], origin: float, window_s: float, duration_s: float, slo_s: float
) -> list[dict[str, Any]]:
    """Per window of arrivals [origin + i w, origin + (i + 1) w): requests, failed, p99 TPOT and
    whether it is above ``slo_s`` (a window without a measured TPOT does not violate)."""
    count = math.ceil(duration_s / window_s)
    windows: list[dict[str, Any]] = [
        {"start_s": i * window_s, "requests": 0, "failed": 0} for i in range(count)
    ]
    tpots: list[list[float]] = [[] for _ in range(count)]
    for result in results:
        index = min(count - 1, max(0, int((result["arrival"] - origin) // window_s)))
        windows[index]["requests"] += 1
        windows[index]["failed"] += int("error" in result)
        if (value := tpot(result)) is not None:
            tpots[index].append(value)
    for window, values in zip(windows, tpots, strict=True):
        window["p99_tpot_s"] = percentile(values, 0.99) if values else None
        window["over_slo"] = sum(v > slo_s for v in values)
        window["violating"] = bool(values) and window["p99_tpot_s"] > slo_s
    return windows


def summarize(windows: list[dict[str, Any]]) -> dict[str, int]:
    """Violating windows, the requests in them, requests above the target, failed requests."""
    violating = [w for w in windows if w["violating"]]
    return {
        "requests": sum(w["requests"] for w in windows),
        "violating_windows": len(violating),
        "requests_in_violating_windows": sum(w["requests"] for w in violating),
        "requests_over_slo": sum(w["over_slo"] for w in windows),
        "failed": sum(w["failed"] for w in windows),
    }


def saved(ours: float, fixed: float) -> float:
    return 1.0 - ours / fixed


def oracle_saving(rates: np.ndarray, min_servers: int, fixed_servers: int) -> float:
    """The most any autoscaler could save against ``fixed_servers`` sized for the peak: each second
    the whole servers the rate needs in proportion (ceil(fixed x rate / peak)), at least
    ``min_servers``, started and stopped instantly. rates: [S] req/s."""
    needed = np.clip(np.ceil(fixed_servers * rates / rates.max() - 1e-9), min_servers, fixed_servers)  # [S]
    return float(1.0 - needed.mean() / fixed_servers)


def controller_ceiling(
    rates: np.ndarray,
    min_servers: int,
    max_servers: int,
    fixed_servers: int,
    headroom: float = HEADROOM,
    scale_down_window_s: int = 20,
    resync_s: float = 5.0,
    metric_window_s: float = UTILIZATION_WINDOW_S,
    metric: str = "busy",
) -> float:
    """The most the built-in autoscaler with these settings could save against ``fixed_servers``
    on ``rates`` [S] req/s: its own ``Autoscaler.recommend`` every ``resync_s``, fed an ideal metric
    (busy exactly in proportion to the load per server, the fixed pool at the peak being 1 /
    ``headroom`` of the target, as the rate's mean over the Lease's ``metric_window_s``) and servers
    that start and stop at once. Below ``oracle_saving`` by the target's headroom, whole servers,
    the 10% tolerance and the scale-down window; what is left between it and a run is the metric
    and the servers' start-up. ``metric="tokenRate"``: the same on the token rate's policy (the
    fixed pool's rate per server at the peak taken as the capacity, the target ``headroom`` x it)."""
    peak_busy = min_servers / fixed_servers  # the fixed pool's busy at the peak: the floor reads 1 there
    spec = AutoscalingSpec(
        mode="builtin",
        min_replicas=min_servers,
        max_replicas=max_servers,
        metric="busy",
        target_utilization_milli=max(1, math.floor(1000 * headroom * peak_busy)),
        scale_down_stabilization_seconds=scale_down_window_s,
    )
    if metric == "tokenRate":  # in thousandths of the fixed pool's rate per server at the peak
        peak_busy = 1.0
        spec = spec.model_copy(
            update={"metric": "tokenRate", "target_tokens_per_second": round(1000 * headroom)}
        )
    autoscaler, current, next_at, used = Autoscaler(), min_servers, 0.0, 0.0
    window = max(1, round(metric_window_s))
    for second in range(len(rates)):
        if second >= next_at:
            recent = float(rates[max(0, second - window + 1) : second + 1].mean())
            milli = round(1000 * peak_busy * fixed_servers / current * recent / float(rates.max()))
            current = autoscaler.recommend(float(second), current, milli, spec)
            next_at += resync_s
        used += current
    return 1.0 - used / (len(rates) * fixed_servers)


def ceiling_table(peak_rps: float, seed: int, headroom: float, min_servers: int) -> None:
    """``controller_ceiling`` over day lengths, fixed pool sizes and scale-down windows (no processes)."""
    sizes, windows = (4, 6, 8, 16, 64), (0, 10, 20)
    print(
        f"GPU-seconds the built-in autoscaler could save at most (ideal metric, instant servers, floor "
        f"{min_servers}, target {headroom:g} x the fixed pool's busy at the peak, max = fixed), against"
        f" a fixed pool of n; oracle_saving in brackets"
    )
    print(f"{'day s':>6} {'window s':>8} | " + " | ".join(f"{f'n = {n}':>14}" for n in sizes))
    for duration in (180, 360, 720):
        rates = rate_trace(peak_rps, duration, seed)
        for window_s in windows:
            cells = [
                f"{controller_ceiling(rates, min_servers, n, n, headroom, window_s):6.1%} "
                f"({oracle_saving(rates, min_servers, n):5.1%})"
                for n in sizes
            ]
            print(f"{duration:>6} {window_s:>8} | " + " | ".join(f"{c:>14}" for c in cells))


def layer_balance(placement: Placement, top_k: int, tokens: int, seed: int = 0, trials: int = 50) -> float:
    """Mean over layers and batches of (mean server work / busiest server's work) when ``tokens``
    tokens per layer route uniformly at random to ``top_k`` experts and the client picks replicas
    as it does (``RoutingTable``); work = entries. Layers run one after the other, so a step waits
    for each layer's busiest server: 1.0 = every server shares every layer evenly."""
    table = RoutingTable(placement)
    live = torch.ones(len(table.ordinals), dtype=torch.bool)  # [S]
    generator = torch.Generator().manual_seed(seed)
    ratios = []
    for _ in range(trials):
        for layer in placement.layers:
            ids = torch.rand(tokens, placement.num_experts, generator=generator).argsort(-1)[
                :, :top_k
            ]  # [T, K]
            work = torch.bincount(table.assign(layer, ids, live).reshape(-1), minlength=len(live))  # [S]
            ratios.append(float(work.float().mean() / work.max()))
    return sum(ratios) / len(ratios)


def model_config(base: MoEConfig, experts: int | None, top_k: int | None) -> MoEConfig:
    """``base`` with ``experts`` routed experts per layer, ``top_k`` per token; with a larger top-k
    each expert is narrower (intermediate size x base top-k / top-k), so a token's expert FLOPs,
    like its simulated device time per entry x top-k, stay what the base model's are."""
    top_k = top_k or base.top_k
    intermediate = base.expert_intermediate_size * base.top_k // top_k
    return type(base).model_validate(
        {**base.model_dump(), "num_experts": experts or base.num_experts, "top_k": top_k,
         "expert_intermediate_size": intermediate}
    )  # fmt: skip


# --- the pool: processes that follow a placement directory, started and stopped while running -------
def hold_port(port: int = 0) -> socket.socket:
    """A bound (not listening) socket that keeps ``port`` (0: a free one) from other processes."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    return holder


def http_get(url: str, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def write_atomically(path: Path, text: str) -> None:
    """As kubelet updates a mounted ConfigMap: a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass
class ElasticCluster(LocalCluster):
    """``LocalCluster`` (``follow_placement_dir``) whose servers are added (``add``) and removed
    (``remove``) while running. Ports of ordinals 0 .. max_servers - 1 are reserved up front, so an
    attention client started with all of them reaches servers added later (as it would through the
    headless Service)."""

    max_servers: int = 4
    ports: dict[int, tuple[int, int]] = field(default_factory=dict)  # ordinal -> (control, tcp)
    holders: dict[int, list[socket.socket]] = field(default_factory=dict)  # ports of absent servers
    spawned: dict[int, int] = field(default_factory=dict)  # ordinal -> processes started (log names)
    started: dict[int, float] = field(default_factory=dict)  # running processes: ordinal -> start time
    finished: list[tuple[float, float]] = field(default_factory=list)  # (started, exited)

    def start(self) -> ElasticCluster:
        """Reserves the ports, then starts the placement's servers; waits until all are ready."""
        for ordinal in range(self.max_servers):
            self.holders[ordinal] = [hold_port(), hold_port()]
            control, data = (int(h.getsockname()[1]) for h in self.holders[ordinal])
            self.ports[ordinal] = (control, data)
        super().start()
        return self

    @property
    def urls(self) -> dict[int, str]:
        return {n: f"http://127.0.0.1:{control}" for n, (control, _) in self.ports.items()}

    def add(self, ordinal: int) -> None:
        """Starts server ``ordinal`` on its reserved ports (it becomes ready on its own)."""
        for holder in self.holders.pop(ordinal, []):
            holder.close()
        control, data = self.ports[ordinal]
        restarts = self.spawned.get(ordinal, 0)
        self.servers[ordinal] = self._spawn(ordinal, control, data, restarts=restarts)
        self.spawned[ordinal] = restarts + 1
        self.started[ordinal] = time.monotonic()

    _launch = add

    def remove(self, ordinal: int, timeout_s: float = 10.0) -> None:
        """SIGTERM, as a deleted pod gets; returns once the process has exited."""
        server = self.servers.pop(ordinal)
        server.process.terminate()
        try:
            server.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=timeout_s)
        self.finished.append((self.started.pop(ordinal), time.monotonic()))
        remove_segments_of(server.pid)
        with contextlib.suppress(OSError):  # best effort: the port is very likely still free
            self.holders[ordinal] = [hold_port(port) for port in self.ports[ordinal]]

    def running_urls(self) -> list[str]:
        return [self.urls[ordinal] for ordinal in self.servers]

    def lifetimes(self) -> list[tuple[float, float | None]]:
        """(started, exited) of every process so far; exited None while it runs."""
        return [*self.finished, *((begin, None) for begin in self.started.values())]

    def stop(self, timeout_s: float = 10.0) -> None:
        for ordinal in list(self.servers):
            self.remove(ordinal, timeout_s)
        for holder in (h for held in self.holders.values() for h in held):
            holder.close()
        self.holders.clear()


def elastic_cluster(checkpoint: Path, first: Placement, workdir: Path, args: Any) -> ElasticCluster:
    """The pool's processes: this script's simulated device unless ``--sim-*-us`` are both 0."""
    simulated = args.sim_expert_us > 0 or args.sim_entry_us > 0
    backend = f"simulated:{args.sim_expert_us:g}:{args.sim_entry_us:g}" if simulated else "torch"
    return ElasticCluster(
        checkpoint, first, workdir, transports=("tcp",), max_servers=args.max_servers,
        kernel_backend=backend, follow_placement_dir=True,
    )  # fmt: skip


class LocalOperator(DaemonLoop):
    """The operator's ExpertPool reconcile and MoEService autoscaling over an ``ElasticCluster``
    (see the module docstring), in a daemon thread (``start()``, ``stop()``). ``replicas`` is the
    ExpertPool's ``spec.replicas``; with ``autoscaling`` set the autoscaler writes it."""

    def __init__(
        self, cluster: ElasticCluster, shape: PoolShape, replicas: int, resync_s: float, round_robin: bool
    ) -> None:
        super().__init__("local-operator")
        self.cluster, self.shape, self.replicas, self.resync_s = cluster, shape, replicas, resync_s
        self.round_robin = round_robin  # re-plan every scale step round-robin (not what the operator does)
        self.files = MountedFiles.directory(cluster.workdir)
        self.autoscaling: AutoscalingSpec | None = None
        self.capacity: Capacity | None = None  # tokenRate's learned capacity, kept over set_replicas
        self.autoscaler = Autoscaler()
        self.ready: set[int] = set()
        self.versions: dict[int, int] = {}
        self.latest: dict[int, tuple[float, float, float]] = {}  # ordinal -> (time, busy s, tokens) last seen
        self.utilization: dict[int, Utilization] = {}  # ordinal -> its busy fraction, as its Lease has it
        self.token_rate: dict[int, TokenRate] = {}  # ordinal -> its routed tokens per second
        committed, pending = self.files.read().parse()
        self.last_version = max((p.version for p in (committed, pending) if p is not None), default=0)
        self.timeline: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.client_url: str | None = (
            None  # the attention client: its expert wait per step, as its Lease has it
        )
        self.expert_wait: ExpertWait | None = None
        self._lock = threading.Lock()

    def set_replicas(self, replicas: int, autoscaling: AutoscalingSpec | None = None) -> None:
        with self._lock:
            self.replicas, self.autoscaling = replicas, autoscaling
            self.autoscaler = Autoscaler(capacity=self.capacity)

    def _run(self) -> None:
        next_resync = time.monotonic()
        while not self._stop.wait(TICK_S):
            try:
                with self._lock:
                    self.reconcile()
                    if time.monotonic() >= next_resync:
                        next_resync += self.resync_s
                        self.resync(time.monotonic())
            except Exception as exc:  # recorded and reported: a run with errors is not a result
                logging.exception("local operator")
                self.errors.append(repr(exc))

    def observe(self) -> expert_step.Observed:
        pods, reports = {}, {}
        for ordinal, server in list(self.cluster.servers.items()):
            url = self.cluster.urls[ordinal]
            if server.process.poll() is not None:
                raise RuntimeError(f"expert server {ordinal} exited:\n{self.cluster.log_tail(ordinal)}")
            if ordinal not in self.ready:
                try:
                    if http_get(url, "/readyz")[0] == 200:
                        self.ready.add(ordinal)
                except OSError:
                    pass
            if ordinal in self.ready:
                stats = json.loads(http_get(url, "/v1/stats")[1])
                self.versions[ordinal] = int(stats["placement_version"])
                self.latest[ordinal] = (
                    time.monotonic(),
                    float(stats["busy_seconds"]),
                    float(stats["total_tokens"]),
                )
                if ordinal not in self.utilization:
                    self.utilization[ordinal] = Utilization(
                        lambda o=ordinal: self.latest[o][1], clock=lambda o=ordinal: self.latest[o][0]
                    )
                    self.token_rate[ordinal] = TokenRate(
                        lambda o=ordinal: self.latest[o][2], clock=lambda o=ordinal: self.latest[o][0]
                    )
                reports[ordinal] = expert_step.ServerReport(
                    expired=False, loaded_version=self.versions[ordinal]
                )
            pods[ordinal] = expert_step.PodState(
                ordinal, ordinal in self.ready, template_hash=TEMPLATE, uid=str(server.pid)
            )
        committed, pending = self.files.read().parse()
        return expert_step.Observed(
            pool="local", desired_replicas=self.replicas, shape=self.shape, template_hash=TEMPLATE, pods=pods,
            committed=committed, pending=pending, reports=reports, last_version=self.last_version,
        )  # fmt: skip

    def reconcile(self) -> None:
        """One ExpertPool pass: observe, plan, act (publish first, then start, then stop servers)."""
        step = expert_step.plan(self.observe())
        if step.publish is not None:
            committed, pending = step.publish
            if self.round_robin and committed and pending and committed.ordinals != pending.ordinals:
                spread = dict.fromkeys(pending.ordinals)
                pending = initial(self.shape, spread, {}, version=pending.version)
            if committed is not None:
                write_atomically(self.files.committed_path, committed.to_json())
            if pending is not None:
                write_atomically(self.cluster.workdir / PENDING_KEY, pending.to_json())
            else:
                (self.cluster.workdir / PENDING_KEY).unlink(missing_ok=True)
            self.last_version = max(p.version for p in (committed, pending) if p is not None)
        for ordinal in step.create_pods:
            self.cluster.add(ordinal)
        for ordinal in step.delete_pods:
            self.cluster.remove(ordinal)
            self.ready.discard(ordinal)
            self.latest.pop(ordinal, None)
            self.utilization.pop(ordinal, None)
            self.token_rate.pop(ordinal, None)

    def resync(self, now: float) -> None:
        """The MoEService pass: the autoscaler, called as ``set_expert_replicas`` calls it, on the
        ExpertPool's ``utilizationMilli`` (``serving_utilization`` of the Leases' busy fractions)
        or, with ``metric: expertWait``, on the client's expert wait per step (``ExpertWait`` of
        its ``eaas_attention_step_expert_seconds``, as its Lease computes it)."""
        reports = {
            ordinal: expert_step.ServerReport(
                False,
                utilization_milli=self.utilization[ordinal].milli(),
                tokens_per_second=self.token_rate[ordinal].per_second(),
            )
            for ordinal in sorted(self.ready & set(self.cluster.servers) & set(self.utilization))
        }
        committed, pending = self.files.read().parse()
        utilization = expert_step.serving_utilization(reports, committed, pending)
        tokens = expert_step.serving_utilization(reports, committed, pending, "tokens_per_second")
        ready = len(self.ready & set(self.cluster.servers))
        if self.expert_wait is None and self.client_url is not None:
            self.expert_wait = ExpertWait(lambda url=self.client_url: expert_wait(url))
        wait = self.expert_wait.micros() if self.expert_wait is not None else None
        tpot = client_tpot(self.client_url) if self.client_url is not None else None
        before = self.replicas
        if self.autoscaling is not None:
            value = {"expertWait": wait, "tokenRate": tokens}.get(self.autoscaling.metric, utilization)
            self.replicas = self.autoscaler.recommend(
                now, self.replicas, value, self.autoscaling, ready, tpot
            )
            self.capacity = self.autoscaler.capacity
        self.timeline.append(
            {"t": now, "replicas": before, "set": self.replicas, "ready": ready,
             "processes": len(self.cluster.servers), "utilization_milli": utilization,
             "tokens_per_server_s": tokens, "tpot_p99_s": tpot / 1e6 if tpot is not None else None,
             "learned_target": self.autoscaler.per_server,
             "expert_wait_per_step_s": wait / 1e6 if wait is not None else None}
        )  # fmt: skip

    def is_stable(self, replicas: int) -> bool:
        committed, pending = self.files.read().parse()
        return (
            pending is None
            and committed is not None
            and len(committed.ordinals) == replicas
            and set(self.cluster.servers) == set(committed.ordinals) <= self.ready
        )

    def wait_stable(self, replicas: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_stable(replicas):
            if self.errors:
                raise RuntimeError(f"the local operator failed: {self.errors[-1]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the pool did not settle at {replicas} servers in {timeout_s:.0f} s")
            time.sleep(0.2)


# --- the run ------------------------------------------------------------------------------------------
def server_totals(cluster: ElasticCluster) -> tuple[float, float]:
    """Busy seconds and routed tokens of every running server so far (``/v1/stats``)."""
    stats = [json.loads(http_get(url, "/v1/stats")[1]) for url in cluster.running_urls()]
    return sum(s["busy_seconds"] for s in stats), sum(s["total_tokens"] for s in stats)


def expert_wait(client_url: str) -> tuple[float, int]:
    """The attention client's ``eaas_attention_step_expert_seconds``: (sum in seconds, steps)."""
    text = http_get(client_url, "/metrics")[1].decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("eaas_attention_step_expert_seconds_sum", "eaas_attention_step_expert_seconds_count"):
            values[name.rsplit("_", 1)[1]] = float(value)
    return values["sum"], int(values["count"])


def client_tpot(client_url: str) -> int | None:
    """The attention client's p99 time per output token over the last 30 s (us), as its Lease
    carries it (``eaas_attention_time_per_output_token_p99_seconds``); None when none finished."""
    text = http_get(client_url, "/metrics")[1].decode()
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "eaas_attention_time_per_output_token_p99_seconds":
            seconds = float(value)
            return None if math.isnan(seconds) else round(seconds * 1e6)
    return None


def per_step(before: tuple[float, int], after: tuple[float, int]) -> float | None:
    """Mean expert seconds per step between two ``expert_wait`` readings (None: no step)."""
    steps = after[1] - before[1]
    return (after[0] - before[0]) / steps if steps > 0 else None


def load_average() -> float:
    return os.getloadavg()[0]


def measure(
    cluster: ElasticCluster,
    url: str,
    requests: list[Request],
    seconds: float,
    warm_up: float,
    window_s: float | None = None,
    slo_s: float = math.inf,
) -> dict[str, Any]:
    """``requests`` through the pool as it is, ``seconds`` of arrivals: p50 / p99 TPOT of the
    requests that arrive after ``warm_up`` s (a constant rate: the batch fills up meanwhile; the
    peak's replay: its lead-in), failed requests, and, over the arrivals after ``warm_up``, the
    mean rate, the servers' mean busy fraction, routed tokens/s per server and the client's expert
    seconds per decoder step (``eaas_attention_step_expert_seconds``). With ``window_s``, also the
    p99 of each SLO window from ``warm_up`` on and how many are above ``slo_s``."""
    snapshots: dict[str, tuple[float, tuple[float, float], tuple[float, int]]] = {}

    def snapshot(name: str) -> None:
        snapshots[name] = (time.monotonic(), server_totals(cluster), expert_wait(url))

    timers = [
        threading.Timer(0.2 + at, snapshot, (name,)) for name, at in (("from", warm_up), ("to", seconds))
    ]
    for timer in timers:  # run_mode starts the arrivals 0.2 s after it is called
        timer.start()
    results = run_mode("continuous", True, url, requests)
    for timer in timers:
        timer.join()
    (then, before, waited_before), (now, after, waited_after) = snapshots["from"], snapshots["to"]
    busy = (after[0] - before[0]) / (now - then) / len(cluster.servers)
    tokens = (after[1] - before[1]) / (now - then) / len(cluster.servers)
    origin = results[0]["arrival"] - requests[0][0]
    measured = [r for r in results if r["arrival"] - origin >= warm_up]
    values = [v for r in measured if (v := tpot(r)) is not None]
    row = {
        "servers": len(cluster.servers),
        "rate_rps": len(measured) / (seconds - warm_up),
        "requests": len(results),
        "measured": len(values),
        "failed": sum("error" in r for r in results),
        "tpot_p50_s": percentile(values, 0.5),
        "tpot_p99_s": percentile(values, 0.99),
        "busy_fraction": busy,
        "tokens_per_server_s": tokens,
        "expert_wait_per_step_s": per_step(waited_before, waited_after),
        "load_average": load_average(),
    }
    if window_s is not None:
        windows = slo_windows(measured, origin + warm_up, window_s, seconds - warm_up, slo_s)
        row["window_p99_s"] = [w["p99_tpot_s"] for w in windows]
        row["violating_windows"] = sum(w["violating"] for w in windows)
    return row


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def fixed_size(sizing: list[dict[str, Any]]) -> tuple[int, str]:
    """The smallest size whose replay of the trace's peak met the SLO in every judged window with
    no failed request; if none did, the smallest whose p50 and p99 are both within 10% of the best
    measured (more servers buy no latency then, typical or tail). Returns (servers, the rule)."""
    meeting = [r for r in sizing if r["violating_windows"] == 0 and r["failed"] == 0]
    if meeting:
        return min(r["servers"] for r in meeting), "the smallest that met the SLO through the trace's peak"
    p50, p99 = (min(r[key] for r in sizing) for key in ("tpot_p50_s", "tpot_p99_s"))
    close = min(r["servers"] for r in sizing if r["tpot_p50_s"] <= 1.1 * p50 and r["tpot_p99_s"] <= 1.1 * p99)
    return close, "none met the SLO through the trace's peak: the smallest within 10% of the best p50 and p99"


def calibrate(
    args: Any,
    operator: LocalOperator,
    url: str,
    rates: np.ndarray,
    requests: list[Request],
    vocab: int,
    top_k: int,
) -> tuple[float, list[dict[str, Any]], int, str]:
    """The SLO target, the sizing runs on the trace's peak and the fixed pool (see the module
    docstring)."""
    cluster = operator.cluster
    trough_load = poisson_requests(float(rates.min()), args.sizing_s, args.seed + 1, vocab)
    trough = measure(cluster, url, trough_load, args.sizing_s, args.sizing_s / 3)
    slo_s = args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else args.slo_factor * trough["tpot_p99_s"]
    print(
        f"SLO: p99 TPOT at the trough ({trough['rate_rps']:.2f} req/s, {args.min_servers} servers) "
        f"{trough['tpot_p99_s'] * 1e3:.0f} ms -> target {slo_s * 1e3:.0f} ms"
        + (" (given)" if args.slo_tpot_ms else f" (x {args.slo_factor:g})")
        + f"; busy {trough['busy_fraction']:.2f}, {trough['tokens_per_server_s']:.0f} tokens/s per server"
        + f", expert wait per step {ms(trough['expert_wait_per_step_s'])}"
        + f"; load average {trough['load_average']:.1f}",
        flush=True,
    )
    sizing = [{"phase": "slo", **trough}]
    start, judged_from, end = peak_segment(rates, args.window_s)
    peak = segment(requests, start, end)
    print(
        f"sizing: the trace's requests of {start:g}-{end:g} s replayed on each pool size, judged "
        f"from {judged_from:g} s (windows at >= {PEAK_FRACTION:g} x the peak rate)",
        flush=True,
    )
    for servers in range(args.min_servers, args.max_servers + 1):
        operator.set_replicas(servers)
        operator.wait_stable(servers)
        row = measure(cluster, url, peak, end - start, judged_from - start, args.window_s, slo_s)
        committed, _ = operator.files.read().parse()
        assert committed is not None
        row["layer_balance"] = layer_balance(committed, top_k, BALANCE_TOKENS)
        row["layer_balance_round_robin"] = layer_balance(
            initial(operator.shape, dict.fromkeys(committed.ordinals), {}), top_k, BALANCE_TOKENS
        )
        sizing.append({"phase": "sizing", **row})
        meets = row["violating_windows"] == 0 and row["failed"] == 0
        windows = " / ".join(ms(p99) for p99 in row["window_p99_s"])
        print(
            f"sizing at the peak ({row['rate_rps']:.2f} req/s): {servers} servers, TPOT p50 "
            f"{row['tpot_p50_s'] * 1e3:.0f} ms p99 {row['tpot_p99_s'] * 1e3:.0f} ms (windows {windows}), "
            f"busy {row['busy_fraction']:.2f}, {row['tokens_per_server_s']:.0f} tokens/s per server, "
            f"expert wait per step {ms(row['expert_wait_per_step_s'])}, "
            f"servers sharing a layer {servers * row['layer_balance']:.2f} "
            f"(round-robin: {servers * row['layer_balance_round_robin']:.2f}), {row['failed']} failed, "
            f"load average {row['load_average']:.1f} -> {'meets' if meets else 'misses'}",
            flush=True,
        )
        if meets:
            break
    fixed_n, rule = fixed_size(sizing[1:])
    return slo_s, sizing, fixed_n, rule


def replay(
    cluster: ElasticCluster,
    operator: LocalOperator,
    url: str,
    requests: list[Request],
    args: Any,
    slo_s: float,
) -> dict[str, Any]:
    """One arm: the trace's requests through the pool as it is (and as the operator changes it)."""
    mark = len(operator.timeline)
    results = run_mode("continuous", True, url, requests)
    origin = results[0]["arrival"] - requests[0][0]
    lifetimes = cluster.lifetimes()
    windows = slo_windows(results, origin, args.window_s, args.duration_s, slo_s)
    readings = operator.timeline[mark:]
    for window in windows:
        begin = origin + window["start_s"]
        window["servers"] = gpu_seconds(lifetimes, begin, begin + args.window_s) / args.window_s
        within = [row for row in readings if begin <= row["t"] < begin + args.window_s]
        for key in ("utilization_milli", "expert_wait_per_step_s", "tokens_per_server_s"):
            values = [row[key] for row in within if row[key] is not None]
            window[key] = sum(values) / len(values) if values else None
    return {
        "gpu_seconds": gpu_seconds(lifetimes, origin, origin + args.duration_s),
        "last_answer_s": max(r.get("end", 0.0) for r in results) - origin,
        "load_average": load_average(),
        **summarize(windows),
        "windows": windows,
        "timeline": [{**row, "t": row["t"] - origin} for row in operator.timeline[mark:]],
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--peak-rps", type=float, default=1.5, help="the trace's peak request rate")
    p.add_argument("--duration-s", type=int, help="the compressed day (default 180; quick 45)")
    p.add_argument(
        "--sizing-s",
        type=float,
        help="seconds of load at the trough's rate for the SLO (default 30; quick 9)",
    )
    p.add_argument("--window-s", type=float, default=15.0, help="SLO window")
    p.add_argument("--slo-factor", type=float, default=2.0, help="target = factor x p99 TPOT at the trough")
    p.add_argument("--slo-tpot-ms", type=float, help="a given target instead of the measured one")
    p.add_argument("--min-servers", type=int, default=2)
    p.add_argument("--max-servers", type=int, default=4)
    p.add_argument("--replication", type=int, default=2)
    p.add_argument("--experts", type=int, help="routed experts per layer (default: the serving model's 8)")
    p.add_argument("--top-k", type=int, help="experts per token (default: the serving model's 2)")
    p.add_argument(
        "--metric",
        choices=("busy", "expert-wait", "token-rate"),
        default="token-rate",
        help="what the autoscaler scales on (spec.autoscaling.metric busy, expertWait or tokenRate)",
    )
    p.add_argument(
        "--hand-set-target",
        action="store_true",
        help="token-rate: targetTokensPerSecond = --headroom x the fixed pool's rate, instead of learning it",
    )
    p.add_argument("--target-utilization-milli", type=int, help="default: HEADROOM x the fixed pool's busy")
    p.add_argument(
        "--target-expert-wait-ms", type=int, help="default: HEADROOM x the fixed pool's expert wait per step"
    )
    p.add_argument("--headroom", type=float, default=HEADROOM, help="target: this x the fixed pool's reading")
    p.add_argument("--scale-down-window-s", type=int, default=20)
    p.add_argument("--resync-seconds", type=float, default=5.0, help="autoscaler period (heartbeat interval)")
    p.add_argument("--sim-expert-us", type=float, default=200.0, help="device time per expert read")
    p.add_argument("--sim-entry-us", type=float, default=3000.0, help="device time per routed entry")
    p.add_argument(
        "--placement",
        choices=("operator", "round-robin"),
        default="operator",
        help="scale steps place experts as the operator does, or round-robin over the new set (diagnostic)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ceilings",
        action="store_true",
        help="only print controller_ceiling over day lengths, pool sizes and windows (no processes)",
    )
    args = p.parse_args()
    if args.ceilings:
        ceiling_table(args.peak_rps, args.seed, args.headroom, args.min_servers)
        return
    args.duration_s = args.duration_s or (45 if args.quick else 180)
    args.sizing_s = args.sizing_s or (9.0 if args.quick else 30.0)
    if not 1 <= args.replication <= args.min_servers <= args.max_servers:
        p.error("need 1 <= --replication <= --min-servers <= --max-servers")

    base = serving_config()
    config = model_config(base, args.experts, args.top_k)
    rates = rate_trace(args.peak_rps, args.duration_s, args.seed)
    requests = trace_requests(rates, args.seed, config.vocab_size)
    print(
        f"trace: {args.duration_s} s day, {len(requests)} requests; rate peak {rates.max():.2f}, trough "
        f"{rates.min():.2f}, mean {rates.mean():.2f} req/s (peak/trough {rates.max() / rates.min():.2f}, "
        f"mean/peak {rates.mean() / rates.max():.2f})",
        flush=True,
    )
    shape = PoolShape(tuple(config.moe_layers), config.num_experts, args.replication)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_random_checkpoint(config, Path(tmp) / "ckpt", seed=1)
        first = initial(shape, dict.fromkeys(range(args.min_servers)), {}, version=1)
        cluster = elastic_cluster(checkpoint, first, Path(tmp) / "pool", args)
        with cluster:
            round_robin = args.placement == "round-robin"
            operator = LocalOperator(cluster, shape, args.min_servers, args.resync_seconds, round_robin)
            operator.start()
            client, url = start_client("continuous", checkpoint, cluster, Path(tmp))
            operator.client_url = url
            try:
                warm_up = poisson_requests(1.0, 3.0, args.seed + 1000, config.vocab_size)
                run_mode("continuous", True, url, warm_up)
                slo_s, sizing, fixed_n, rule = calibrate(
                    args, operator, url, rates, requests, config.vocab_size, config.top_k
                )
                at_peak = next(r for r in sizing[1:] if r["servers"] == fixed_n)
                spec, aim, headroom = autoscaling(args, at_peak, slo_s)
                if spec.metric == "tokenRate" and spec.target_tokens_per_second is None:
                    operator.capacity = learned_from_sizing(sizing, spec)
                    capacity, how = operator.capacity.estimate()
                    shown = f"{capacity:.0f}" if capacity is not None else "none"
                    aim += f"; from the sizing runs {shown} tokens/s per server ({how})"
                print(f"fixed pool: {fixed_n} servers ({rule}); autoscaler target {aim}")
                operator.set_replicas(fixed_n)
                operator.wait_stable(fixed_n)
                print(f"fixed arm: {args.duration_s} s, load average {load_average():.1f}", flush=True)
                fixed = replay(cluster, operator, url, requests, args, slo_s)
                operator.set_replicas(args.min_servers)
                operator.wait_stable(args.min_servers)
                operator.set_replicas(args.min_servers, spec)
                print(f"autoscaled arm: {args.duration_s} s, load average {load_average():.1f}", flush=True)
                ours = replay(cluster, operator, url, requests, args, slo_s)
            finally:
                operator.stop()
                client.terminate()
                client.wait(timeout=30)
    if operator.errors:
        raise SystemExit(f"the local operator failed: {operator.errors}")
    report(args, rates, slo_s, sizing, (fixed_n, rule, spec, aim, headroom), fixed, ours)


def autoscaling(args: Any, at_peak: dict[str, Any], slo_s: float) -> tuple[AutoscalingSpec, str, float]:
    """The autoscaler's spec: with ``--metric token-rate`` (the default) the operator's default,
    its target learned at the run's SLO; otherwise as a user would set it after the load test,
    ``HEADROOM`` x what the fixed pool read at the peak (its busy fraction, its expert wait per step
    with ``--metric expert-wait``, its token rate with ``--hand-set-target``) unless a target is
    given; with the target as text and the headroom it leaves."""
    common = {
        "mode": "builtin",
        "min_replicas": args.min_servers,
        "max_replicas": args.max_servers,
        "scale_down_stabilization_seconds": args.scale_down_window_s,
    }
    if args.metric == "token-rate" and not args.hand_set_target:
        slo_ms = max(1, round(slo_s * 1e3))
        spec = AutoscalingSpec(**common, metric="tokenRate", slo_time_per_output_token_millis=slo_ms)
        aim = f"learned at the SLO ({slo_ms} ms p99 TPOT): {AUTOSCALER_HEADROOM:g} x the capacity"
        return spec, aim, AUTOSCALER_HEADROOM
    if args.metric == "token-rate":
        rate = at_peak["tokens_per_server_s"]
        per_s = max(1, math.floor(args.headroom * rate))
        spec = AutoscalingSpec(**common, metric="tokenRate", target_tokens_per_second=per_s)
        return spec, f"{per_s} tokens/s per server (the fixed pool's {rate:.1f})", per_s / rate
    if args.metric == "expert-wait":
        wait_ms = 1e3 * at_peak["expert_wait_per_step_s"]
        millis = args.target_expert_wait_ms or max(1, math.floor(args.headroom * wait_ms))
        spec = AutoscalingSpec(**common, metric="expertWait", target_expert_wait_millis=millis)
        return spec, f"{millis} ms expert wait per step (the fixed pool's {wait_ms:.1f} ms)", millis / wait_ms
    busy = at_peak["busy_fraction"]
    milli = args.target_utilization_milli or max(1, math.floor(1000 * args.headroom * busy))
    spec = AutoscalingSpec(**common, metric="busy", target_utilization_milli=milli)
    return spec, f"{milli / 1000:.3f} busy (the fixed pool's {busy:.3f})", milli / 1000 / busy


def learned_from_sizing(sizing: list[dict[str, Any]], spec: AutoscalingSpec) -> Capacity:
    """What the operator learned while this pool ran the sizing runs (the trough's rate on the
    fewest servers, the peak's on more and more): each run's tokens/s per server against its p99
    TPOT, as its settled resync passes would have recorded them. The arm goes on learning."""
    capacity = Capacity(spec.slo_time_per_output_token_millis * 1000)
    for row in sizing:
        if row["failed"] == 0 and row["tpot_p99_s"] is not None:
            capacity.observe(row["tokens_per_server_s"], round(row["tpot_p99_s"] * 1e6))
    return capacity


def print_windows(rates: np.ndarray, fixed: dict[str, Any], ours: dict[str, Any], window_s: float) -> None:
    print(
        f"{'window s':>9} {'req/s':>6} | {'fixed: servers':>14} {'p99 TPOT':>11} {'busy':>5} {'wait':>8} "
        f"{'tok/s':>6} | {'ours: servers':>13} {'p99 TPOT':>11} {'busy':>5} {'wait':>8} {'tok/s':>6}"
    )
    for a, b in zip(fixed["windows"], ours["windows"], strict=True):
        start = int(a["start_s"])
        rate = float(rates[start : start + int(window_s)].mean())
        cells = []
        for w in (a, b):
            p99 = "-" if w["p99_tpot_s"] is None else f"{w['p99_tpot_s'] * 1e3:.0f} ms"
            busy = "-" if w["utilization_milli"] is None else f"{w['utilization_milli'] / 1000:.2f}"
            tokens = "-" if w["tokens_per_server_s"] is None else f"{w['tokens_per_server_s']:.0f}"
            cells.append(
                f"{w['servers']:14.2f} {p99 + (' !' if w['violating'] else '  '):>11} {busy:>5} "
                f"{ms(w['expert_wait_per_step_s']):>8} {tokens:>6}"
            )
        print(f"{start:>4}-{start + int(window_s):<4} {rate:6.2f} | {cells[0]} | {cells[1][1:]}")


def report(
    args: Any,
    rates: np.ndarray,
    slo_s: float,
    sizing: list[dict[str, Any]],
    fixed_choice: tuple[int, str, AutoscalingSpec, str, float],
    fixed: dict[str, Any],
    ours: dict[str, Any],
) -> None:
    fixed_n, rule, spec, aim, headroom = fixed_choice
    print(f"\nper {args.window_s:g} s window: mean servers alive, p99 TPOT (! = above {slo_s * 1e3:.0f} ms)")
    print_windows(rates, fixed, ours, args.window_s)
    print(
        f"\n{'arm':>15} {'GPU-s':>7} {'violating windows':>17} {'their requests':>14} {'> SLO':>6} "
        f"{'failed':>6} {'requests':>8} {'load avg':>8}"
    )
    rows = []
    for name, arm in (
        (f"fixed-{fixed_n}", fixed),
        (f"autoscaled {args.min_servers}-{args.max_servers}", ours),
    ):
        violating = f"{arm['violating_windows']} of {len(arm['windows'])}"
        print(
            f"{name:>15} {arm['gpu_seconds']:7.1f} {violating:>17} "
            f"{arm['requests_in_violating_windows']:>14} {arm['requests_over_slo']:>6} {arm['failed']:>6} "
            f"{arm['requests']:>8} {arm['load_average']:>8.1f}"
        )
        rows.append({"phase": "arm", "arm": name, **arm})
    ratio = saved(ours["gpu_seconds"], fixed["gpu_seconds"])
    extra = ours["violating_windows"] - fixed["violating_windows"]
    failed = ours["failed"] + fixed["failed"]
    met = ratio >= 0.30 and extra <= 0 and failed == 0
    oracle = oracle_saving(rates, args.min_servers, fixed_n)
    ceiling = controller_ceiling(
        rates, args.min_servers, args.max_servers, fixed_n, headroom,
        args.scale_down_window_s, args.resync_seconds, metric=spec.metric,
    )  # fmt: skip
    print(
        f"\nsaved {ratio:.1%} of the fixed pool's GPU-seconds (target >= 30%); violating windows "
        f"{ours['violating_windows']} against {fixed['violating_windows']} (target: no more); failed {failed}"
        f"\nan oracle (whole servers in proportion to the rate, at least {args.min_servers}, no delay) "
        f"would save {oracle:.1%}; the built-in autoscaler with these settings, fed an ideal metric "
        f"and starting servers at once, {ceiling:.1%}"
        f"\nfixed pool: {fixed_n} servers, {rule}; autoscaler target {aim}"
        f"\ntarget {'MET' if met else 'NOT MET'}",
        flush=True,
    )
    settings = {
        "phase": "settings",
        **{k: v for k, v in vars(args).items() if k != "json_out"},
        "slo_tpot_p99_s": slo_s,
        "fixed_servers": fixed_n,
        "fixed_rule": rule,
        "autoscaling": spec.to_k8s(),
        "oracle_saving": oracle,
        "controller_ceiling": ceiling,
    }
    emit(
        "autoscale_trace",
        [settings, *sizing, *rows],
        {
            "gpu_seconds_saved_vs_fixed": target(ratio, 0.30),
            "extra_violating_windows_vs_fixed": target(extra, 0, higher_is_better=False),
            "failed_requests": target(failed, 0, higher_is_better=False),
        },
        args.json_out,
    )


if __name__ == "__main__":
    main()
