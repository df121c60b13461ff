"""Elasticity: one-GPU-at-a-time scaling against whole deployment units over a diurnal day.

Two parts, one run.

**Part A, measured here: the capacity of one expert server.** A ``LocalCluster`` with one
expert-server process (tcp, one thread) hosting every expert of the serving benchmarks' random
mixtral-family model (``_load.serving_config``), behind an ``eaas attention-client`` process
(continuous batching). ``_load``'s seeded Poisson generator streams requests at a few rates
(``RATES``, ``QUICK_RATES``; 15 s, quick 6 s, of arrivals each). Measured per rate: the server's
token rate (``eaas_expert_server_tokens_total``, one token per MoE layer it computes) and busy
fraction (``eaas_expert_server_step_seconds_sum`` over wall time: what its heartbeat reports as
``utilizationMilli``), both from its ``/metrics``, and the p99 over requests of the time per
output token after the first (TPOT). The SLO is p99 TPOT <= ``--slo-tpot-ms`` (100 ms). The
*capacity at SLO* is the highest measured server token rate whose p99 TPOT meets the SLO, and
``u_slo`` the busy fraction there. The measured (load, busy) points make the busy curve the
simulation uses (``Calibration``). Also measured: the server process's start-to-ready time.

**Part B, simulated: a day at scale, calibrated by Part A.** Demand ``D`` is in capacities at SLO
(so ``D`` servers serve it at the SLO's edge; its expert tokens/s = ``D`` x the capacity). ``n``
ready servers share it evenly: each runs at ``Calibration.busy_at(D / n)`` and every step with
``D > n`` counts as an SLO-violating step.

- The trace (``diurnal_trace``): 24 h in 10 s steps (the operator's resync period), ``1 + a cos(2
  pi (h - 14) / 24) + b cos(4 pi (h - 14) / 24)`` (h = hour) times ``1 + noise`` (AR(1), 0.98 per
  step, 3% deviation, ``numpy.random.default_rng(seed)``), scaled to peak at ``--peak-servers``
  (60). ``peaked`` (a = 0.6, b = 0.2: a sharp afternoon peak over a broad night trough; peak /
  trough 3.6, mean / peak 0.52 with seed 0) carries the targets; ``sinusoid`` (a = 0.5, b = 0:
  peak / trough 3.5, mean / peak 0.62) is reported next to it. Against a fixed deployment no
  policy can save more than 1 - mean / peak, so the shape decides most of the figure. A sweep over
  peaks of 24-96 servers shows how much the peak's place between unit multiples matters.
- **Per-GPU scaling (ours)**: the operator's built-in autoscaler (``eaas.operator.autoscaler``),
  called every step as the operator calls it: the ready servers' mean busy fraction and the
  pool's replicas (ready or starting). Target busy fraction ``HEADROOM`` (0.85) x ``u_slo``;
  scale-up window = ``--ready-seconds`` (the time an added GPU server needs to load its experts,
  120 s; the local process's start time is printed for comparison), scale-down window 300 s (the
  default). ``per-gpu-0s`` is the same with the default 0 s scale-up window; servers still
  starting count as idle (the autoscaler is told how many are ready, as the operator tells it),
  so a scale-up is not compounded while they start. ``minReplicas`` = the R-based floor
  ``--min-servers`` (17: DeepSeek-V3's routed experts in fp8, 58 x 256 x 3 x 7168 x 2048 bytes =
  654 GB, twice (R = 2), on 80 GB GPUs).
- **Fixed deployment units** ``fixed-8``/``-16``/``-32``: whole N-GPU units (an EP group as
  SGLang/vLLM run it) sized for the trace's peak at the SLO's edge (no headroom) and held all day;
  ``fixed-peak`` the same at one-GPU granularity.
- **Scaled units** ``units-8``/``-16``/``-32``: the same autoscaler, spec and windows, its answer
  rounded up to whole units, each ready after ``--ready-seconds``. This isolates granularity, the
  setting of the paper's figure: EaaS §5.3 serves 5120 of 8192 traffic on 40 GPUs where
  32-GPU-unit systems stay at 64, "up to 37.5%" saved at that operating point.
  ``max_instant_saving`` reports that kind of figure (the largest one-step saving of the day).

Targets (issue 18), on the ``peaked`` trace: per-GPU scaling saves >= 37.5% of the GPU-hours of
fixed 8-GPU units (the finest, so hardest, fixed units) with no more SLO-violating steps.

Not modelled: the attention pool (it scales on its own), placement changes (an added server's
share of the load is assumed even at once), collectives' warm-up for units; removals are immediate.

Usage: python benchmarks/elasticity.py [--quick] [--peak-servers N] [--ready-seconds S] [--json-out PATH]
"""

from __future__ import annotations

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
from eaas.operator.autoscaler import Autoscaler
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import write_random_checkpoint
from eaas.runtime.placement import round_robin

