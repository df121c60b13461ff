"""Elasticity: one-GPU-at-a-time scaling against whole deployment units over a diurnal day.

Two parts, one run.

**Part A, measured here: one expert server's p99 time per output token against its load.** A
``LocalCluster`` with one expert-server process (tcp, one thread) hosting every expert of the
serving benchmarks' random mixtral-family model (``_load.serving_config``), behind an ``eaas
attention-client`` process (continuous batching). ``_load``'s seeded Poisson generator streams
requests at a few rates (``RATES``, ``QUICK_RATES``; 15 s, quick 6 s, of arrivals each). Measured
per rate: the server's token rate (``eaas_expert_server_tokens_total``, one token per MoE layer it
computes) and busy fraction (``eaas_expert_server_step_seconds_sum`` over wall time), both from
its ``/metrics``, and the p99 over requests of the time per output token after the first (TPOT).
The SLO is p99 TPOT <= ``--slo-tpot-ms`` (100 ms). One measurement on this shared 2-core machine
is noisy (a rate can read slower than a higher one; one pause of the machine puts a p99 far off),
so Part A runs ``--repeats`` times (3, quick 2) with fresh processes and seeds, and the
calibration is a monotone model of what is stable, not one run's points: per offered rate the
median over the repeats of the token rate, p99 TPOT and busy fraction, fitted non-decreasing
(``isotonic``, the operator's own fit: a server does not get faster with more load). The
*capacity at SLO* is where that fit crosses the SLO (interpolated). Each repeat's own crossing is
printed as the spread, and the run fails loudly (``IncoherentCalibration``) when the fit does not
cross the SLO (every rate met it, or none did) or no majority of the repeats has its own capacity
within 25% of it (both of two in ``--quick``).

**Part B, simulated: a day at scale.** Demand ``D`` is in capacities at SLO (so ``D`` servers serve
it at the SLO's edge). ``n`` ready servers share it evenly: each carries ``D / n`` capacities,
i.e. that times the measured capacity in routed tokens/s, and its p99 TPOT is the fitted curve
there (``Calibration.tpot_at``) times 5% lognormal noise (a 30 s window's p99 is a noisy
reading); every step with ``D > n`` (TPOT above the SLO) is an SLO-violating step.

- The trace (``diurnal_trace``): 24 h in 10 s steps (the operator's resync period), ``1 + a cos(2
  pi (h - 14) / 24) + b cos(4 pi (h - 14) / 24)`` (h = hour) times ``1 + noise`` (AR(1), 0.98 per
  step, 3% deviation, ``numpy.random.default_rng(seed)``), scaled to peak at ``--peak-servers``
  (60). ``peaked`` (a = 0.6, b = 0.2: a sharp afternoon peak over a broad night trough; peak /
  trough 3.6, mean / peak 0.52 with seed 0) carries the first target; ``sinusoid`` (a = 0.5, b =
  0: peak / trough 3.5, mean / peak 0.62) the second. Against a fixed deployment no policy can
  save more than 1 - mean / peak, so the shape decides most of the figure. A sweep over peaks of
  24-96 servers shows how much the peak's place between unit multiples matters.
- **Per-GPU scaling (ours)**: the operator's built-in autoscaler (``eaas.operator.autoscaler``)
  with its default metric, ``tokenRate`` with a learned target: called every step as the operator
  calls it, with the ready servers' mean routed tokens/s, the clients' p99 TPOT, the pool's
  replicas (ready or starting) and the ready ones. It learns the capacity at the SLO from those
  readings (``Capacity``) and aims at ``autoscaler.HEADROOM`` (0.9) of it; nothing in the policy
  is set from Part A. The autoscaled policies run two days: the day before (the same shape,
  another noise seed), starting from a pool sized for the peak, then the measured day, so the
  figure is a pool's that has served a day; ``per-gpu-day-1`` is ours on that first day, learning.
  The CRD's default windows: scale up at once (servers still starting count as idle, so a
  scale-up is not compounded while they load), scale down to the highest recommendation of 300 s.
  Added servers serve ``--ready-seconds`` later (the time a GPU server needs to load its experts,
  120 s; the local process's start time is printed for comparison). ``per-gpu-120s`` is ours with
  a scale-up window as long as that (what the busy policy needed before the fix that counts
  starting servers as idle). ``minReplicas`` = the
  R-based floor ``--min-servers`` (17: DeepSeek-V3's routed experts in fp8, 58 x 256 x 3 x 7168 x
  2048 bytes = 654 GB, twice (R = 2), on 80 GB GPUs).
- **Fixed deployment units** ``fixed-8``/``-16``/``-32``: whole N-GPU units (an EP group as
  SGLang/vLLM run it) sized for the trace's peak at the SLO's edge (no headroom) and held all day;
  ``fixed-peak`` the same at one-GPU granularity.
- **Scaled units** ``units-8``/``-16``/``-32``: the same autoscaler, spec and windows, its answer
  rounded up to whole units, each ready after ``--ready-seconds``. This isolates granularity, the
  setting of the paper's figure: EaaS §5.3 serves 5120 of 8192 traffic on 40 GPUs where
  32-GPU-unit systems stay at 64, "up to 37.5%" saved at that operating point.
  ``max_instant_saving`` reports that kind of figure (the largest one-step saving of the day).
- ``per-gpu-busy``: the previous default, ``metric: busy`` at ``BUSY_HEADROOM`` (0.85) x the busy
  fraction measured at the capacity (Part A's busy curve, made non-decreasing): it shows what a
  signal that is not monotone in the load does to the pool's size.

Targets: on ``peaked``, per-GPU scaling saves >= 37.5% of the GPU-hours of
fixed 8-GPU units (the finest, so hardest, fixed units) with no more SLO-violating steps; on
``sinusoid`` >= 25%; the most GPUs at once within ceil(1.15 x the demand peak).

Not modelled: the attention pool (it scales on its own), placement changes (an added server's
share of the load is assumed even at once), collectives' warm-up for units; removals are immediate.

Usage: python benchmarks/elasticity.py [--quick] [--repeats N] [--peak-servers N] [--ready-seconds S]
    [--part-a-from EARLIER.json] [--json-out PATH]

``--part-a-from`` runs Part B on the Part A measurements an earlier run recorded in its
``--json-out`` (its commit and device are printed): the simulation again, on the same
measurements, at this commit.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import numpy as np
from _common import emit, parser, target
from _load import percentile, run_mode, serving_config, start_client, workload

from eaas.operator.api.moeservice import AutoscalingSpec
from eaas.operator.autoscaler import HEADROOM, Autoscaler, isotonic
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import write_random_checkpoint
from eaas.runtime.placement import round_robin

STEP_S = 10  # the operator's resync period (EAAS_OPERATOR_RESYNC_SECONDS): one autoscaler call per step
DAY_S = 24 * 3600
BUSY_HEADROOM = 0.85  # per-gpu-busy: the target busy fraction, as a fraction of u_slo
RATES = (1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0)  # requests/s offered in Part A
QUICK_RATES = (1.0, 4.0, 8.0, 12.0, 16.0, 24.0)  # 24: 6 s windows need a clear miss of the SLO
UNITS = (8, 16, 32)
AGREEMENT = 0.25  # a calibration stands when most repeats' own capacities are within this of it


# --- Part B: the simulation (pure) --------------------------------------------------------------------
SHAPES = {  # name: (first-harmonic amplitude, second-harmonic amplitude), both peaking at 14:00
    "peaked": (0.6, 0.2),  # a sharp afternoon peak over a broad night trough (the targets' trace)
    "sinusoid": (0.5, 0.0),  # a plain sinusoid (reported as a sensitivity check)
}


def diurnal_trace(
    peak: float, seed: int, shape: str = "peaked", step_s: int = STEP_S, day_s: int = DAY_S
) -> np.ndarray:
    """Demand per step [S] (S = day_s / step_s), in capacities at SLO, maximum exactly ``peak``:
    ``1 + a cos(2 pi (h - 14) / 24) + b cos(4 pi (h - 14) / 24)`` (h = hour of day, (a, b) =
    ``SHAPES[shape]``) times ``1 + noise``, the noise AR(1) (0.98 per step, 3% stationary
    deviation) from ``numpy.random.default_rng(seed)``."""
    first, second = SHAPES[shape]
    hours = np.arange(0, day_s, step_s) / 3600.0  # [S]
    phase = 2 * np.pi * (hours - 14.0) / 24.0  # [S]
    mean_shape = 1.0 + first * np.cos(phase) + second * np.cos(2 * phase)  # [S]
    rng = np.random.default_rng(seed)
    phi, sigma = 0.98, 0.03
    shocks = rng.normal(0.0, sigma * math.sqrt(1 - phi * phi), size=hours.size)  # [S]
    noise = np.empty(hours.size)  # [S]
    level = rng.normal(0.0, sigma)
    for i, shock in enumerate(shocks):
        level = phi * level + shock
        noise[i] = level
    demand = mean_shape * (1.0 + noise)  # [S]
    return np.asarray(peak * demand / demand.max())


class IncoherentCalibration(Exception):
    """Part A's measurements cannot calibrate the simulation (the message says why)."""


