"""Fault drill: decode throughput before, during and after losing expert servers, against a monolith
that must restart.

Two parts, one run.

**Part A, measured here.** ``SERVERS`` (4) expert-server processes (``LocalCluster``, tcp, one
thread each) host the serving benchmarks' random mixtral-family model (``_load.serving_config``)
with ``REPLICATION`` = 3 (``round_robin``), so losing any 2 of the 4 leaves every expert a live
replica. One ``AttentionClient`` (tcp, default ``ClientOptions``, one torch thread) decodes in a
thread without pause: a fixed batch of ``BATCH`` (16) seeded prompts of ``PROMPT_LEN`` tokens,
greedy, ``STEPS`` tokens after the prefill, then the next of ``ROUNDS`` batches (and round again).
Every forward is time-stamped (it yields one token per sequence); throughput = tokens whose
forward ended in a window / the window, and a timeline in ``BIN_S`` (0.5 s) bins. Every finished
sequence is compared with the monolithic reference: a sequence that differs, or is in a batch whose
decode raised, is a *failed request*. For k = 1..``K`` (quick: k = 1 only): ``hold`` s healthy
(*before*), SIGKILL of servers 1..k, ``hold`` s degraded (the survivors take the share through the
client's failover), ``restart`` of the killed servers (same ports) and the client's rejoin
(*during* = kill to every server live again in the client), ``hold`` s healthy (*after*). Stall =
the longest gap between two forwards from the kill to the rejoin (a healthy gap is the step time).

Measured per-step costs (the calibration of Part B): the step time and the *expert fraction* f =
the busy fraction of the busiest server over the healthy windows (``eaas_expert_server_step_seconds``
from its ``/metrics``, over wall time): the share of a step a layer spends waiting for its busiest
server's compute. The rest (attention, router, transport, polling) does not depend on how many
servers there are.

**Monolith baseline, same run.** The same model in one process (``load_reference``, 2 threads,
before the cluster starts) decodes the same batches the same way: its tokens/s. Its restart time is
measured for real: a fresh Python process that loads the checkpoint and produces the first token of
the batch (Popen to the token, median of ``restart_reps``). A monolith's collective hangs on a lost
GPU and the group restarts, so over each window of ours it produces 0 tokens from the kill for its
restart time, then its healthy rate, and the ``BATCH`` requests in flight are lost (counted, not
replayed). That restart covers only process start, torch import, weight load and a prefill of this
tiny model; a real one adds NCCL/NVSHMEM setup, CUDA-graph capture and loading 671B of weights:
published full restarts take 2-3 min (SGLang) and 348 s (EEP), shown in Part B for context.

**Part B, simulated at 64 servers, calibrated by Part A.** DeepSeek-V3's shape: 58 MoE layers
(3..60) x 256 experts, top-8, ``SyntheticTrace``'s expected load of a 4096-token decode batch
(skewed expert popularity, max/mean ~2.5 per server). 64 servers, R = 2 and one redundant slot per
server per layer (``SLOTS_PER_LAYER`` = 576, DeepSeek's EPLB redundant experts), so survivors have
room to restore R. Three arms on the same load and faults (`ARMS`): *plain packing* (EPLB's
``replicate_and_pack``) with the planners' healthy objective (``failover_factor=0``: the planners
without failure awareness); *failure-aware packing* (``failure_aware=True``: the same replication and
balance, each server's experts' other replicas spread over many servers) with the healthy
objective; and the failure-aware packing with the default objective, which also bounds the
busiest survivor of any single failure (``CostModel.failover_factor``, what ships). Each start is
refined by the operator's default policy (``cost_aware``) and re-planned by ``recover``, with the
arm's objective. A decode step costs
``(1 - f) + f x M / M0`` of a healthy one, M = sum over layers of the busiest server's tokens
(``server_loads``: an expert's tokens split evenly over its live replicas, as the client splits an
expert with > 32 tokens; M0 healthy). Faults hit g = 1..4 seeded random servers one at a time,
``--fault-interval-s`` (60 s) apart; after each, for ``--degraded-s`` (2.2 s: the longest time to
commit the placement without the lost server that drills 2 and 3 measured on the real plane since
the operator re-plans on the clients' word, 0.5-0.8 s after a SIGKILL and 1.9-2.2 s after a
SIGSTOP; it was 10 s, when drill 3 took 7.2 s) the client fails over (no re-plan: the lost
server's experts served by their other replicas), then the operator's ``recover`` re-plans onto
the survivors. Every planner plans for the steps a placement serves until the next fault (the
fault interval over Part A's step time; it was a fixed 100 steps, which made ``recover`` leave the
survivors less balanced than the 60 s window repays). Reported per arm and g: the load after any
one server's failure (``failover_loads``, mean and worst over the servers), and throughput in the
failover state, after the re-plan, and averaged over the window from fault g to the next (the
paper's measurement: "average decode throughput while 10 GPUs are disabled one by one"); the loss
per lost GPU is ``(1 - throughput) / g``. An expert left with no live replica would be a failed
request. The monolith produces nothing for its restart time per fault, then its full rate.

Targets, on the failure-aware arm: window-average throughput lost per lost GPU at 64 servers < 2%
(the paper's figure) and <= 1.0%, and <= 6% per lost GPU in the failover
state, each the largest over g = 1..4; 0 failed requests in Part A and Part B.

Not modelled in Part B: the attention side's own failures, network contention, the time the
re-plan's experts take to load (it moves more for a longer horizon: the rows give how many), and
the client's choice for cold experts (whole to one replica, rotating batch by batch: the even split
on average, not within a step); throughput is relative (1.0 = 64 healthy servers).

Usage: python benchmarks/fault_drill.py [--quick] [--degraded-s S] [--fault-interval-s S] [--json-out PATH]
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import emit, parser, target
from _load import serving_config
from elasticity import scrape

from eaas.runtime.client import AttentionClient, ClientOptions
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import Decoder, load_reference, write_random_checkpoint
from eaas.runtime.placement import (
    CostModel,
    Placement,
    SyntheticTrace,
    TraceConfig,
    cost_aware,
    failover_loads,
    num_moves,
    recover,
    replicate_and_pack,
    round_robin,
    server_loads,
)

SERVERS = 4
REPLICATION = 3  # any 2 of the 4 servers may be lost
K = 2
BATCH = 16
PROMPT_LEN = 8
STEPS = 24
ROUNDS = 3
BIN_S = 0.5
BUSY = "eaas_expert_server_step_seconds_sum"
# Part B: DeepSeek-V3's routed experts on 64 servers.
SIM_LAYERS = range(3, 61)
SIM_EXPERTS = 256
SIM_SERVERS = 64
SIM_REPLICATION = 2
SLOTS_PER_LAYER = 2 * 256 + 64  # R = 2 plus one redundant replica per server per layer
PUBLISHED_RESTART_S = {"SGLang full restart (2-3 min)": 150.0, "EEP full restart": 348.0}


# --- Part B: the simulation (pure) --------------------------------------------------------------------
def moe_tokens(placement: Placement, load: np.ndarray, lost: tuple[int, ...] = ()) -> float:
    """Sum over layers of the busiest server's tokens with the servers ``lost`` gone (their
    replicas dropped; an expert's tokens split evenly over its live replicas). ``inf`` when an
    expert has no live replica left. load: float ``[L, E]``."""
    matrix = placement.hosting_matrix().copy()  # [S, L, E]
    for ordinal in lost:
        matrix[placement.server_index(ordinal)] = False
    if not matrix.any(axis=0).all():
        return math.inf
    degraded = Placement.from_matrix(placement.layers, placement.num_experts, placement.servers, matrix)
    return float(server_loads(degraded, load).max(axis=1).sum())  # [L, S] -> busiest per layer


def relative_throughput(expert_fraction: float, moe_ratio: float) -> float:
    """Throughput of a step whose expert part (``expert_fraction`` of a healthy step) takes
    ``moe_ratio`` times as long; 0 when an expert is unavailable (``moe_ratio`` inf)."""
    return 0.0 if math.isinf(moe_ratio) else 1.0 / ((1.0 - expert_fraction) + expert_fraction * moe_ratio)


def window_average(first: float, first_s: float, then: float, window_s: float) -> float:
    """Mean throughput over ``window_s`` that runs at ``first`` for ``first_s``, then at ``then``."""
    first_s = min(first_s, window_s)
    return (first * first_s + then * (window_s - first_s)) / window_s


HEALTHY_ONLY = CostModel(failover_factor=0.0)
ARMS = (
    ("plain packing, healthy objective", False, HEALTHY_ONLY),  # the planners without failure awareness
    ("failure-aware packing, healthy objective", True, HEALTHY_ONLY),
    ("failure-aware packing and objective", True, CostModel()),  # what ships
)
"""Part B's arms: (name, failure-aware packing, the planners' cost model)."""


def simulation_start(
    load: np.ndarray,
    servers: int = SIM_SERVERS,
    *,
    failure_aware: bool = True,
    horizon_steps: int = 100,
    cost: CostModel | None = None,
) -> Placement:
    """The 64-server placement the drill starts from: EPLB's packing (failure-aware or plain)
    refined by ``cost_aware`` with ``cost`` (default `CostModel()`; R = 2, one redundant slot per
    server per layer). load: float ``[L, E]``."""
    layers = list(SIM_LAYERS)[: load.shape[0]]
    capacity = math.ceil(len(layers) * SLOTS_PER_LAYER * load.shape[1] / SIM_EXPERTS / servers)
    empty = round_robin(layers, load.shape[1], servers, SIM_REPLICATION, capacity=capacity)
    packed = replicate_and_pack(empty, load, failure_aware=failure_aware)
    return cost_aware(packed, load, cost or CostModel(), horizon_steps=horizon_steps)


def drill(
    start: Placement,
    load: np.ndarray,
    faults: list[int],
    expert_fraction: float,
    degraded_s: float,
    interval_s: float,
    horizon_steps: int = 100,
    cost: CostModel | None = None,
) -> list[dict[str, Any]]:
    """One row per fault g (servers ``faults[:g]`` lost, one at a time): relative throughput in the
    failover state (``degraded_s``), after ``recover`` (planning for ``horizon_steps`` with
    ``cost``, default `CostModel()`), the window average until the next fault, and the loss per
    lost GPU of each. load: float ``[L, E]``."""
    healthy = moe_tokens(start, load)
    current, rows = start, []
    for g, ordinal in enumerate(faults, 1):
        failover = relative_throughput(expert_fraction, moe_tokens(current, load, (ordinal,)) / healthy)
        before, current = current, recover(current, [ordinal], load, cost, horizon_steps=horizon_steps)
        replanned = relative_throughput(expert_fraction, moe_tokens(current, load) / healthy)
        average = window_average(failover, degraded_s, replanned, interval_s)
        rows.append(
            {
                "lost_gpus": g,
                "lost_ordinal": ordinal,
                "failover_throughput": failover,
                "replanned_throughput": replanned,
                "window_throughput": average,
                "failover_loss_per_gpu": (1 - failover) / g,
                "replanned_loss_per_gpu": (1 - replanned) / g,
                "window_loss_per_gpu": (1 - average) / g,
                "unavailable": failover == 0.0,
                "replication_after": current.replication,
                "recover_loads": num_moves(before, current),  # experts the survivors load
            }
        )
    return rows


def monolith_window(restart_s: float, interval_s: float) -> float:
    """A monolith's mean throughput over ``interval_s`` after a fault: 0 for ``restart_s``, then 1."""
    return window_average(0.0, restart_s, 1.0, interval_s)


