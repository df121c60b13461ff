"""Expert-server kernels: Triton (group shrink on/off) vs torch._grouped_mm vs a per-group loop.

Legend: T = tokens per server, K = top-k, H = hidden, I = expert intermediate, G = hosted groups,
A = active groups (groups that received at least one token).

On a CUDA GPU (H100/H200 intended): decode shapes of DeepSeek-V3 (H=7168, I=2048) and
Qwen3-30B-A3B (H=2048, I=768), bf16, G=256, K=8, T in 1..2048, A in {8, 64}. Each case reports
the median time (CUDA events, L2 flushed before each repetition; methods without host
synchronisation are timed as CUDA-graph replays, as the server runs them, unless ``--eager``) of

- ``triton``: the Triton backend with group shrink; ``triton_no_shrink``: the same walking all G;
- ``grouped_mm``: ``torch._grouped_mm`` over all G groups (the ``grouped_mm`` backend);
- ``loop``: a per-group loop of bf16 ``F.linear`` calls over the active groups;
- ``roofline``: bytes that must move (A expert weights + x + y) ÷ the device's copy bandwidth,
  measured in the same run (device-to-device copy of 1 GiB, read + write bytes).

Targets: triton ≥ 70% of the roofline at T ≤ 128; never slower than grouped_mm;
≥ 1.3× grouped_mm where most groups are empty (cases with at most 8 of 256 groups active).

Without CUDA the script still runs: Triton executes in its CPU interpreter (TRITON_INTERPRET=1)
at tiny shapes, so its times are interpreter times and say nothing about a GPU. The GPU targets
are then reported with ``"value": null, "met": null`` and a note ("not measured"), never
estimated. The correctness target (every backend within tolerance of the float32 reference) is
checked in both modes.

Usage: python benchmarks/moe_kernels.py [--quick] [--json-out PATH] [--reps N] [--eager]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must precede the first import of the Triton kernel modules (Triton decides at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from _common import commit, device, emit, parser, target  # noqa: E402

from eaas.kernels import experts_forward  # noqa: E402
from eaas.kernels.reference import experts_forward_reference  # noqa: E402

SEED = 0
NUM_GROUPS = 256  # G on a GPU
CPU_GROUPS = 64  # G in the interpreter (its walk over all groups without shrink is slow)
TOPK = 8
GPU_MODELS = {"deepseek-v3": (7168, 2048), "qwen3-30b-a3b": (2048, 768)}
GPU_TOKENS = (1, 8, 32, 128, 512, 2048)
GPU_ACTIVE = (8, 64)
# Tolerance of |y - ref| / (1 + |ref|) against the float32 reference, by dtype (tests/kernels).
TOLERANCE = {torch.bfloat16: 6e-2, torch.float16: 1e-2, torch.float32: 2e-5}
NOT_MEASURED = "not measured: no CUDA device in this run (GPU targets are never estimated)"


@dataclass(frozen=True)
class Case:
    model: str
    hidden: int  # H
    inter: int  # I
    num_tokens: int  # T
    num_active: int  # A requested (active groups); K distinct of them per token
    num_groups: int = 256  # G


def make_routing(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_of[T, K]`` (K distinct groups per token among A active ones of G) and ``weight_of[T, K]``."""
    generator = torch.Generator().manual_seed(SEED + case.num_tokens)
    num_active = min(case.num_active, case.num_groups)
    active = torch.randperm(case.num_groups, generator=generator)[:num_active]  # [A]
    picks = min(TOPK, num_active)
    scores = torch.rand(case.num_tokens, num_active, generator=generator)
    top_scores, top_index = scores.topk(picks, dim=1)  # [T, picks]
    group_of = torch.full((case.num_tokens, TOPK), -1, dtype=torch.int32)
    group_of[:, :picks] = active[top_index].to(torch.int32)
    weight_of = torch.zeros(case.num_tokens, TOPK)
    weight_of[:, :picks] = torch.softmax(top_scores, dim=1)
    return group_of.to(device), weight_of.to(device)


