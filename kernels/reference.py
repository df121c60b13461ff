"""Plain PyTorch reference of the expert computation (a loop over active groups).

Legend: T = tokens, K = entries per token (top-k), H = hidden size, I = expert intermediate
size, G = groups (hosted (layer, expert) pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaas.kernels.activation import SILU, Activation, BlockScales


def experts_forward_reference(
    x: torch.Tensor,  # [T, H]
    group_of: torch.Tensor,  # [T, K] int, -1 = skip
    weight_of: torch.Tensor,  # [T, K] router weights
    w13: torch.Tensor,  # [G, 2I, H]: rows [0, I) gate, [I, 2I) up
    w2: torch.Tensor,  # [G, H, I]: down
    *,
    b13: torch.Tensor | None = None,  # [G, 2I] gate then up biases
    b2: torch.Tensor | None = None,  # [G, H] down biases
    activation: Activation = SILU,
    scales: BlockScales | None = None,
) -> torch.Tensor:  # [T, H], dtype of x
    """Router-weighted sum over each token's entries of ``down(act(gate(x), up(x)))``, with the
    projections' biases when given; FP8 weights with ``scales`` are dequantised per group.

    Accumulates in float32 and returns ``x.dtype``.
    """
    num_tokens, hidden = x.shape
    inter = w2.shape[2]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    flat_group = group_of.reshape(-1)  # [T*K]
    flat_token = torch.arange(num_tokens, device=x.device).repeat_interleave(group_of.shape[1])
    flat_weight = weight_of.reshape(-1).to(torch.float32)
    for group in torch.unique(flat_group[flat_group >= 0]).tolist():
        sel = flat_group == group
        tokens = flat_token[sel]  # [n]
        xs = x[tokens].to(torch.float32)  # [n, H]
        up_weights, down_weights = w13[group].to(torch.float32), w2[group].to(torch.float32)
        if scales is not None:
            up_weights = up_weights * scales.expand(
                scales.w13[group], (up_weights.shape[0], up_weights.shape[1])
            )
            down_weights = down_weights * scales.expand(
                scales.w2[group], (down_weights.shape[0], down_weights.shape[1])
            )
        gate_up = xs @ up_weights.t()  # [n, 2I]
        if b13 is not None:
            gate_up = gate_up + b13[group].to(torch.float32)
        act = activation.apply(gate_up[:, :inter], gate_up[:, inter:])  # [n, I]
        y = act @ down_weights.t()  # [n, H]
        if b2 is not None:
            y = y + b2[group].to(torch.float32)
        out.index_add_(0, tokens, y * flat_weight[sel, None])
    return out.to(x.dtype)


# References of the individual Triton kernels (see align.py and grouped_gemm.py).


def align_reference(group_of: torch.Tensor, num_groups: int) -> dict[str, torch.Tensor]:
    """What ``align_entries`` computes, with the entries of each group in ascending order.

    Returns int64 tensors: ``group_counts[G]``, ``group_starts[G]``, ``active_groups[A]``,
    ``active_counts[A]``, ``active_starts[A]`` and ``sorted_entries[N]`` (N valid entries).
    """
    flat = group_of.reshape(-1).to(torch.int64).cpu()  # [T*K]
    valid = (flat >= 0) & (flat < num_groups)
    counts = torch.bincount(flat[valid], minlength=num_groups)  # [G]
    starts = torch.cumsum(counts, 0) - counts
    active = torch.nonzero(counts).reshape(-1)  # [A] ascending
    entries = torch.nonzero(valid).reshape(-1)
    sorted_entries = entries[torch.argsort(flat[entries], stable=True)]
    return {
        "group_counts": counts,
        "group_starts": starts,
        "active_groups": active,
        "active_counts": counts[active],
        "active_starts": starts[active],
        "sorted_entries": sorted_entries,
    }


def gate_up_silu_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [G, 2I, H]
    entries: torch.Tensor,  # [N] entry ids t*K+k
    groups: torch.Tensor,  # [N] their groups
    topk: int,
) -> torch.Tensor:  # [N, I] float32
    """``silu(x[t] @ gate[g].T) * (x[t] @ up[g].T)`` for each (entry, group), in float32."""
    inter = w13.shape[1] // 2
    tokens = entries // topk
    rows = torch.einsum("nh,nih->ni", x[tokens].float(), w13[groups].float())  # [N, 2I]
    return F.silu(rows[:, :inter]) * rows[:, inter:]


def down_combine_reference(
    act: torch.Tensor,  # [N, I]
    w2: torch.Tensor,  # [G, H, I]
    entries: torch.Tensor,  # [N] entry ids t*K+k
    groups: torch.Tensor,  # [N] their groups
    weight_of: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, H] float32
    """``out[t] = Σ weight[t, k] · act[n] @ down[g].T`` over the entries n of token t, in float32."""
    num_tokens, topk = weight_of.shape
    down = torch.einsum("ni,nhi->nh", act.float(), w2[groups].float())  # [N, H]
    weights = weight_of.reshape(-1)[entries].float()[:, None]
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=act.device)
    return out.index_add_(0, entries // topk, down * weights)