def simulation_load(seed: int, layers: int = len(SIM_LAYERS), experts: int = SIM_EXPERTS) -> np.ndarray:
    """float ``[L, E]``: expected tokens per (layer, expert) of a 4096-token top-8 decode step."""
    config = TraceConfig(num_layers=layers, num_experts=experts, tokens_per_step=4096 * 8, seed=seed)
    return SyntheticTrace(config).expected_loads(0, 100).mean(axis=0).astype(np.float64)


# --- Part A: the drill on a local cluster (measured) --------------------------------------------------
def prompts(vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, PROMPT_LEN), generator=generator).tolist()


def decode_round(decoder: Decoder, batch: list[list[int]], stamps: list[float]) -> list[list[int]]:
    """Greedy prefill + ``STEPS`` decode steps; appends the end time of every forward to ``stamps``."""
    cache = decoder.new_cache(len(batch), PROMPT_LEN + STEPS + 1)
    with torch.inference_mode():
        logits = decoder.forward(torch.tensor(batch), torch.full((len(batch),), PROMPT_LEN), cache)
        generated = [logits.argmax(-1)]  # [B]
        stamps.append(time.monotonic())
        for _ in range(STEPS):
            logits = decoder.forward(generated[-1][:, None], torch.ones(len(batch), dtype=torch.int64), cache)
            generated.append(logits.argmax(-1))
            stamps.append(time.monotonic())
    return torch.stack(generated, dim=1).tolist()  # [B, STEPS + 1]