@dataclass(frozen=True)
class Calibration:
    """One server against its load, from Part A. ``loads`` are server token rates over the capacity
    at the SLO (so the SLO is met up to 1.0 and missed beyond). ``tpot``: the p99 time per output
    token there, fitted non-decreasing (``isotonic``, the operator's own fit), interpolated, flat
    below the first point and continued along the last rising segment beyond the last. ``busy``: the
    busy fraction there, made non-decreasing, proportional to the load (capped at 1) past the last
    point (only the ``per-gpu-busy`` row reads it)."""

    loads: tuple[float, ...]  # [P] increasing
    busy: tuple[float, ...]  # [P]
    tpot: tuple[float, ...] = ()  # [P] seconds, non-decreasing

    def busy_at(self, load: float) -> float:
        busy = np.maximum.accumulate(np.asarray(self.busy))  # [P]
        if load > self.loads[-1]:
            return min(1.0, float(busy[-1]) * load / self.loads[-1])
        return float(np.interp(load, (0.0, *self.loads), (0.0, *busy)))

    def tpot_at(self, load: float) -> float:
        loads, tpot = np.asarray(self.loads), np.asarray(self.tpot)  # [P]
        if load <= loads[-1]:
            return float(np.interp(load, loads, tpot))
        rising = [i for i in range(1, loads.size) if tpot[i] > tpot[i - 1]]
        i = rising[-1] if rising else loads.size - 1
        slope = (tpot[i] - tpot[i - 1]) / (loads[i] - loads[i - 1]) if rising else tpot[-1] / loads[-1]
        return float(tpot[-1] + slope * (load - loads[-1]))

    @property
    def u_slo(self) -> float:
        """The busy fraction at the capacity at SLO (load 1.0)."""
        return self.busy_at(1.0)


