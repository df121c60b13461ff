"""Regenerate the tuned tile configurations of the Triton expert kernels (kernels/tuned_configs.json).

For each model shape (H, I), token bucket T and GEMM stage (gate_up, down) it times candidate
``TileConfig``s on the current GPU (median of CUDA-event timings, L2 flushed, with A = 8 and 64
active groups of G = 256, K = 8, bf16) and keeps the fastest. The result is written under
``devices[<torch.cuda.get_device_name()>]`` of the file, leaving other devices and the defaults
as they were.

    python benchmarks/autotune_moe.py                    # GPU: all shapes and buckets
    python benchmarks/autotune_moe.py --quick            # GPU: fewer candidates and buckets
    python benchmarks/autotune_moe.py --out /tmp/t.json  # write elsewhere

Without CUDA it only exercises the pipeline in Triton's CPU interpreter at a tiny shape with two
candidates (the timings mean nothing) and requires ``--out``: it never writes interpreter
results into the packaged file.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _common import commit, parser  # noqa: E402
from moe_kernels import GPU_MODELS, Case, make_routing, make_weights, time_cpu, time_cuda  # noqa: E402

from eaas.kernels.configs import STAGES, TileConfig, shape_key, validate_tuned_configs  # noqa: E402

PACKAGED_FILE = Path(__file__).resolve().parents[1] / "kernels" / "tuned_configs.json"
GPU_BUCKETS = (1, 8, 32, 128, 512, 2048)
TUNE_ACTIVE = (8, 64)
SHARED_MEMORY_PER_SM = 228 * 1024  # Hopper


def shared_memory_estimate(config: TileConfig, stage: str, element_size: int = 2) -> int:
    """Bytes of shared memory for the pipelined operand tiles (gate_up loads two weight tiles)."""
    weight_tiles = 2 if stage == "gate_up" else 1
    per_stage = (
        config.block_m * config.block_k + weight_tiles * config.block_k * config.block_n
    ) * element_size
    return per_stage * max(config.num_stages - 1, 1)


def candidates(num_tokens: int, stage: str, quick: bool) -> list[TileConfig]:
    """Tile configurations worth timing for ``num_tokens`` tokens (K = 8 entries each)."""
    rows_per_group = max(1, num_tokens * 8 // 64)
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows_per_group)]
    grid = itertools.product(
        block_ms,
        (64, 128) if quick else (32, 64, 128, 256),
        (64, 128) if quick else (64, 128, 256),
        (4,) if quick else (4, 8),
        (3,) if quick else (2, 3, 4, 5),
        (2,) if quick else (1, 2, 4),
    )
    configs = []
    for block_m, block_n, block_k, warps, stages, per_sm in grid:
        config = TileConfig(block_m, block_n, block_k, warps, stages, per_sm)
        if shared_memory_estimate(config, stage) * per_sm <= SHARED_MEMORY_PER_SM:
            configs.append(config)
    return configs


def time_stage(stage: str, config: TileConfig, inputs: list[dict[str, Any]], timer: Any) -> float:
    """Summed median microseconds of one stage over the prepared inputs (one per active count)."""
    from eaas.kernels.grouped_gemm import down_combine, gate_up_silu

    total = 0.0
    for item in inputs:
        if stage == "gate_up":
            total += timer(
                lambda item=item: gate_up_silu(item["x"], item["w13"], item["alignment"], 8, config)
            )
        else:
            total += timer(
                lambda item=item: down_combine(
                    item["act"], item["w2"], item["weight_of"], item["alignment"], item["out"], config
                )
            )
    return total


def prepare(
    model: str, hidden: int, inter: int, num_tokens: int, weights: Any, device: torch.device
) -> list[dict]:
    from eaas.kernels.align import align_entries
    from eaas.kernels.grouped_gemm import gate_up_silu

    w13, w2 = weights
    inputs = []
    for num_active in TUNE_ACTIVE:
        case = Case(model, hidden, inter, num_tokens, num_active, w13.shape[0])
        group_of, weight_of = make_routing(case, device)
        x = torch.randn(num_tokens, hidden, device=device).to(w13.dtype)
        alignment = align_entries(group_of, w13.shape[0])
        act = gate_up_silu(x, w13, alignment, 8, candidates(1, "gate_up", quick=True)[0])
        out = torch.zeros(num_tokens, hidden, device=device)
        inputs.append(dict(x=x, w13=w13, w2=w2, weight_of=weight_of, alignment=alignment, act=act, out=out))
    return inputs


def main() -> int:
    cli = parser(__doc__.splitlines()[0])
    cli.add_argument("--out", type=Path, help="file to update (GPU default: the packaged tuned_configs.json)")
    options = cli.parse_args()
    if not HAS_CUDA and options.out is None:
        print("autotune_moe: no CUDA device; pass --out to run the interpreter smoke test", file=sys.stderr)
        return 2
    out_path = options.out or PACKAGED_FILE
    data = json.loads(out_path.read_text()) if out_path.exists() else json.loads(PACKAGED_FILE.read_text())
    torch.manual_seed(0)
    if HAS_CUDA:
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)

        def timer(fn: Any) -> float:
            return time_cuda(fn, reps=5 if options.quick else 15, warmup=2, flush=flush)

        models = GPU_MODELS
        buckets: tuple[int, ...] = (1, 128) if options.quick else GPU_BUCKETS
        num_groups = 256
    else:
        device = torch.device("cpu")
        device_name = "cpu-interpreter-smoke-test"
        print("no CUDA device: interpreter smoke test at H=64, I=32; timings mean nothing")

        def timer(fn: Any) -> float:
            return time_cpu(fn, reps=1, warmup=0)

        models = {"tiny": (64, 32)}
        buckets = (8,)
        num_groups = 16
    entry = data.setdefault("devices", {}).setdefault(device_name, {"shapes": {}})
    entry["source"] = (
        f"benchmarks/autotune_moe.py{' --quick' if options.quick else ''} on {datetime.date.today()}, "
        f"commit {commit()}, torch {torch.__version__}"
    )
    for model, (hidden, inter) in models.items():
        weights = make_weights(num_groups, hidden, inter, torch.bfloat16, device)
        tables: dict[str, dict[str, Any]] = {stage: {} for stage in STAGES}
        for num_tokens in buckets:
            inputs = prepare(model, hidden, inter, num_tokens, weights, device)
            for stage in STAGES:
                pool = (
                    candidates(num_tokens, stage, options.quick)
                    if HAS_CUDA
                    else candidates(1, stage, True)[:2]
                )
                timed = []
                for config in pool:
                    try:
                        timed.append((time_stage(stage, config, inputs, timer), config))
                    except Exception as error:  # a candidate that does not compile or launch is skipped
                        print(f"  skip {stage} {config}: {type(error).__name__}: {error}"[:200])
                best_us, best = min(timed, key=lambda item: item[0])
                tables[stage][str(num_tokens)] = best.as_dict()
                print(f"{model:<14} T={num_tokens:<5} {stage:<8} {best_us:10.1f} us  {best}", flush=True)
        entry["shapes"][shape_key(hidden, inter)] = tables
        del weights
    validate_tuned_configs(data)
    out_path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