@dataclass
class Decoding:
    """Decodes ``batches`` in turn until stopped, checking every sequence against ``wants``."""

    decoder: Decoder
    batches: list[list[list[int]]]
    wants: list[list[list[int]]]
    stamps: list[float] = field(default_factory=list)
    requests: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        index = 0
        while not self.stop.is_set():
            batch, want = self.batches[index % len(self.batches)], self.wants[index % len(self.batches)]
            try:
                got = decode_round(self.decoder, batch, self.stamps)
                self.failed += sum(g != w for g, w in zip(got, want, strict=True))
            except Exception as exc:  # counted, reported, never hidden
                self.failed += len(batch)
                self.errors.append(repr(exc))
            self.requests += len(batch)
            index += 1


def window(stamps: list[float], start: float, end: float) -> tuple[float, float]:
    """(tokens/s, longest gap s) of the forwards that ended in [start, end); the gap counts from
    the last forward before ``start`` and up to ``end``."""
    inside = [t for t in stamps if start <= t < end]
    before = [t for t in stamps if t < start]
    edges = ([before[-1]] if before else [start]) + inside + [end]
    gap = max(b - a for a, b in itertools.pairwise(edges))
    return BATCH * len(inside) / (end - start), gap


def timeline(stamps: list[float], start: float, end: float) -> list[float]:
    """Tokens/s per ``BIN_S`` bin from ``start`` to ``end``."""
    bins = max(1, math.ceil((end - start) / BIN_S))
    counts = np.histogram(
        [t for t in stamps if start <= t < end], bins=bins, range=(start, start + bins * BIN_S)
    )
    return [float(c) * BATCH / BIN_S for c in counts[0]]