def crossing(rates: list[float], tpot: list[float], slo_s: float) -> float:
    """The token rate where the non-decreasing fit of p99 TPOT against the rate crosses the SLO
    (interpolated); raises ``IncoherentCalibration`` when no rate met it or every rate did."""
    order = np.argsort(rates)
    xs = np.asarray(rates)[order]  # [P]
    fitted = isotonic([float(tpot[i]) for i in order], [1] * len(order))  # [P]
    above = np.nonzero(fitted > slo_s)[0]
    if above.size == 0:
        raise IncoherentCalibration(
            f"every rate met the SLO (p99 TPOT at most {fitted[-1] * 1e3:.0f} ms): the capacity is beyond "
            "the rates measured; raise them"
        )
    first = int(above[0])
    if first == 0:
        raise IncoherentCalibration(
            f"no rate met the SLO (p99 TPOT {fitted[0] * 1e3:.0f} ms already at {xs[0]:.0f} tok/s): "
            "lower the rates, or is the machine busy?"
        )
    x0, x1, y0, y1 = xs[first - 1], xs[first], fitted[first - 1], fitted[first]
    return float(x0 + (slo_s - y0) * (x1 - x0) / (y1 - y0))


def calibrate(repeats: list[list[dict[str, Any]]], slo_s: float) -> dict[str, Any]:
    """Part A's repeats (rows per rate) made one calibration: per offered rate the median over the
    repeats of the server's token rate, p99 TPOT and busy fraction (one disturbed measurement, a
    pause of the shared machine, moves no median of three), the capacity at the SLO where the
    medians' non-decreasing fit crosses it, each repeat's own capacity for the spread, and the
    curves in capacities. Raises ``IncoherentCalibration`` when the medians do not cross the SLO,
    or no majority of the repeats has its own capacity within ``AGREEMENT`` of theirs."""
    rates = sorted({row["rate_rps"] for rows in repeats for row in rows})
    medians = []
    for rate in rates:
        rows = [row for rows in repeats for row in rows if row["rate_rps"] == rate and row["failed"] == 0]
        if rows:
            medians.append(
                {
                    key: statistics.median(row[key] for row in rows)
                    for key in ("server_tokens_per_s", "tpot_p99_s", "busy_fraction")
                }
            )
    capacity = crossing(
        [r["server_tokens_per_s"] for r in medians], [r["tpot_p99_s"] for r in medians], slo_s
    )
    each: list[tuple[float, float]] = []  # per repeat: its capacity, or the bounds it gives one
    for rows_of in repeats:
        rates, tpot = [r["server_tokens_per_s"] for r in rows_of], [r["tpot_p99_s"] for r in rows_of]
        try:
            one = crossing(rates, tpot, slo_s)
            each.append((one, one))
        except IncoherentCalibration:  # the fit met the SLO at every rate (at least the highest) or at none
            top = float(isotonic([t for _, t in sorted(zip(rates, tpot, strict=True))], [1] * len(rates))[-1])
            each.append((max(rates), math.inf) if top <= slo_s else (0.0, min(rates)))
    low, high = (1.0 - AGREEMENT) * capacity, (1.0 + AGREEMENT) * capacity
    agreeing = [bounds for bounds in each if bounds[0] <= high and bounds[1] >= low]
    if 2 * len(agreeing) <= len(repeats):
        raise IncoherentCalibration(
            f"only {len(agreeing)} of {len(repeats)} repeats' capacities at the SLO ({spread(each)} tok/s) "
            f"are within {AGREEMENT:.0%} of the medians' {capacity:.0f}: the machine is too noisy for a "
            "calibration"
        )
    ordered = sorted(medians, key=lambda r: r["server_tokens_per_s"])
    loads = tuple(r["server_tokens_per_s"] / capacity for r in ordered)
    fitted = isotonic([r["tpot_p99_s"] for r in ordered], [1] * len(ordered))
    calibration = Calibration(loads, tuple(r["busy_fraction"] for r in ordered), tuple(fitted.tolist()))
    return {"capacity_tokens_per_s": capacity, "repeat_capacities": spread(each), "calibration": calibration}