def make_weights(
    num_groups: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13[G, 2I, H]`` and ``w2[G, H, I]`` with unit-scale outputs (generated on the device)."""
    generator = torch.Generator(device=device).manual_seed(SEED)
    w13 = torch.randn(num_groups, 2 * inter, hidden, generator=generator, device=device, dtype=dtype)
    w13.mul_(hidden**-0.5)
    w2 = torch.randn(num_groups, hidden, inter, generator=generator, device=device, dtype=dtype)
    w2.mul_(inter**-0.5)
    return w13, w2


def per_group_loop(
    x: torch.Tensor, group_of: torch.Tensor, weight_of: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The straightforward server loop: one pair of ``F.linear`` calls per active group, in x.dtype."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_group = group_of.reshape(-1)
    flat_token = torch.arange(x.shape[0], device=x.device).repeat_interleave(group_of.shape[1])
    for group in torch.unique(flat_group[flat_group >= 0]).tolist():  # host sync, inherent to a loop
        selected = flat_group == group
        tokens = flat_token[selected]
        gate_up = F.linear(x[tokens], w13[group])  # [n, 2I]
        down = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[group])  # [n, H]
        out.index_add_(0, tokens, down.float() * weight_of.reshape(-1)[selected].float()[:, None])
    return out.to(x.dtype)


def normalized_error(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """max |actual - expected| / (tolerance · (1 + |expected|)); ≤ 1 means within tolerance."""
    bound = TOLERANCE[dtype] * (1 + expected.abs())
    return float(((actual.float() - expected).abs() / bound).max()) if expected.numel() else 0.0


def time_cuda(fn: Callable[[], Any], reps: int, warmup: int, flush: torch.Tensor) -> float:
    """Median microseconds of ``fn`` on the GPU; L2 is flushed (a large memset) before each run."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def time_cpu(fn: Callable[[], Any], reps: int, warmup: int) -> float:
    """Median microseconds of ``fn`` (wall clock)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def graphable_methods() -> set[str]:
    """Methods without host synchronisation. torch._grouped_mm syncs outside its SM90/SM100 fast path."""
    methods = {"triton", "triton_no_shrink"}
    if torch.cuda.get_device_capability() in ((9, 0), (10, 0)):
        methods.add("grouped_mm")
    return methods


def capture_cuda_graph(fn: Callable[[], Any]) -> Callable[[], Any] | None:
    """``fn`` captured in a CUDA graph (its replay), or None when capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        print(f"  (CUDA graph capture failed, timing eagerly: {error})"[:200], flush=True)
        torch.cuda.synchronize()
        return None
    return graph.replay


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (bytes read + bytes written)."""
    size = 1 << 30
    source = torch.empty(size, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    flush = torch.empty(0, device=device)
    seconds = time_cuda(lambda: destination.copy_(source), reps=10, warmup=3, flush=flush) * 1e-6
    return 2 * size / seconds


def run_case(
    case: Case,
    dtype: torch.dtype,
    weights: tuple[torch.Tensor, torch.Tensor],
    timer: Callable[[Callable[[], Any]], float],
    bandwidth: float | None,
    use_graphs: bool = False,
) -> dict[str, Any]:
    """Correctness against the float32 reference, then the timings of every method, for one case.

    With ``use_graphs`` the methods that can be captured are timed as CUDA-graph replays (how the
    expert server runs them); the Triton backend is then also timed eagerly (``triton_eager_us``).
    """
    from eaas.kernels.triton_backend import experts_forward_triton

    device_ = weights[0].device
    w13, w2 = weights
    generator = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).to(dtype).to(device_)
    group_of, weight_of = make_routing(case, device_)
    args = (x, group_of, weight_of, w13, w2)
    used_groups = int(torch.unique(group_of[group_of >= 0]).numel())
    methods: dict[str, Callable[[], torch.Tensor]] = {
        "triton": lambda: experts_forward_triton(*args),
        "triton_no_shrink": lambda: experts_forward_triton(*args, shrink=False),
        "grouped_mm": lambda: experts_forward(*args, backend="grouped_mm"),
        "loop": lambda: per_group_loop(*args),
    }
    # float32 reference; it upcasts one group's weights at a time (a full fp32 copy would not fit).
    reference = experts_forward_reference(x.float(), group_of, weight_of, w13, w2)
    row: dict[str, Any] = {
        "model": case.model,
        "H": case.hidden,
        "I": case.inter,
        "T": case.num_tokens,
        "K": TOPK,
        "G": case.num_groups,
        "active_groups": used_groups,
        "dtype": str(dtype).removeprefix("torch."),
    }
    errors = {}
    for name, fn in methods.items():
        errors[name] = normalized_error(fn(), reference, dtype)
        replay = capture_cuda_graph(fn) if use_graphs and name in graphable_methods() else None
        row[f"{name}_us"] = round(timer(replay or fn), 2)
        row[f"{name}_cuda_graph"] = replay is not None
        if name == "triton" and replay is not None:
            row["triton_eager_us"] = round(timer(fn), 2)
    row["max_normalized_error"] = max(errors.values())
    bytes_moved = used_groups * 3 * case.inter * case.hidden * w13.element_size()
    bytes_moved += 2 * case.num_tokens * case.hidden * x.element_size()
    row["bytes_moved"] = bytes_moved
    row["roofline_us"] = round(bytes_moved / bandwidth * 1e6, 2) if bandwidth else None
    row["roofline_fraction"] = round(row["roofline_us"] / row["triton_us"], 4) if bandwidth else None
    row["speedup_vs_grouped_mm"] = round(row["grouped_mm_us"] / row["triton_us"], 3)
    row["shrink_speedup"] = round(row["triton_no_shrink_us"] / row["triton_us"], 3)
    row["mode"] = "cuda" if HAS_CUDA else "cpu-triton-interpreter"
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'model':<14}{'T':>6}{'A/G':>8}{'triton':>11}{'no-shrink':>11}{'grouped_mm':>12}{'loop':>11}"
        f"{'roofline':>10}{'%roof':>7}{'x gmm':>7}{'shrink':>8}{'err/tol':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        roofline = f"{row['roofline_us']:.1f}" if row["roofline_us"] is not None else "n/a"
        fraction = f"{100 * row['roofline_fraction']:.0f}%" if row["roofline_fraction"] is not None else "n/a"
        print(
            f"{row['model']:<14}{row['T']:>6}{row['active_groups']:>4}/{row['G']:<3}"
            f"{row['triton_us']:>11.1f}{row['triton_no_shrink_us']:>11.1f}{row['grouped_mm_us']:>12.1f}"
            f"{row['loop_us']:>11.1f}{roofline:>10}{fraction:>7}{row['speedup_vs_grouped_mm']:>7.2f}"
            f"{row['shrink_speedup']:>8.2f}{row['max_normalized_error']:>9.3f}"
        )
    print("times in µs (medians); %roof = roofline / triton; x gmm = grouped_mm / triton;")
    print("shrink = triton without group shrink / with; err/tol = worst backend error / tolerance")


def gpu_targets(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    small = [row for row in rows if row["T"] <= 128]
    sparse = [row for row in rows if row["active_groups"] <= 8]
    targets: dict[str, dict[str, Any]] = {}
    if small:
        targets["triton_roofline_fraction_min_T_le_128"] = target(
            min(row["roofline_fraction"] for row in small), 0.70
        )
    targets["triton_vs_grouped_mm_min_speedup"] = target(
        min(row["speedup_vs_grouped_mm"] for row in rows), 1.0
    )
    if sparse:
        targets["triton_vs_grouped_mm_min_speedup_sparse"] = target(
            min(row["speedup_vs_grouped_mm"] for row in sparse), 1.3
        )
    return targets


def main() -> int:
    cli = parser(__doc__.splitlines()[0])
    cli.add_argument("--reps", type=int, help="timed repetitions per method (default 20 on GPU, 3 on CPU)")
    cli.add_argument("--eager", action="store_true", help="GPU: time every method eagerly (no CUDA graphs)")
    options = cli.parse_args()
    torch.manual_seed(SEED)
    rows: list[dict[str, Any]] = []
    print(f"benchmark moe_kernels on {device()} (commit {commit()})", flush=True)
    if HAS_CUDA:
        cuda = torch.device("cuda")
        dtype = torch.bfloat16
        bandwidth = copy_bandwidth(cuda)
        print(f"measured copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=cuda)
        reps = options.reps or (5 if options.quick else 20)

        def timer(fn: Callable[[], Any]) -> float:
            return time_cuda(fn, reps=reps, warmup=2, flush=flush)

        models = {"qwen3-30b-a3b": GPU_MODELS["qwen3-30b-a3b"]} if options.quick else GPU_MODELS
        tokens: tuple[int, ...] = (1, 32, 128, 512) if options.quick else GPU_TOKENS
        for model, (hidden, inter) in models.items():
            weights = make_weights(NUM_GROUPS, hidden, inter, dtype, cuda)
            for num_active in GPU_ACTIVE:
                for num_tokens in tokens:
                    case = Case(model, hidden, inter, num_tokens, num_active)
                    rows.append(
                        run_case(case, dtype, weights, timer, bandwidth, use_graphs=not options.eager)
                    )
            del weights
            torch.cuda.empty_cache()
    else:
        print("no CUDA device: Triton runs in its CPU interpreter at tiny shapes (H=64, I=32, G=64).")
        print(
            "Interpreter times say nothing about GPU speed; the GPU targets below are not measured.",
            flush=True,
        )
        cpu = torch.device("cpu")
        dtype = torch.bfloat16
        weights = make_weights(CPU_GROUPS, 64, 32, dtype, cpu)
        reps = options.reps or (2 if options.quick else 3)

        def timer(fn: Callable[[], Any]) -> float:
            return time_cpu(fn, reps=reps, warmup=0)  # the correctness call before timing warms up

        tokens = (1, 8, 32) if options.quick else (1, 8, 32, 128)
        for num_active in (8,) if options.quick else (8, 64):
            for num_tokens in tokens:
                rows.append(
                    run_case(
                        Case("tiny", 64, 32, num_tokens, num_active, CPU_GROUPS), dtype, weights, timer, None
                    )
                )
    print_table(rows)
    targets = {
        "max_error_within_tolerance": target(max(row["max_normalized_error"] for row in rows), 1.0, False)
    }
    if HAS_CUDA:
        targets.update(gpu_targets(rows))
    else:
        for name, goal in (
            ("triton_roofline_fraction_min_T_le_128", 0.70),
            ("triton_vs_grouped_mm_min_speedup", 1.0),
            ("triton_vs_grouped_mm_min_speedup_sparse", 1.3),
        ):
            targets[name] = {"value": None, "target": goal, "met": None, "note": NOT_MEASURED}
    for name, entry in targets.items():
        print(f"target {name}: value={entry['value']} target={entry['target']} met={entry['met']}")
    emit("moe_kernels", rows, targets, options.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
