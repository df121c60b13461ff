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
from eaas.runtime.model.checkpoint import CheckpointReader
from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.naming import expert_tensor_names

ExpertKey = tuple[int, int]  # (layer, expert)


log = logging.getLogger(__name__)


def _stored_dtype(reader: CheckpointReader, pairs: list[ExpertKey]) -> torch.dtype:
    """The dtype the experts are stored in (bfloat16 for FP8: they are dequantised)."""
    if not pairs:
        return torch.float32
    return reader.stored_dtype(expert_tensor_names(reader.config, *pairs[0])[0])


class ExpertStack:
    """Stacked weights ``w13`` [G, 2I, H] (gate rows then up rows) and ``w2`` [G, H, I]."""

    def __init__(
        self, config: MoEConfig, pairs: list[ExpertKey], w13: torch.Tensor, w2: torch.Tensor
    ) -> None:
        self.config = config
        self.pairs = pairs
        self.w13 = w13
        self.w2 = w2
        self.load_seconds = 0.0
        # [L, E] group index of each hosted pair, -1 where not hosted here.
        self.group_table = torch.full((config.num_layers, config.num_experts), -1, dtype=torch.int64)
        for group, (layer, expert) in enumerate(pairs):
            self.group_table[layer, expert] = group

    @classmethod
    def load(
        cls,
        reader: CheckpointReader,
        pairs: Iterable[ExpertKey],
        dtype: torch.dtype | None = None,
        progress: bool = False,
    ) -> ExpertStack:
        """Loads only the tensors of ``pairs`` from the checkpoint (in ``dtype``, or as stored;
        FP8 experts are dequantised to bfloat16), with a progress bar on a terminal if asked."""
        config = reader.config
        pairs = sorted(set(pairs))
        for layer, expert in pairs:
            if not config.is_moe_layer(layer) or not 0 <= expert < config.num_experts:
                raise ValueError(
                    f"(layer={layer}, expert={expert}) is not a routed expert of this model "
                    f"(MoE layers {config.num_dense_layers}..{config.num_layers - 1}, "
                    f"experts 0..{config.num_experts - 1})"
                )
        h, i = config.hidden_size, config.expert_intermediate_size
        dt = dtype or _stored_dtype(reader, pairs)
        # Each tensor is copied into its place as it is read: peak memory is the stack plus one tensor.
        w13 = torch.empty(len(pairs), 2 * i, h, dtype=dt)
        w2 = torch.empty(len(pairs), h, i, dtype=dt)
        places: dict[str, tuple[torch.Tensor, int, slice]] = {}
        for group, (layer, expert) in enumerate(pairs):
            gate, up, down = expert_tensor_names(config, layer, expert)
            places[gate] = (w13, group, slice(0, i))
            places[up] = (w13, group, slice(i, 2 * i))
            places[down] = (w2, group, slice(None))
        start = time.perf_counter()
        label = f"loading {len(pairs)} experts" if progress else None
        for name, tensor in reader.iter_load(list(places), dtype=dt, progress=label):
            target, group, rows = places[name]
            target[group, rows] = tensor
        seconds = time.perf_counter() - start
        stack = cls(config, pairs, w13, w2)
        stack.load_seconds = seconds
        if pairs:
            rate = stack.nbytes / max(seconds, 1e-9) / 1e9
            log.info(
                "loaded %d experts: %.1f MiB in %.2f s (%.2f GB/s)",
                len(pairs),
                stack.nbytes / 2**20,
                seconds,
                rate,
            )
        return stack

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked weights."""
        return self.w13.numel() * self.w13.element_size() + self.w2.numel() * self.w2.element_size()

    def to(self, device: str | torch.device) -> ExpertStack:
        """This stack with its weights and group table on ``device`` (itself if already there)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.w13.device == device and self.group_table.device == device:
            return self
        stack = ExpertStack(self.config, self.pairs, self.w13.to(device), self.w2.to(device))
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
        return experts_forward(x, group_of, weight_of, self.w13, self.w2, backend=backend)


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