def spread(each: list[tuple[float, float]]) -> str:
    """The repeats' own capacities as text: a value, ">= x" (every rate met the SLO) or "< x"."""
    return ", ".join(
        f"{low:.0f}" if low == high else (f">= {low:.0f}" if math.isinf(high) else f"< {high:.0f}")
        for low, high in each
    )


@dataclass
class Day:
    """One policy's day: GPUs held and ready servers per step [S], and the SLO-violating steps."""

    name: str
    gpus: np.ndarray  # [S] GPUs allocated (ready or starting)
    ready: np.ndarray  # [S] GPUs serving
    violations: int

    def gpu_hours(self, step_s: int = STEP_S) -> float:
        return float(self.gpus.sum()) * step_s / 3600.0


def fixed(name: str, demand: np.ndarray, unit: int, floor: int) -> Day:
    """Whole ``unit``-GPU units sized for the trace's peak, held all day."""
    gpus = unit * math.ceil(max(float(demand.max()), floor) / unit - 1e-9)
    held = np.full(demand.size, gpus)
    return Day(name, held, held, int((demand > held + 1e-9).sum()))


def autoscaled(
    name: str,
    demand: np.ndarray,
    unit: int,
    floor: int,
    spec: AutoscalingSpec,
    calibration: Calibration,
    ready_s: float,
    capacity_tps: float = 1000.0,
    noise_seed: int = 0,
    start: int | None = None,
) -> Day:
    """The built-in autoscaler called every step as the operator calls it, its answer rounded up to
    whole ``unit``-GPU units (1: per GPU). It reads, for ``metric: tokenRate``, the ready servers'
    mean routed tokens/s (load x ``capacity_tps``) and the clients' p99 TPOT (``Calibration.tpot_at``
    the load, times lognormal noise of 5%: a 30 s window's p99 is a noisy reading), for ``busy``
    their busy fraction; and the pool's replicas (ready or starting) and the ready ones. Added units
    serve ``ready_s`` later; removals take the newest starting units first and are immediate. The
    day starts with ``start`` GPUs (default: the floor, rounded up to units), all serving."""
    autoscaler = Autoscaler()
    noise = np.exp(np.random.default_rng(noise_seed).normal(0.0, 0.05, demand.size))  # [S]
    ready = unit * math.ceil((start if start is not None else floor) / unit)
    starting: list[tuple[float, int]] = []  # (ready at s, GPUs), oldest first
    gpus_per_step, ready_per_step, violations = [], [], 0
    for step, load in enumerate(demand):
        now = step * STEP_S
        ready += sum(g for at, g in starting if at <= now)
        starting = [(at, g) for at, g in starting if at > now]
        per_server = float(load) / ready
        violations += int(load > ready + 1e-9)
        current = ready + sum(g for _, g in starting)
        if spec.metric == "tokenRate":
            value = round(per_server * capacity_tps)
        else:
            value = round(calibration.busy_at(per_server) * 1000)
        tpot_us = round(1e6 * calibration.tpot_at(per_server) * noise[step])
        wanted = autoscaler.recommend(now, current, value, spec, ready, tpot_us)
        wanted = unit * math.ceil(wanted / unit)
        while wanted < current and starting:
            _, g = starting.pop()
            current -= g
        if wanted > current:
            starting.append((now + ready_s, wanted - current))
        elif wanted < current:
            ready -= current - wanted
        gpus_per_step.append(ready + sum(g for _, g in starting))
        ready_per_step.append(ready)
    return Day(name, np.array(gpus_per_step), np.array(ready_per_step), violations)