def outage_rate(rate: float, start: float, end: float, down_from: float, down_until: float) -> float:
    """Mean rate over [start, end) of a process at ``rate`` except 0 in [down_from, down_until)."""
    down = max(0.0, min(end, down_until) - max(start, down_from))
    return rate * (end - start - down) / (end - start)


RESTART_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(2)
    from eaas.runtime.model import load_reference
    decoder = load_reference(sys.argv[1])
    tokens, _ = decoder.generate(json.loads(sys.argv[2]), 1)
    print(json.dumps(tokens), flush=True)
    """
)


def monolith_restart(checkpoint: Path, batch: list[list[int]], want: list[list[int]]) -> float:
    """Seconds from starting a fresh monolith process to its first token of ``batch``."""
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-c", RESTART_SCRIPT, str(checkpoint), json.dumps(batch)], stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    seconds = time.monotonic() - started
    process.wait(timeout=30)
    if json.loads(line) != [row[:1] for row in want]:
        raise RuntimeError("the restarted monolith's first tokens differ from the reference")
    return seconds


def measure_monolith(
    checkpoint: Path, batches: list[list[list[int]]], hold: float, reps: int
) -> dict[str, Any]:
    """The reference's decode tokens/s over ``hold`` s, its outputs, and its measured restart time."""
    reference = load_reference(checkpoint)
    torch.set_num_threads(2)
    wants = [decode_round(reference, batch, []) for batch in batches]  # also the warm-up
    decoding = Decoding(reference, batches, wants)
    thread = threading.Thread(target=decoding.run)
    begin = time.monotonic()
    thread.start()
    time.sleep(hold)
    end = time.monotonic()
    decoding.stop.set()
    thread.join()
    rate, _ = window(decoding.stamps, begin, end)
    restarts = [monolith_restart(checkpoint, batches[0], wants[0]) for _ in range(reps)]
    return {
        "tokens_per_s": rate,
        "restart_s": statistics.median(restarts),
        "restarts_s": restarts,
        "wants": wants,
    }


