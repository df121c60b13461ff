"""The expert side: routed-expert weights of any set of (layer, expert) pairs, stacked in groups.

An expert server hosts the pairs its placement gives it; the reference model hosts them all.
Legend: G = hosted groups (one per (layer, expert)), T = tokens, K = top-k, H = hidden,
I = expert intermediate size, L = layers, E = experts per layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from eaas.kernels import experts_forward
from eaas.kernels.activation import Activation
from eaas.runtime.model.checkpoint import CheckpointReader
from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.naming import ExpertPart, expert_parts

ExpertKey = tuple[int, int]  # (layer, expert)

log = logging.getLogger(__name__)


def expert_activation(config: MoEConfig) -> Activation:
    return Activation(config.expert_activation, alpha=config.swiglu_alpha, limit=config.swiglu_limit)


class ExpertStack:
    """Stacked weights ``w13`` [G, 2I, H] (gate rows then up rows) and ``w2`` [G, H, I], and with
    ``config.expert_bias`` the biases ``b13`` [G, 2I] and ``b2`` [G, H]."""

    def __init__(
        self,
        config: MoEConfig,
        pairs: list[ExpertKey],
        w13: torch.Tensor,
        w2: torch.Tensor,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
    ) -> None:
        if config.expert_bias and (b13 is None or b2 is None):
            raise ValueError(f"{config.family} experts have biases: b13 and b2 are required")
        self.config = config
        self.pairs = pairs
        self.w13 = w13
        self.w2 = w2
        self.b13 = b13
        self.b2 = b2
        self.activation = expert_activation(config)
        self.load_seconds = 0.0
        # [L, E] group index of each hosted pair, -1 where not hosted here.
        self.group_table = torch.full((config.num_layers, config.num_experts), -1, dtype=torch.int64)
        for group, (layer, expert) in enumerate(pairs):
            self.group_table[layer, expert] = group

    @classmethod
    def empty(
        cls, config: MoEConfig, num_groups: int, dtype: torch.dtype, pairs: list[ExpertKey]
    ) -> ExpertStack:
        """A stack of ``num_groups`` uninitialised groups (filled by the caller)."""
        h, i = config.hidden_size, config.expert_intermediate_size
        w13, w2 = torch.empty(num_groups, 2 * i, h, dtype=dtype), torch.empty(num_groups, h, i, dtype=dtype)
        b13 = torch.empty(num_groups, 2 * i, dtype=dtype) if config.expert_bias else None
        b2 = torch.empty(num_groups, h, dtype=dtype) if config.expert_bias else None
        return cls(config, pairs, w13, w2, b13, b2)

    @classmethod
    def load(
        cls,
        reader: CheckpointReader,
        pairs: Iterable[ExpertKey],
        dtype: torch.dtype | None = None,
        progress: bool = False,
    ) -> ExpertStack:
        """Loads only the tensors (or, for fused storage, the slices) of ``pairs`` from the
        checkpoint, in ``dtype`` or as stored (FP8 and MXFP4 experts are dequantised to
        bfloat16), with a progress bar on a terminal if asked."""
        config = reader.config
        pairs = sorted(set(pairs))
        for layer, expert in pairs:
            if not config.is_moe_layer(layer) or not 0 <= expert < config.num_experts:
                raise ValueError(
                    f"(layer={layer}, expert={expert}) is not a routed expert of this model "
                    f"(MoE layers {config.num_dense_layers}..{config.num_layers - 1}, "
                    f"experts 0..{config.num_experts - 1})"
                )
        parts = {
            (part.name, part.index): (part, group)
            for group, pair in enumerate(pairs)
            for part in expert_parts(config, *pair)
        }
        dt = dtype or (reader.stored_dtype(next(iter(parts))[0]) if parts else torch.float32)
        # Each piece is copied into its place as it is read: peak memory is the stack plus one tensor.
        stack = cls.empty(config, len(pairs), dt, pairs)
        start = time.perf_counter()
        label = f"loading {len(pairs)} experts" if progress else None
        for ref, tensor in reader.iter_load_slices(list(parts), dtype=dt, progress=label):
            part, group = parts[ref]
            stack._place(group, part, tensor)
        stack.load_seconds = time.perf_counter() - start
        if pairs:
            rate = stack.nbytes / max(stack.load_seconds, 1e-9) / 1e9
            mib = stack.nbytes / 2**20
            log.info(
                "loaded %d experts: %.1f MiB in %.2f s (%.2f GB/s)", len(pairs), mib, stack.load_seconds, rate
            )
        return stack

    def _place(self, group: int, part: ExpertPart, tensor: torch.Tensor) -> None:
        i = self.config.expert_intermediate_size
        if part.role == "gate":  # [I, H]
            self.w13[group, :i] = tensor
        elif part.role == "up":  # [I, H]
            self.w13[group, i:] = tensor
        elif part.role == "down":  # [H, I]
            self.w2[group] = tensor
        elif part.role == "gate_up_columns":  # [H, 2I], gate and up alternating
            self.w13[group, :i] = tensor[:, 0::2].T
            self.w13[group, i:] = tensor[:, 1::2].T
        elif part.role == "down_rows":  # [I, H]
            self.w2[group] = tensor.T
        elif part.role == "gate_up_bias":  # [2I], alternating
            assert self.b13 is not None
            self.b13[group, :i] = tensor[0::2]
            self.b13[group, i:] = tensor[1::2]
        else:  # down_bias [H]
            assert self.b2 is not None
            self.b2[group] = tensor

    @classmethod
    def gather(
        cls,
        config: MoEConfig,
        pairs: list[ExpertKey],
        sources: list[tuple[ExpertStack, int]],
        device: torch.device,
    ) -> ExpertStack:
        """A stack of ``pairs`` whose group g is group ``sources[g][1]`` of stack ``sources[g][0]``."""

        def stack(attr: str) -> torch.Tensor | None:
            rows = [getattr(s, attr) for s, _ in sources]
            if not rows or rows[0] is None:
                return None
            return torch.stack([r[g].to(device) for r, (_, g) in zip(rows, sources, strict=True)])

        w13, w2, b13, b2 = (stack(attr) for attr in ("w13", "w2", "b13", "b2"))
        assert w13 is not None and w2 is not None
        return cls(config, pairs, w13, w2, b13, b2).to(device)

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked weights and biases."""
        tensors = [t for t in (self.w13, self.w2, self.b13, self.b2) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: str | torch.device) -> ExpertStack:
        """This stack with its weights and group table on ``device`` (itself if already there)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.w13.device == device and self.group_table.device == device:
            return self
        moved = [None if t is None else t.to(device) for t in (self.b13, self.b2)]
        stack = ExpertStack(self.config, self.pairs, self.w13.to(device), self.w2.to(device), *moved)
        stack.group_table = stack.group_table.to(device)
        return stack

    def groups_for(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, K] of ``layer`` (-1 = skip) -> group ids [T, K] (-1 where not hosted)."""
        groups = self.group_table[layer][expert_ids.clamp(min=0)]
        return torch.where(expert_ids >= 0, groups, torch.full_like(groups, -1))

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        group_of: torch.Tensor,  # [T, K]
        weight_of: torch.Tensor,  # [T, K]
        backend: str = "torch",
    ) -> torch.Tensor:  # [T, H]
        return experts_forward(
            x,
            group_of,
            weight_of,
            self.w13,
            self.w2,
            backend,
            b13=self.b13,
            b2=self.b2,
            activation=self.activation,
        )


class LocalExperts:
    """The MoE executor of the monolithic reference: every expert in this process."""

    def __init__(self, stack: ExpertStack, backend: str = "torch") -> None:
        self.stack = stack
        self.backend = backend

    @classmethod
    def from_checkpoint(
        cls, reader: CheckpointReader, dtype: torch.dtype | None = None, backend: str = "torch"
    ) -> LocalExperts:
        config = reader.config
        pairs = [(layer, e) for layer in config.moe_layers for e in range(config.num_experts)]
        return cls(ExpertStack.load(reader, pairs, dtype=dtype), backend=backend)

    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed-expert output [T, H] for x [T, H], expert ids [T, K], router weights [T, K]."""
        return self.stack.forward(x, self.stack.groups_for(layer, expert_ids), weights, self.backend)