STEP_S = 10  # the operator's resync period (EAAS_OPERATOR_RESYNC_SECONDS): one autoscaler call per step
DAY_S = 24 * 3600
HEADROOM = 0.85  # the autoscaler's target busy fraction, as a fraction of u_slo
RATES = (1.0, 2.0, 4.0, 6.0, 8.0, 12.0)  # requests/s offered in Part A
QUICK_RATES = (1.0, 4.0, 8.0)
UNITS = (8, 16, 32)


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


@dataclass(frozen=True)
class Calibration:
    """Busy fraction of one server against its load, from Part A: piecewise linear through (0, 0)
    and the measured points (load in capacities at SLO, so the SLO's point is at 1.0), made
    non-decreasing, and proportional to the load (capped at 1) past the last point."""

    loads: tuple[float, ...]  # [P] increasing, load / capacity at SLO
    busy: tuple[float, ...]  # [P] busy fraction measured at that load

    def busy_at(self, load: float) -> float:
        busy = np.maximum.accumulate(np.asarray(self.busy))  # [P]
        if load > self.loads[-1]:
            return min(1.0, float(busy[-1]) * load / self.loads[-1])
        return float(np.interp(load, (0.0, *self.loads), (0.0, *busy)))

    @property
    def u_slo(self) -> float:
        """The busy fraction at the capacity at SLO (load 1.0)."""
        return self.busy_at(1.0)


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
) -> Day:
    """The built-in autoscaler called every step (as the operator does) with the ready servers' mean
    busy fraction and the pool's replicas (ready or starting), its answer rounded up to whole
    ``unit``-GPU units (1: per GPU). Added units serve ``ready_s`` later; removals take the newest
    starting units first and are immediate. The day starts with the pool the first step needs."""
    autoscaler = Autoscaler()
    target_load = calibration.loads[-1]
    for load in np.linspace(0.0, 1.0, 1001)[::-1]:  # the load at which a server runs at the target
        if calibration.busy_at(float(load)) * 1000 <= spec.target_utilization_milli:
            target_load = float(load)
            break
    start = unit * math.ceil(max(float(demand[0]) / max(target_load, 1e-3), floor) / unit)
    starting: list[tuple[float, int]] = []  # (ready at s, GPUs), oldest first
    ready = start
    gpus_per_step, ready_per_step, violations = [], [], 0
    for step, load in enumerate(demand):
        now = step * STEP_S
        ready += sum(g for at, g in starting if at <= now)
        starting = [(at, g) for at, g in starting if at > now]
        busy = calibration.busy_at(float(load) / ready)
        violations += int(load > ready + 1e-9)
        current = ready + sum(g for _, g in starting)
        wanted = autoscaler.recommend(now, current, round(busy * 1000), spec, ready)
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


def saving(ours: Day, baseline: Day) -> float:
    """Fraction of the baseline's GPU-hours that ours does not use."""
    return 1.0 - ours.gpu_hours() / baseline.gpu_hours()


def max_instant_saving(ours: Day, baseline: Day) -> float:
    """The largest one-step saving over the day (the kind of figure "up to 37.5%" is)."""
    return float((1.0 - ours.gpus / baseline.gpus).max())


def simulate(
    demand: np.ndarray, floor: int, calibration: Calibration, ready_s: float
) -> tuple[Day, list[Day]]:
    """(per-GPU scaling, baselines): fixed units, fixed per-GPU peak sizing, autoscaled units, and
    per-GPU scaling with the default (0 s) scale-up window."""
    spec = AutoscalingSpec(
        mode="builtin",
        min_replicas=floor,
        max_replicas=4096,
        target_utilization_milli=max(1, math.floor(1000 * HEADROOM * calibration.u_slo)),
        scale_up_stabilization_seconds=math.ceil(ready_s),
    )
    ours = autoscaled("per-gpu", demand, 1, floor, spec, calibration, ready_s)
    baselines = [fixed(f"fixed-{unit}", demand, unit, floor) for unit in UNITS]
    baselines.append(fixed("fixed-peak", demand, 1, floor))
    for unit in UNITS:
        baselines.append(autoscaled(f"units-{unit}", demand, unit, floor, spec, calibration, ready_s))
    default_window = spec.model_copy(update={"scale_up_stabilization_seconds": 0})
    baselines.append(autoscaled("per-gpu-0s", demand, 1, floor, default_window, calibration, ready_s))
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


