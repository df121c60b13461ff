"""Compile the Triton kernels for an NVIDIA GPU architecture without a GPU (ahead of time).

Runs Triton's frontend, the NVIDIA backend and ptxas (shipped with triton) on every kernel with
every tile configuration of ``tuned_configs.json``, and reports shared memory per program and
whether the K loop is software-pipelined (asynchronous copies); then the paged-attention kernel at
the served attention shapes (``PAGED_ATTENTION_SHAPES``). Nothing is executed. Arguments
are specialised the way Triton's JIT specialises them at launch: ints equal to 1 become constants,
pointers and ints divisible by 16 are marked so (without that, loads cannot be vectorised).

    python -m eaas.kernels.compile_check [--arch 90] [--hidden 7168 --inter 2048]

Prints one JSON object per kernel variant, and exits 1 when a configuration does not fit.
Must run without ``TRITON_INTERPRET`` (the interpreter's kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from typing import Any

SHARED_MEMORY_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024, 100: 228 * 1024}
SHARED_MEMORY_PER_PROGRAM = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}


def compile_kernel(
    kernel: Any,
    values: dict[str, Any],
    constexprs: dict[str, Any],
    arch: int,
    num_warps: int,
    num_stages: int,
) -> Any:
    """Compile one ``@triton.jit`` kernel for ``sm_<arch>``.

    ``values``: pointer arguments as Triton type strings (``"*bf16"``), int arguments as example
    values (only whether they equal 1 or divide by 16 matters).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature: dict[str, str] = {}
    constants = dict(constexprs)
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        value = values[name]
        if isinstance(value, str):
            signature[name] = value
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constants, attrs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(source, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


def gemm_launch_values(hidden: int, inter: int, dtype: str) -> dict[str, dict[str, Any]]:
    """Launch-like argument values of the two GEMM kernels for contiguous weights of ``dtype``."""
    common: dict[str, Any] = {
        "num_groups": 256,
        "num_programs": 264,
        "topk": 8,
        "hidden": hidden,
        "inter": inter,
    }
    for name in (
        "sorted_entries_ptr",
        "walk_groups_ptr",
        "walk_counts_ptr",
        "walk_starts_ptr",
        "num_active_ptr",
    ):
        common[name] = "*i32"
    gate_up = {
        **common,
        "x_ptr": f"*{dtype}",
        "w13_ptr": f"*{dtype}",
        "act_ptr": f"*{dtype}",
        "stride_x_token": hidden,
        "stride_x_hidden": 1,
        "stride_w_group": 2 * inter * hidden,
        "stride_w_row": hidden,
        "stride_w_hidden": 1,
        "stride_act_row": inter,
        "stride_act_col": 1,
        "b13_ptr": f"*{dtype}",
        "stride_b_group": 2 * inter,
        "s13_ptr": "*fp32",
        "stride_s_group": (2 * inter // 128) * (hidden // 128),
        "stride_s_row": hidden // 128,
        "stride_s_col": 1,
        "alpha": 1.702,
        "limit": 7.0,
    }
    down = {
        **common,
        "act_ptr": f"*{dtype}",
        "w2_ptr": f"*{dtype}",
        "out_ptr": "*fp32",
        "weight_ptr": "*fp32",
        "stride_act_row": inter,
        "stride_act_col": 1,
        "stride_w_group": hidden * inter,
        "stride_w_row": inter,
        "stride_w_inter": 1,
        "stride_out_token": hidden,
        "b2_ptr": f"*{dtype}",
        "stride_b_group": hidden,
        "s2_ptr": "*fp32",
        "stride_s_group": (hidden // 128) * (inter // 128),
        "stride_s_row": inter // 128,
        "stride_s_col": 1,
    }
    return {"gate_up": gate_up, "down": down}


def check_all(arch: int, hidden: int, inter: int, dtype: str = "bf16") -> list[dict[str, Any]]:
    """Compile every kernel variant; one report per variant (``ok`` False when it does not fit)."""
    from eaas.kernels import align, grouped_gemm
    from eaas.kernels.configs import STAGES, TileConfig, load_tuned_configs

    data = load_tuned_configs()
    tables = [data["default"]] + [
        shape_tables
        for device in data.get("devices", {}).values()
        for shape_tables in device["shapes"].values()
    ]
    configs = {
        (stage, TileConfig.from_dict(c)) for t in tables for stage in STAGES for c in t[stage].values()
    }
    kernels = {"gate_up": grouped_gemm._gate_up_silu_kernel, "down": grouped_gemm._down_combine_kernel}
    values = gemm_launch_values(hidden, inter, dtype)
    reports: list[dict[str, Any]] = []
    # Every configuration plain (no bias, SiLU, 16-bit weights), plus each stage's largest with
    # biases and the clamped SwiGLU of gpt-oss (the epilogue variants) and with block-scaled FP8
    # weights (the main-loop variant).
    largest = {
        stage: max((c for s, c in configs if s == stage), key=lambda c: c.block_m * c.block_n)
        for stage in STAGES
    }
    variants = [
        (stage, config, shrink, "plain")
        for stage, config in sorted(configs, key=str)
        for shrink in (True, False)
    ]
    variants += [
        (stage, largest[stage], True, variant) for stage in STAGES for variant in ("epilogue", "fp8")
    ]
    for stage, config, shrink, variant in variants:
        epilogue, fp8 = variant == "epilogue", variant == "fp8"
        stage_values = dict(values[stage])
        if fp8:
            stage_values["w13_ptr" if stage == "gate_up" else "w2_ptr"] = "*fp8e4nv"
        constexprs = {
            "HAS_BIAS": epilogue,
            "FP8": fp8,
            "SCALE_ROWS": 128,
            "SCALE_COLS": 128,
            **({"ACTIVATION": 1 if epilogue else 0} if stage == "gate_up" else {}),
            "SHRINK": shrink,
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "BLOCK_K": config.block_k,
            "UPCAST": False,
            "PRECISION": "ieee" if dtype == "fp32" else "tf32",
        }
        compiled = compile_kernel(
            kernels[stage], stage_values, constexprs, arch, config.num_warps, config.num_stages
        )
        shared = int(compiled.metadata.shared)
        ttgir = compiled.asm["ttgir"]
        fits = shared <= SHARED_MEMORY_PER_PROGRAM.get(arch, 99 * 1024) and (
            shared * config.programs_per_sm <= SHARED_MEMORY_PER_SM.get(arch, 100 * 1024)
        )
        reports.append(
            {
                "kernel": stage,
                "shrink": shrink,
                "variant": variant,
                "config": config.as_dict(),
                "shared_bytes": shared,
                "pipelined": "async_copy" in ttgir or "async_tma" in ttgir,
                "ok": fits,
            }
        )
    entry = {"group_of_ptr": "*i32", "num_entries": 1024, "num_groups": 256}
    compile_kernel(
        align._count_kernel, {**entry, "counts_ptr": "*i32"}, {"BLOCK": align.ALIGN_BLOCK}, arch, 4, 1
    )
    scatter = {**entry, "cursor_ptr": "*i32", "sorted_entries_ptr": "*i32"}
    compile_kernel(align._scatter_kernel, scatter, {"BLOCK": align.ALIGN_BLOCK}, arch, 4, 1)
    pointers = ("counts", "starts", "cursor", "active_groups", "active_counts", "active_starts", "num_active")
    shrink_values: dict[str, Any] = {f"{name}_ptr": "*i32" for name in pointers}
    compile_kernel(
        align._shrink_kernel, {**shrink_values, "num_groups": 300}, {"BLOCK": align.SHRINK_BLOCK}, arch, 4, 1
    )
    reports.append({"kernel": "align", "ok": True})
    return reports + check_paged_attention(arch, dtype)


# (query heads per cached head, key dim, value dim) of the served attention shapes
PAGED_ATTENTION_SHAPES = {"qwen3_gqa": (8, 128, 128), "deepseek_mla": (128, 576, 512)}


def check_paged_attention(arch: int, dtype: str, block_size: int = 16) -> list[dict[str, Any]]:
    """Compile the paged-attention kernel at each of ``PAGED_ATTENTION_SHAPES``, with a block
    table and sinks (and MLA without a table: the contiguous cache); one report each."""
    from eaas.kernels import paged_attention_triton

    names = inspect.signature(paged_attention_triton._paged_attention_kernel.fn).parameters
    values: dict[str, Any] = {name: 4096 for name in names if name.startswith("stride_")}
    values.update({name: 1 for name in ("stride_qd", "stride_kd", "stride_vd", "stride_tw", "stride_ps")})
    values.update({name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "sinks_ptr", "out_ptr")})
    values.update({"tables_ptr": "*i64", "positions_ptr": "*i64", "scale": 0.1, "stride_od": 1})
    values.update({"steps": 4, "group": 64, "key_dim": 64, "value_dim": 64, "block_size": 16, "window": 128})
    reports = []
    for shape, (group, key_dim, value_dim) in PAGED_ATTENTION_SHAPES.items():
        for has_tables, has_sinks in ((True, True), (shape == "qwen3_gqa", False)):
            tiles = paged_attention_triton.tile_sizes(group, key_dim, value_dim, block_size, has_tables)
            constexprs = {"HAS_TABLES": has_tables, "HAS_SINKS": has_sinks, "IEEE": dtype == "fp32", **tiles}
            compiled = compile_kernel(
                paged_attention_triton._paged_attention_kernel, values, constexprs, arch, 4, 1
            )
            shared = int(compiled.metadata.shared)
            reports.append(
                {
                    "kernel": "paged_attention",
                    "variant": f"{shape}{'' if has_tables else ', no table'}{', sinks' if has_sinks else ''}",
                    "config": tiles,
                    "shared_bytes": shared,
                    "ok": shared <= SHARED_MEMORY_PER_PROGRAM.get(arch, 99 * 1024),
                }
            )
    return reports


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--arch", type=int, default=90, help="compute capability as major*10+minor (default 90)")
    cli.add_argument("--hidden", type=int, default=7168, help="H (default: DeepSeek-V3)")
    cli.add_argument("--inter", type=int, default=2048, help="I (default: DeepSeek-V3)")
    cli.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    options = cli.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr
        )
        return 2
    reports = check_all(options.arch, options.hidden, options.inter, options.dtype)
    for report in reports:
        print(json.dumps(report))
    return 0 if all(report["ok"] for report in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
