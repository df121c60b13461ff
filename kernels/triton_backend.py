"""The ``triton`` backend: alignment + group shrink, gate/up GEMM with SiLU·mul, down GEMM with combine.

Launches, none of which waits on the host (so a server step can be captured in a CUDA graph):
metadata memset, count, shrink, scatter (``align.py``); gate_up; output memset; down
(``grouped_gemm.py``); and for 16-bit inputs the cast of the fp32 accumulator to ``x.dtype``.
Grid sizes come from shapes alone.
"""

from __future__ import annotations

import torch

from eaas.kernels.activation import SILU, Activation, BlockScales
from eaas.kernels.align import Alignment, align_entries
from eaas.kernels.checks import check_expert_biases, check_expert_inputs, check_group_range
from eaas.kernels.configs import INTERPRETER_CONFIG, TileConfig, select_configs
from eaas.kernels.grouped_gemm import _gate_up_silu_kernel, down_combine, gate_up_silu
from eaas.kernels.triton_env import device_name, is_interpreted, require_runnable

BACKEND = "triton"


def experts_forward_triton(
    x: torch.Tensor,  # [T, H] float32 / float16 / bfloat16
    group_of: torch.Tensor,  # [T, K] int32/int64, -1 = skip
    weight_of: torch.Tensor,  # [T, K] router weights
    w13: torch.Tensor,  # [G, 2I, H]: rows [0, I) gate, [I, 2I) up
    w2: torch.Tensor,  # [G, H, I]: down
    *,
    b13: torch.Tensor | None = None,  # [G, 2I] gate then up biases
    b2: torch.Tensor | None = None,  # [G, H] down biases
    activation: Activation = SILU,
    scales: BlockScales | None = None,
    shrink: bool = True,
    configs: tuple[TileConfig, TileConfig] | None = None,
) -> torch.Tensor:  # [T, H], dtype of x
    """``experts_forward`` on the Triton kernels.

    ``shrink=False`` walks all G groups instead of the compacted active ones (for the ablation).
    ``configs`` overrides the (gate_up, down) tile configurations from ``tuned_configs.json``.
    Accumulates in float32 (the combine through fp32 atomics, so the summation order over a
    token's K entries is not fixed) and returns ``x.dtype``.
    """
    shapes = check_expert_inputs(x, group_of, weight_of, w13, w2, BACKEND, scales)
    check_expert_biases(shapes, x, b13, b2, BACKEND)
    require_runnable(x.device, _gate_up_silu_kernel)
    interpreted = is_interpreted(_gate_up_silu_kernel)
    if x.device.type == "cpu":
        check_group_range(group_of, shapes.num_groups, BACKEND)  # free on CPU; a sync on CUDA
    if shapes.num_tokens == 0 or shapes.topk == 0:
        return torch.zeros_like(x)
    if configs is None:
        if interpreted:
            configs = (INTERPRETER_CONFIG, INTERPRETER_CONFIG)
        else:
            configs = select_configs(device_name(x.device), shapes.hidden, shapes.inter, shapes.num_tokens)
    gate_up_config, down_config = configs
    alignment: Alignment = align_entries(group_of, shapes.num_groups)
    block = scales.block if scales is not None else (1, 1)
    s13, s2 = (scales.w13, scales.w2) if scales is not None else (None, None)
    act = gate_up_silu(
        x, w13, alignment, shapes.topk, gate_up_config, shrink, b13, activation, s13, block
    )  # [T*K, I]
    out = torch.zeros((shapes.num_tokens, shapes.hidden), dtype=torch.float32, device=x.device)
    down_combine(act, w2, weight_of, alignment, out, down_config, shrink, b2, s2, block)
    return out if x.dtype == torch.float32 else out.to(x.dtype)