def one_day(day: Day, demand: np.ndarray, which: int, name: str | None = None) -> Day:
    """Day `which` (0 or 1) of a two-day run over `demand` [2S], its violations counted."""
    steps = slice(which * (demand.size // 2), (which + 1) * (demand.size // 2))
    ready = day.ready[steps]
    return Day(name or day.name, day.gpus[steps], ready, int((demand[steps] > ready + 1e-9).sum()))


def saving(ours: Day, baseline: Day) -> float:
    """Fraction of the baseline's GPU-hours that ours does not use."""
    return 1.0 - ours.gpu_hours() / baseline.gpu_hours()


def max_instant_saving(ours: Day, baseline: Day) -> float:
    """The largest one-step saving over the day (the kind of figure "up to 37.5%" is)."""
    return float((1.0 - ours.gpus / baseline.gpus).max())


def simulate(
    demand: np.ndarray,
    floor: int,
    calibration: Calibration,
    ready_s: float,
    slo_ms: int = 100,
    before: np.ndarray | None = None,
) -> tuple[Day, list[Day]]:
    """(per-GPU scaling, baselines) over `demand` [S]. Every autoscaled policy runs the day before
    first (`before` [S], default `demand` itself), from a pool sized for its peak, and is measured
    on the second day: it learned its target on the first, as a pool that has served for a day
    has (``per-gpu-day-1`` is ours on that first day, learning). Baselines: fixed units, fixed
    per-GPU peak sizing, autoscaled units, ours with a scale-up window of `ready_s`, and the
    previous default policy (``busy``, target ``BUSY_HEADROOM`` x ``u_slo``); all with the CRD's
    default windows unless named."""
    spec = AutoscalingSpec(
        mode="builtin", min_replicas=floor, max_replicas=4096, slo_time_per_output_token_millis=slo_ms
    )
    slo_s = slo_ms / 1e3
    if not math.isclose(calibration.tpot_at(1.0), slo_s, rel_tol=0.02):
        raise IncoherentCalibration(
            f"the curve's p99 TPOT at load 1.0 is {calibration.tpot_at(1.0)} s, not the SLO"
        )
    days = np.concatenate([before if before is not None else demand, demand])  # [2S]
    peak = math.ceil(float(days.max()) - 1e-9)

    def run(name: str, unit: int, scaling: AutoscalingSpec) -> Day:
        return autoscaled(name, days, unit, floor, scaling, calibration, ready_s, start=max(peak, floor))

    both = run("per-gpu", 1, spec)
    ours, first = one_day(both, days, 1), one_day(both, days, 0, "per-gpu-day-1")
    baselines = [fixed(f"fixed-{unit}", demand, unit, floor) for unit in UNITS]
    baselines.append(fixed("fixed-peak", demand, 1, floor))
    for unit in UNITS:
        baselines.append(one_day(run(f"units-{unit}", unit, spec), days, 1))
    windowed = spec.model_copy(update={"scale_up_stabilization_seconds": math.ceil(ready_s)})
    baselines.append(one_day(run(f"per-gpu-{math.ceil(ready_s)}s", 1, windowed), days, 1))
    busy = spec.model_copy(
        update={
            "metric": "busy",
            "target_utilization_milli": max(1, math.floor(1000 * BUSY_HEADROOM * calibration.u_slo)),
        }
    )
    baselines.append(one_day(run("per-gpu-busy", 1, busy), days, 1))
    baselines.append(first)
    return ours, baselines


# --- Part A: the capacity of one expert server (measured) ---------------------------------------------
def scrape(url: str) -> dict[str, float]:
    """The expert server's busy seconds and tokens so far, from its /metrics."""
    host, port = url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=10)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    values = {}
    for name in ("eaas_expert_server_step_seconds_sum", "eaas_expert_server_tokens_total"):
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else 0.0
    return values


def measure_capacity(rates: tuple[float, ...], seconds: float, seed: int) -> dict[str, Any]:
    """One repeat of Part A: per-rate rows (server token rate and busy fraction from its /metrics,
    p99 TPOT over the requests) and the server's start time."""
    config = serving_config()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_random_checkpoint(config, Path(tmp) / "ckpt", seed=1)
        placement = round_robin(config.moe_layers, config.num_experts, 1, replication=1)
        started = time.monotonic()
        with LocalCluster(checkpoint, placement, Path(tmp) / "cluster", transports=("tcp",)) as cluster:
            start_s = time.monotonic() - started
            server_url = cluster.urls[0]
            process, url = start_client("continuous", checkpoint, cluster, Path(tmp))
            try:
                run_mode("continuous", True, url, workload(4, 4.0, seed + 1000, config.vocab_size))  # warm-up
                for index, rate in enumerate(rates):
                    load = workload(max(4, round(rate * seconds)), rate, seed + index, config.vocab_size)
                    before, begin = scrape(server_url), time.monotonic()
                    results = run_mode("continuous", True, url, load)
                    after, wall = scrape(server_url), time.monotonic() - begin
                    done = [r for r in results if "error" not in r]
                    tpot = [(r["end"] - r["first"]) / (r["count"] - 1) for r in done if r["count"] > 1]
                    tokens = "eaas_expert_server_tokens_total"
                    busy = "eaas_expert_server_step_seconds_sum"
                    rows.append(
                        {
                            "rate_rps": rate,
                            "requests": len(results),
                            "failed": len(results) - len(done),
                            "server_tokens_per_s": (after[tokens] - before[tokens]) / wall,
                            "busy_fraction": (after[busy] - before[busy]) / wall,
                            "output_tokens_per_s": sum(r["count"] for r in done) / wall,
                            "tpot_p50_s": statistics.median(tpot),
                            "tpot_p99_s": percentile(tpot, 0.99),
                        }
                    )
            finally:
                process.terminate()
                process.wait(timeout=30)
    return {"rows": rows, "server_start_s": start_s}


def policy_rows(ours: Day, baselines: list[Day], **extra: Any) -> list[dict[str, Any]]:
    """One result row per policy; the baselines' with ours' saving against them."""
    rows = []
    for day in (ours, *baselines):
        row = {
            **extra,
            "policy": day.name,
            "gpu_hours": day.gpu_hours(),
            "min_gpus": int(day.gpus.min()),
            "max_gpus": int(day.gpus.max()),
            "violating_steps": day.violations,
        }
        if day is not ours:
            row["saving"] = saving(ours, day)
            row["max_instant_saving"] = max_instant_saving(ours, day)
        rows.append(row)
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--peak-servers", type=float, default=60.0, help="the trace's peak, in servers at SLO")
    p.add_argument("--min-servers", type=int, default=17, help="the R-based floor (minReplicas)")
    p.add_argument("--ready-seconds", type=float, default=120.0, help="an added server's time to serve")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="the SLO: p99 time per output token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, help="Part A's repeats (default 3; --quick 2)")
    p.add_argument(
        "--part-a-from",
        type=Path,
        help="take Part A's measurements from this earlier run's --json-out instead of measuring",
    )
    args = p.parse_args()
    rates, seconds = (QUICK_RATES, 6.0) if args.quick else (RATES, 15.0)
    repeats = args.repeats or (2 if args.quick else 3)
    slo_s = args.slo_tpot_ms / 1e3

    print("Part A: one expert server (tcp, 1 thread) behind one attention client, streamed Poisson load")
    print(
        f"{'repeat':>6} {'req/s':>6} {'server tok/s':>12} {'busy':>6} {'out tok/s':>9} {'TPOT p50':>9} "
        f"{'p99':>8}  failed"
    )
    measured: list[list[dict[str, Any]]] = []
    results: list[dict[str, Any]] = []
    recorded: list[dict[str, Any]] = []
    if args.part_a_from is not None:
        earlier = json.loads(args.part_a_from.read_text())
        recorded = [r for r in earlier["results"] if r.get("part") == "A" and "repeat" in r]
        repeats = max(r["repeat"] for r in recorded)
        print(f"(measured by {earlier['commit']} on {earlier['device']}: {args.part_a_from})")
    for repeat in range(repeats):
        part_a: dict[str, Any]
        if recorded:
            rows = [
                {k: v for k, v in r.items() if k not in ("part", "repeat")}
                for r in recorded
                if r["repeat"] == repeat + 1
            ]
            part_a = {"rows": rows, "server_start_s": math.nan}
        else:
            part_a = measure_capacity(rates, seconds, args.seed + 100 * repeat)
        measured.append(part_a["rows"])
        for row in part_a["rows"]:
            print(
                f"{repeat + 1:6d} {row['rate_rps']:6.1f} {row['server_tokens_per_s']:12.0f} "
                f"{row['busy_fraction']:6.2f} {row['output_tokens_per_s']:9.1f} "
                f"{row['tpot_p50_s'] * 1e3:7.1f}ms {row['tpot_p99_s'] * 1e3:6.1f}ms  {row['failed']}"
            )
            results.append({"part": "A", "repeat": repeat + 1, **row})
        print(f"       server start to ready {part_a['server_start_s']:.1f} s")
    try:
        fit = calibrate(measured, slo_s)
    except IncoherentCalibration as error:
        raise SystemExit(f"Part A cannot calibrate the simulation: {error}") from error
    calibration: Calibration = fit["calibration"]
    capacity = fit["capacity_tokens_per_s"]
    each = fit["repeat_capacities"]
    print(
        f"SLO p99 TPOT <= {args.slo_tpot_ms:.0f} ms: capacity {capacity:.0f} server tok/s (the medians "
        f"per rate over the repeats, fitted non-decreasing, crossing the SLO; per repeat: {each}), busy "
        f"fraction there u_slo = {calibration.u_slo:.2f}"
    )
    results.append(
        {
            "part": "A",
            "slo_tpot_p99_s": slo_s,
            "capacity_tokens_per_s": capacity,
            "repeat_capacities": each,
            "u_slo": calibration.u_slo,
        }
    )

    print(
        f"\nPart B: 24 h (after a first day, from a pool sized for the peak, on which the policy learns), "
        f"{STEP_S} s steps, floor {args.min_servers} servers; metric tokenRate, target {HEADROOM:.2f} x the "
        f"capacity it learns at the SLO; added servers ready after {args.ready_seconds:.0f} s"
    )
    by_shape: dict[str, tuple[Day, list[Day]]] = {}
    for shape in SHAPES:
        demand = diurnal_trace(args.peak_servers, args.seed, shape)
        before = diurnal_trace(args.peak_servers, args.seed + 1, shape)
        ours, baselines = simulate(
            demand, args.min_servers, calibration, args.ready_seconds, round(args.slo_tpot_ms), before
        )
        by_shape[shape] = (ours, baselines)
        trace = {
            "shape": shape,
            "peak": float(demand.max()),
            "trough": float(demand.min()),
            "mean": float(demand.mean()),
            "peak_expert_tokens_per_s": float(demand.max()) * capacity,
        }
        print(
            f"\ntrace {shape!r}: demand peak {trace['peak']:.1f} / trough {trace['trough']:.1f} / mean "
            f"{trace['mean']:.1f} servers at SLO (peak/trough {trace['peak'] / trace['trough']:.2f}, "
            f"mean/peak {trace['mean'] / trace['peak']:.2f}; peak {trace['peak_expert_tokens_per_s']:,.0f} "
            f"expert tok/s)"
        )
        print(
            f"{'policy':>13} {'GPU-hours':>9} {'min':>4} {'max':>4} {'violating steps':>15} {'ours saves':>9}"
        )
        rows = policy_rows(ours, baselines, part="B", **trace)
        for row in rows:
            shown = f"{row['saving']:10.1%}" if "saving" in row else f"{'':>10}"
            print(
                f"{row['policy']:>13} {row['gpu_hours']:9.1f} {row['min_gpus']:4d} {row['max_gpus']:4d} "
                f"{row['violating_steps']:15d} {shown}"
            )
        results += rows

    # Where the peak falls against the unit sizes decides much: the same policies over many peaks.
    peaks = range(24, 97, 24 if args.quick else 8)
    sweep: dict[str, list[float]] = {}
    for peak in peaks:
        ours, baselines = simulate(
            diurnal_trace(peak, args.seed),
            args.min_servers,
            calibration,
            args.ready_seconds,
            round(args.slo_tpot_ms),
            diurnal_trace(peak, args.seed + 1),
        )
        for day in baselines:
            sweep.setdefault(day.name, []).append(saving(ours, day))
    print(f"\n'peaked' trace, peaks {peaks.start}..{peaks.stop - 1} step {peaks.step}: ours saves on average")
    for name, savings in sweep.items():
        print(
            f"{name:>13} {statistics.mean(savings):6.1%}  (min {min(savings):6.1%}, max {max(savings):6.1%})"
        )
        results.append(
            {"part": "B sweep", "policy": name, "peaks": list(peaks), "mean_saving": statistics.mean(savings)}
        )

    def against_fixed_8(shape: str) -> tuple[Day, Day]:
        ours, baselines = by_shape[shape]
        return ours, next(day for day in baselines if day.name == "fixed-8")

    ours, unit8 = against_fixed_8("peaked")
    sinusoid, sinusoid_unit8 = against_fixed_8("sinusoid")
    emit(
        "elasticity",
        results,
        {
            "gpu_hours_saved_vs_fixed_unit_8": target(saving(ours, unit8), 0.375),
            "extra_violating_steps_vs_fixed_unit_8": target(
                ours.violations - unit8.violations, 0, higher_is_better=False
            ),
            "sinusoid_gpu_hours_saved_vs_fixed_unit_8": target(saving(sinusoid, sinusoid_unit8), 0.25),
            "most_gpus_over_demand_peak": target(
                float(ours.gpus.max()) / math.ceil(args.peak_servers * 1.15 - 1e-9),
                1.0,
                higher_is_better=False,
            ),
        },
        args.json_out,
    )


if __name__ == "__main__":
    main()
