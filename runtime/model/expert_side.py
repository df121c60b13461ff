"""The expert side: routed-expert weights of any set of (layer, expert) pairs, stacked in groups.

An expert server hosts the pairs its placement gives it; the reference model hosts them all.
Legend: G = hosted groups (one per (layer, expert)), T = tokens, K = top-k, H = hidden,
I = expert intermediate size, L = layers, E = experts per layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch

from eaas.kernels import experts_forward
from eaas.kernels.activation import Activation, BlockScales
from eaas.runtime.model.checkpoint import CheckpointReader
from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.families import family_spec
from eaas.runtime.model.fp8 import FP8_DTYPE, SCALE_SUFFIX
from eaas.runtime.model.naming import ExpertPart, expert_parts

ExpertKey = tuple[int, int]  # (layer, expert)

log = logging.getLogger(__name__)


def expert_activation(config: MoEConfig) -> Activation:
    return Activation(config.expert_activation, alpha=config.swiglu_alpha, limit=config.swiglu_limit)


class ExpertStack:
    """Stacked weights ``w13`` [G, 2I, H] (gate rows then up rows) and ``w2`` [G, H, I], and with
    ``config.expert_bias`` the biases ``b13`` [G, 2I] and ``b2`` [G, H]. With ``scales`` the
    weights are block-scaled FP8 (kept as the checkpoint stores them; see ``load(keep_fp8=True)``)."""

    def __init__(
        self,
        config: MoEConfig,
        pairs: list[ExpertKey],
        w13: torch.Tensor,
        w2: torch.Tensor,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        scales: BlockScales | None = None,
    ) -> None:
        if config.expert_bias and (b13 is None or b2 is None):
            raise ValueError(f"{config.family} experts have biases: b13 and b2 are required")
        self.config = config
        self.pairs = pairs
        self.w13 = w13
        self.w2 = w2
        self.b13 = b13
        self.b2 = b2
        self.scales = scales
        self.activation = expert_activation(config)
        self.load_seconds = 0.0
        # [L, E] group index of each hosted pair, -1 where not hosted here.
        self.group_table = torch.full((config.num_layers, config.num_experts), -1, dtype=torch.int64)
        for group, (layer, expert) in enumerate(pairs):
            self.group_table[layer, expert] = group

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations are computed in (bfloat16 for FP8 weights)."""
        return torch.bfloat16 if self.scales is not None else self.w13.dtype

    @classmethod
    def empty(
        cls,
        config: MoEConfig,
        num_groups: int,
        dtype: torch.dtype,
        pairs: list[ExpertKey],
        fp8_block: tuple[int, int] | None = None,
    ) -> ExpertStack:
        """A stack of ``num_groups`` uninitialised groups (filled by the caller); FP8 weights with
        their block scales when ``fp8_block`` is given."""
        h, i = config.hidden_size, config.expert_intermediate_size
        weights = FP8_DTYPE if fp8_block else dtype
        w13, w2 = (
            torch.empty(num_groups, 2 * i, h, dtype=weights),
            torch.empty(num_groups, h, i, dtype=weights),
        )
        b13 = torch.empty(num_groups, 2 * i, dtype=dtype) if config.expert_bias else None
        b2 = torch.empty(num_groups, h, dtype=dtype) if config.expert_bias else None
        scales = None
        if fp8_block:
            rows, cols = fp8_block
            s13 = torch.empty(num_groups, 2 * i // rows, -(-h // cols))
            s2 = torch.empty(num_groups, -(-h // rows), -(-i // cols))
            scales = BlockScales(s13, s2, fp8_block)
        return cls(config, pairs, w13, w2, b13, b2, scales)

    @classmethod
    def load(
        cls,
        reader: CheckpointReader,
        pairs: Iterable[ExpertKey],
        dtype: torch.dtype | None = None,
        progress: bool = False,
        keep_fp8: bool = False,
    ) -> ExpertStack:
        """Loads only the tensors (or, for fused storage, the slices) of ``pairs`` from the
        checkpoint, in ``dtype`` or as stored (FP8 and MXFP4 experts are dequantised to the dtype
        config.json declares), with a progress bar on a terminal if asked.

        ``keep_fp8``: keep a block-scaled FP8 checkpoint's experts in FP8 with their scales (the
        ``triton`` and ``torch`` kernel backends compute on them directly).
        """
        config = reader.config
        pairs = sorted(set(pairs))
        cls.check_pairs(config, pairs)
        parts = {
            (part.name, part.index): (part, group)
            for group, pair in enumerate(pairs)
            for part in expert_parts(config, *pair)
        }
        dt = cls.loaded_dtype(reader, pairs, dtype)
        fp8_block = _fp8_block(reader) if keep_fp8 else None
        if fp8_block:
            for (name, index), (part, group) in list(parts.items()):
                parts[(name + SCALE_SUFFIX, index)] = (ExpertPart(name + SCALE_SUFFIX, part.role), group)
        # Each piece is copied into its place as it is read: peak memory is the stack plus one tensor.
        stack = cls.empty(config, len(pairs), dt, pairs, fp8_block)
        start = time.perf_counter()
        label = f"loading {len(pairs)} experts" if progress else None
        refs = list(parts)
        for ref, tensor in reader.iter_load_slices(refs, dtype=dt, progress=label, dequantize=not fp8_block):
            part, group = parts[ref]
            if part.name.endswith(SCALE_SUFFIX):
                stack._place_scale(group, part, tensor)
                continue
            if fp8_block and tensor.dtype != FP8_DTYPE:
                raise ValueError(
                    f"{reader.directory}: {part.name} is {tensor.dtype}, not FP8; load dequantised"
                )
            stack._place(group, part, tensor)
        stack.load_seconds = time.perf_counter() - start
        if pairs:
            rate = stack.nbytes / max(stack.load_seconds, 1e-9) / 1e9
            mib = stack.nbytes / 2**20
            log.info(
                "loaded %d experts: %.1f MiB in %.2f s (%.2f GB/s)", len(pairs), mib, stack.load_seconds, rate
            )
        return stack

    @staticmethod
    def check_pairs(config: MoEConfig, pairs: Iterable[ExpertKey]) -> None:
        """Raises ``ValueError`` naming the first pair that is not a routed expert of the model."""
        for layer, expert in pairs:
            if not config.is_moe_layer(layer) or not 0 <= expert < config.num_experts:
                raise ValueError(
                    f"(layer={layer}, expert={expert}) is not a routed expert of this model "
                    f"(MoE layers {config.num_dense_layers}..{config.num_layers - 1}, "
                    f"experts 0..{config.num_experts - 1})"
                )

    @staticmethod
    def loaded_dtype(
        reader: CheckpointReader, pairs: Sequence[ExpertKey], dtype: torch.dtype | None
    ) -> torch.dtype:
        """The dtype :meth:`load` gives `pairs` (`dtype`, else as the checkpoint stores them)."""
        if dtype is not None:
            return dtype
        if not pairs:
            return torch.float32
        return reader.stored_dtype(expert_parts(reader.config, *min(pairs))[0].name)

    @staticmethod
    def fp8_block(reader: CheckpointReader, keep_fp8: bool) -> tuple[int, int] | None:
        """The FP8 block :meth:`load` keeps the weights in (None: dequantised)."""
        return _fp8_block(reader) if keep_fp8 else None

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

    def _place_scale(self, group: int, part: ExpertPart, scale: torch.Tensor) -> None:
        assert self.scales is not None
        rows = self.config.expert_intermediate_size // self.scales.block[0]
        if part.role == "gate":
            self.scales.w13[group, :rows] = scale
        elif part.role == "up":
            self.scales.w13[group, rows:] = scale
        else:
            self.scales.w2[group] = scale

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
        scales = None
        parts = [source.scales for source, _ in sources]
        if parts and parts[0] is not None:
            if any(p is None for p in parts):
                raise ValueError("FP8 and dequantised stacks cannot be mixed")
            s13 = torch.stack([p.w13[g].to(device) for p, (_, g) in zip(parts, sources, strict=True) if p])
            s2 = torch.stack([p.w2[g].to(device) for p, (_, g) in zip(parts, sources, strict=True) if p])
            scales = BlockScales(s13, s2, parts[0].block)
        return cls(config, pairs, w13, w2, b13, b2, scales).to(device)

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked weights and biases."""
        tensors = [t for t in (self.w13, self.w2, self.b13, self.b2) if t is not None]
        if self.scales is not None:
            tensors += [self.scales.w13, self.scales.w2]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: str | torch.device) -> ExpertStack:
        """This stack with its weights and group table on ``device`` (itself if already there)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.w13.device == device and self.group_table.device == device:
            return self
        b13, b2 = (None if t is None else t.to(device) for t in (self.b13, self.b2))
        scales = None
        if self.scales is not None:
            scales = BlockScales(self.scales.w13.to(device), self.scales.w2.to(device), self.scales.block)
        stack = ExpertStack(self.config, self.pairs, self.w13.to(device), self.w2.to(device), b13, b2, scales)
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
            scales=self.scales,
        )


def _fp8_block(reader: CheckpointReader) -> tuple[int, int]:
    """The checkpoint's FP8 block, when its experts can be kept in FP8 as stacked here."""
    config = reader.config
    block = reader.fp8_block
    if block is None:
        raise ValueError(
            f"{reader.directory}: keeping experts in FP8 needs an FP8 checkpoint (quantization_config)"
        )
    if family_spec(config.family).fused_experts:
        raise ValueError(f"{config.family}: fused experts cannot be kept in FP8")
    if config.expert_intermediate_size % block[0]:
        raise ValueError(
            f"keeping experts in FP8 needs expert_intermediate_size={config.expert_intermediate_size} to be "
            f"a multiple of the FP8 block rows ({block[0]}) so gate and up scales stack; load dequantised"
        )
    return block


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