def busy_fractions(urls: dict[int, str], before: dict[int, float], seconds: float) -> dict[int, float]:
    return {o: (scrape(url)[BUSY] - before[o]) / seconds for o, url in urls.items()}


def run_drills(
    checkpoint: Path,
    batches: list[list[list[int]]],
    wants: list[list[list[int]]],
    ks: list[int],
    hold: float,
    workdir: Path,
) -> dict[str, Any]:
    """Part A: per k, the before / during / after windows of one continuously decoding client."""
    config = serving_config()
    placement = round_robin(config.moe_layers, config.num_experts, SERVERS, replication=REPLICATION)
    torch.set_num_threads(1)
    rows, fractions, step_seconds = [], [], []
    with LocalCluster(checkpoint, placement, workdir, transports=("tcp",)) as cluster:
        client = AttentionClient(
            checkpoint, placement, cluster.urls, ClientOptions(transport="tcp")
        ).connect()
        decoding = Decoding(client.decoder, batches, wants)
        thread = threading.Thread(target=decoding.run)
        try:
            decode_round(client.decoder, batches[0], [])  # warm-up
            thread.start()
            for k in ks:
                victims = list(range(1, k + 1))
                busy = {o: scrape(url)[BUSY] for o, url in cluster.urls.items()}
                begin = time.monotonic()
                time.sleep(hold)
                killed_at = time.monotonic()
                fractions.append(max(busy_fractions(cluster.urls, busy, killed_at - begin).values()))
                healthy_rate, healthy_gap = window(decoding.stamps, begin, killed_at)
                step_seconds.append(BATCH / healthy_rate)
                for ordinal in victims:
                    cluster.kill(ordinal)
                time.sleep(hold)
                restart_at = time.monotonic()
                for ordinal in victims:
                    cluster.restart(ordinal)
                ready_at = time.monotonic()
                while not set(victims) <= set(client.experts.live_servers):
                    if time.monotonic() > ready_at + 60:
                        raise RuntimeError(f"servers {victims} never rejoined the client")
                    time.sleep(0.01)
                rejoined_at = time.monotonic()
                time.sleep(hold)
                end = time.monotonic()
                degraded, _ = window(decoding.stamps, killed_at, restart_at)
                during, stall = window(decoding.stamps, killed_at, rejoined_at)
                after, _ = window(decoding.stamps, rejoined_at, end)
                rows.append(
                    {
                        "k": k, "killed": victims, "before_tokens_per_s": healthy_rate,
                        "degraded_tokens_per_s": degraded, "during_tokens_per_s": during,
                        "after_tokens_per_s": after, "stall_s": stall, "healthy_gap_s": healthy_gap,
                        "restart_to_ready_s": ready_at - restart_at,
                        "ready_to_rejoined_s": rejoined_at - ready_at,
                        "window": (begin, killed_at, restart_at, rejoined_at, end),
                        "timeline_tokens_per_s": timeline(decoding.stamps, begin, end),
                    }
                )  # fmt: skip
        finally:
            decoding.stop.set()
            if thread.is_alive():
                thread.join()
            failovers, resent = client.experts.counters.failovers, client.experts.counters.resent_entries
            client.close()
    return {
        "rows": rows,
        "expert_fraction": statistics.median(fractions),
        "step_s": statistics.median(step_seconds),
        "requests": decoding.requests,
        "failed": decoding.failed,
        "errors": decoding.errors[:3],
        "failovers": failovers,
        "resent_entries": resent,
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--degraded-s", type=float, default=2.2, help="Part B: failover state before the re-plan (drill 3's)"
    )
    p.add_argument("--fault-interval-s", type=float, default=60.0, help="Part B: time between faults")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    ks, hold, restart_reps = ([1], 2.0, 1) if args.quick else (list(range(1, K + 1)), 5.0, 3)
    config = serving_config()
    batches = [prompts(config.vocab_size, args.seed + i) for i in range(ROUNDS)]
    with tempfile.TemporaryDirectory(prefix="eaas-fault-drill-") as tmp:
        checkpoint = write_random_checkpoint(config, Path(tmp) / "ckpt", seed=1)
        mono = measure_monolith(checkpoint, batches, hold, restart_reps)
        part_a = run_drills(checkpoint, batches, mono["wants"], ks, hold, Path(tmp) / "cluster")
    results = report_part_a(part_a, mono)
    rows_b, monolith_rows = simulate(part_a["expert_fraction"], part_a["step_s"], mono["restart_s"], args)
    results += rows_b + monolith_rows
    ours = [r for r in rows_b if r["arm"] == ARMS[-1][0]]
    worst = max(r["window_loss_per_gpu"] for r in ours)
    worst_failover = max(r["failover_loss_per_gpu"] for r in ours)
    unavailable = sum(r["unavailable"] for r in rows_b)
    emit(
        "fault_drill",
        results,
        {
            "window_throughput_lost_per_lost_gpu_at_64": target(worst, 0.02, higher_is_better=False),
            "window_throughput_lost_per_lost_gpu_within_1pct": target(worst, 0.01, higher_is_better=False),
            "failover_state_lost_per_lost_gpu": target(worst_failover, 0.06, higher_is_better=False),
            "failed_requests": target(part_a["failed"] + unavailable, 0, higher_is_better=False),
        },
        args.json_out,
    )


def report_part_a(part_a: dict[str, Any], mono: dict[str, Any]) -> list[dict[str, Any]]:
    print(
        f"Part A: {SERVERS} expert servers (tcp, 1 thread, R={REPLICATION}), one attention client decoding "
        f"batch {BATCH} x {STEPS + 1} tokens without pause; monolith = the same model in one process"
    )
    print(
        f"monolith: {mono['tokens_per_s']:.0f} tok/s healthy; restart (fresh process to first token) "
        f"{mono['restart_s']:.2f} s (runs: {', '.join(f'{s:.2f}' for s in mono['restarts_s'])})"
    )
    print(
        f"{'k':>2} {'':9} {'before':>7} {'degraded':>8} {'during':>7} {'after':>7}  {'stall':>6} "
        f"{'restart':>7} {'rejoin':>6}  tok/s"
    )
    results: list[dict[str, Any]] = []
    for row in part_a["rows"]:
        begin, killed_at, _, rejoined_at, end = row.pop("window")
        rate, restart = mono["tokens_per_s"], mono["restart_s"]
        monolith = {
            "before_tokens_per_s": rate,
            "during_tokens_per_s": outage_rate(rate, killed_at, rejoined_at, killed_at, killed_at + restart),
            "after_tokens_per_s": outage_rate(rate, rejoined_at, end, killed_at, killed_at + restart),
            "window_tokens_per_s": outage_rate(rate, begin, end, killed_at, killed_at + restart),
            "lost_in_flight_requests": BATCH,
        }
        ours_window = (
            row["before_tokens_per_s"] * (killed_at - begin)
            + row["during_tokens_per_s"] * (rejoined_at - killed_at)
            + row["after_tokens_per_s"] * (end - rejoined_at)
        ) / (end - begin)
        print(
            f"{row['k']:>2} {'eaas':9} {row['before_tokens_per_s']:7.0f} {row['degraded_tokens_per_s']:8.0f} "
            f"{row['during_tokens_per_s']:7.0f} {row['after_tokens_per_s']:7.0f}  {row['stall_s']:5.2f}s "
            f"{row['restart_to_ready_s']:6.2f}s {row['ready_to_rejoined_s']:5.2f}s  "
            f"(window {ours_window:.0f})"
        )
        print(
            f"{'':>2} {'monolith':9} {rate:7.0f} {'':>8} {monolith['during_tokens_per_s']:7.0f} "
            f"{monolith['after_tokens_per_s']:7.0f}  {restart:5.2f}s  "
            f"(window {monolith['window_tokens_per_s']:.0f}; "
            f"{BATCH} requests in flight lost)"
        )
        results.append({"part": "A", "system": "eaas", "window_tokens_per_s": ours_window, **row})
        results.append({"part": "A", "system": "monolith", "k": row["k"], "restart_s": restart, **monolith})
    print(
        f"failed requests: {part_a['failed']} of {part_a['requests']} "
        f"(errors: {part_a['errors'] or 'none'}); "
        f"failovers {part_a['failovers']}, re-sent entries {part_a['resent_entries']}"
    )
    print(
        f"per-step cost: {part_a['step_s'] * 1e3:.1f} ms a step, "
        f"expert fraction f = {part_a['expert_fraction']:.2f} "
        "(busiest server's busy fraction)"
    )
    results.append(
        {
            "part": "A",
            "requests": part_a["requests"],
            "failed_requests": part_a["failed"],
            "failovers": part_a["failovers"],
            "resent_entries": part_a["resent_entries"],
            "step_s": part_a["step_s"],
            "expert_fraction": part_a["expert_fraction"],
            "monolith_tokens_per_s": mono["tokens_per_s"],
            "monolith_restart_s": mono["restart_s"],
        }
    )
    return results


def simulate(
    expert_fraction: float, step_s: float, restart_s: float, args: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Part B: the 64-server drill, the planners without failure awareness (plain packing, healthy objective)
    against the failure-aware packing with and without the failover bound in the objective, on the
    same load and faults, and the monolith's windows."""
    load = simulation_load(args.seed)
    horizon = max(1, round(args.fault_interval_s / step_s))  # a placement serves until the next fault
    print(
        f"\nPart B: {SIM_SERVERS} servers, DeepSeek-V3 shape ({len(SIM_LAYERS)} x {SIM_EXPERTS}, "
        f"R={SIM_REPLICATION}, "
        f"{SLOTS_PER_LAYER} slots/layer), f = {expert_fraction:.2f}; faults one at a time every "
        f"{args.fault_interval_s:.0f} s, failover state for {args.degraded_s:.1f} s, then `recover`; "
        f"the planners plan for {horizon} steps (the fault interval at Part A's {step_s * 1e3:.0f} ms step)"
    )
    rows: list[dict[str, Any]] = []
    faults = random.Random(args.seed).sample(range(SIM_SERVERS), 4)  # the same in both arms
    for arm, failure_aware, cost in ARMS:
        start = simulation_start(load, failure_aware=failure_aware, horizon_steps=horizon, cost=cost)
        healthy = moe_tokens(start, load)
        after = failover_loads(start, load).sum(axis=1) / healthy  # [S] every single failure
        arm_rows = drill(
            start, load, faults, expert_fraction, args.degraded_s, args.fault_interval_s, horizon, cost
        )
        print(
            f"{arm}: after any one server's failure the busiest servers carry {after.mean():.3f}x "
            f"(worst {after.max():.3f}x) the healthy tokens"
        )
        print(
            f"{'lost':>4} {'failover':>9} {'re-planned':>10} {'window':>7}  "
            f"{'lost per lost GPU: failover':>28} {'re-planned':>10} {'window':>7} {'loads':>6}"
        )
        for row in arm_rows:
            print(
                f"{row['lost_gpus']:>4} {row['failover_throughput']:9.3f} "
                f"{row['replanned_throughput']:10.3f} {row['window_throughput']:7.3f}  "
                f"{row['failover_loss_per_gpu']:28.2%} "
                f"{row['replanned_loss_per_gpu']:10.2%} {row['window_loss_per_gpu']:7.2%} "
                f"{row['recover_loads']:>6}"
            )
        rows += [
            {"arm": arm, "horizon_steps": horizon, "worst_single_failure": float(after.max()), **row}
            for row in arm_rows
        ]
    monolith_rows = []
    for name, seconds in {"monolith (measured restart)": restart_s, **PUBLISHED_RESTART_S}.items():
        average = monolith_window(seconds, args.fault_interval_s)
        print(
            f"{name}: 0 for {seconds:.1f} s per fault; window throughput {average:.3f} "
            f"(lost {1 - average:.1%} per fault)"
        )
        monolith_rows.append(
            {"part": "B", "system": name, "restart_s": seconds, "window_throughput": average}
        )
    return [{"part": "B", "system": "eaas", **row} for row in rows], monolith_rows


if __name__ == "__main__":
    main()