def measure_capacity(rates: tuple[float, ...], seconds: float, seed: int, slo_s: float) -> dict[str, Any]:
    """Part A: per-rate rows, the capacity at SLO (p99 TPOT <= ``slo_s``), the busy-fraction curve
    and the server's start time."""
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
    meeting = [r for r in rows if r["tpot_p99_s"] <= slo_s and r["failed"] == 0] or rows[:1]
    capacity = max(r["server_tokens_per_s"] for r in meeting)
    ordered = sorted(rows, key=lambda r: r["server_tokens_per_s"])
    calibration = Calibration(
        tuple(r["server_tokens_per_s"] / capacity for r in ordered),
        tuple(r["busy_fraction"] for r in ordered),
    )
    return {
        "rows": rows,
        "capacity_tokens_per_s": capacity,
        "calibration": calibration,
        "server_start_s": start_s,
    }


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
    args = p.parse_args()
    rates, seconds = (QUICK_RATES, 6.0) if args.quick else (RATES, 15.0)

    part_a = measure_capacity(rates, seconds, args.seed, args.slo_tpot_ms / 1e3)
    calibration: Calibration = part_a["calibration"]
    capacity = part_a["capacity_tokens_per_s"]
    print("Part A: one expert server (tcp, 1 thread) behind one attention client, streamed Poisson load")
    print(
        f"{'req/s':>6} {'server tok/s':>12} {'busy':>6} {'out tok/s':>9} {'TPOT p50':>9} {'p99':>8}  failed"
    )
    for row in part_a["rows"]:
        print(
            f"{row['rate_rps']:6.1f} {row['server_tokens_per_s']:12.0f} {row['busy_fraction']:6.2f} "
            f"{row['output_tokens_per_s']:9.1f} {row['tpot_p50_s'] * 1e3:7.1f}ms "
            f"{row['tpot_p99_s'] * 1e3:6.1f}ms  {row['failed']}"
        )
    print(
        f"SLO p99 TPOT <= {args.slo_tpot_ms:.0f} ms: capacity {capacity:.0f} server tok/s at busy fraction "
        f"u_slo = {calibration.u_slo:.2f}; server start to ready {part_a['server_start_s']:.1f} s"
    )
    results: list[dict[str, Any]] = [{"part": "A", **row} for row in part_a["rows"]]
    results.append(
        {
            "part": "A",
            "slo_tpot_p99_s": args.slo_tpot_ms / 1e3,
            "capacity_tokens_per_s": capacity,
            "u_slo": calibration.u_slo,
            "server_start_s": part_a["server_start_s"],
        }
    )

    print(
        f"\nPart B: 24 h, {STEP_S} s steps, floor {args.min_servers} servers, autoscaler target "
        f"{HEADROOM:.2f} x u_slo = {HEADROOM * calibration.u_slo:.2f}, added servers ready after "
        f"{args.ready_seconds:.0f} s"
    )
    headline: tuple[Day, list[Day]] | None = None
    for shape in SHAPES:
        demand = diurnal_trace(args.peak_servers, args.seed, shape)
        ours, baselines = simulate(demand, args.min_servers, calibration, args.ready_seconds)
        headline = headline or (ours, baselines)
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
            f"{'policy':>11} {'GPU-hours':>9} {'min':>4} {'max':>4} {'violating steps':>15} {'ours saves':>9}"
        )
        rows = policy_rows(ours, baselines, part="B", **trace)
        for row in rows:
            shown = f"{row['saving']:10.1%}" if "saving" in row else f"{'':>10}"
            print(
                f"{row['policy']:>11} {row['gpu_hours']:9.1f} {row['min_gpus']:4d} {row['max_gpus']:4d} "
                f"{row['violating_steps']:15d} {shown}"
            )
        results += rows

    # Where the peak falls against the unit sizes decides much: the same policies over many peaks.
    peaks = range(24, 97, 24 if args.quick else 8)
    sweep: dict[str, list[float]] = {}
    for peak in peaks:
        ours, baselines = simulate(
            diurnal_trace(peak, args.seed), args.min_servers, calibration, args.ready_seconds
        )
        for day in baselines:
            sweep.setdefault(day.name, []).append(saving(ours, day))
    print(f"\n'peaked' trace, peaks {peaks.start}..{peaks.stop - 1} step {peaks.step}: ours saves on average")
    for name, savings in sweep.items():
        print(
            f"{name:>11} {statistics.mean(savings):6.1%}  (min {min(savings):6.1%}, max {max(savings):6.1%})"
        )
        results.append(
            {"part": "B sweep", "policy": name, "peaks": list(peaks), "mean_saving": statistics.mean(savings)}
        )

    assert headline is not None
    ours, baselines = headline
    unit8 = next(day for day in baselines if day.name == "fixed-8")
    emit(
        "elasticity",
        results,
        {
            "gpu_hours_saved_vs_fixed_unit_8": target(saving(ours, unit8), 0.375),
            "extra_violating_steps_vs_fixed_unit_8": target(
                ours.violations - unit8.violations, 0, higher_is_better=False
            ),
        },
        args.json_out,
    )


if __name__ == "__main__":
    main()
