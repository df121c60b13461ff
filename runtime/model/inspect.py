"""``eaas model inspect``: what a checkpoint holds and what serving it takes, from headers only."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from eaas.runtime.model.checkpoint import CheckpointReader
from eaas.runtime.model.fp8 import SCALE_SUFFIX
from eaas.runtime.model.kv_cache import cache_numbers_per_token
from eaas.runtime.model.naming import attention_side_tensor_shapes, expert_numel, expert_parts

ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}


@dataclass(frozen=True)
class CheckpointSummary:
    family: str
    attention: str
    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    stored_dtypes: dict[str, int]  # dtype -> tensor count (MXFP4 blocks and scales count as U8)
    fp8_block: tuple[int, int] | None
    expert_bytes: int  # one routed expert as it will be served (FP8 dequantised to bf16)
    attention_side_bytes: int  # everything but the routed experts, as served
    kv_bytes_per_token: int  # all layers, in the served dtype
    servers: int
    replication: int

    @property
    def total_expert_bytes(self) -> int:
        return self.expert_bytes * self.num_moe_layers * self.num_experts

    @property
    def experts_per_server(self) -> int:
        """Routed experts on the busiest server for ``servers`` servers and ``replication`` copies."""
        return math.ceil(self.num_moe_layers * self.num_experts * self.replication / self.servers)

    @property
    def bytes_per_server(self) -> int:
        return self.experts_per_server * self.expert_bytes

    def lines(self) -> list[str]:
        dtypes = ", ".join(f"{d} x{n}" for d, n in sorted(self.stored_dtypes.items()))
        fp8 = (
            f" (FP8 blocks {self.fp8_block[0]}x{self.fp8_block[1]}, dequantised on load)"
            if self.fp8_block
            else ""
        )
        return [
            f"family            {self.family} ({self.attention} attention)",
            f"layers            {self.num_layers} ({self.num_moe_layers} MoE)",
            f"experts           {self.num_experts} routed per MoE layer, top-{self.top_k}",
            f"stored dtypes     {dtypes}{fp8}",
            f"one expert        {_size(self.expert_bytes)} as served",
            f"all experts       {_size(self.total_expert_bytes)}",
            f"attention side    {_size(self.attention_side_bytes)} per attention client",
            f"KV cache          {_size(self.kv_bytes_per_token)} per token",
            f"expert server     {_size(self.bytes_per_server)} of weights each "
            f"({self.experts_per_server} experts) for {self.servers} servers at R={self.replication}",
        ]


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def summarize(reader: CheckpointReader, servers: int, replication: int) -> CheckpointSummary:
    """Sizes from safetensors headers (no tensor is read)."""
    if servers < 1 or not 1 <= replication <= servers:
        raise ValueError(
            f"need servers >= 1 and 1 <= replication <= servers, got {servers} and {replication}"
        )
    config = reader.config
    stored = reader.stored_dtypes()
    served = {
        name: 2 if dtype == "F8_E4M3" else ELEMENT_BYTES.get(dtype, 4) for name, dtype in stored.items()
    }

    def served_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
        return sum(math.prod(shape) * served.get(name, 4) for name, shape in shapes.items())

    part = expert_parts(config, config.moe_layers[0], 0)[0].name
    kv_dtype_bytes = served.get("model.embed_tokens.weight", 4)  # the cache takes the activations' dtype
    return CheckpointSummary(
        family=config.family,
        attention=config.attention,
        num_layers=config.num_layers,
        num_moe_layers=len(config.moe_layers),
        num_experts=config.num_experts,
        top_k=config.top_k,
        stored_dtypes=dict(Counter(d for n, d in stored.items() if not n.endswith(SCALE_SUFFIX))),
        fp8_block=reader.fp8_block,
        expert_bytes=expert_numel(config) * (2 if reader.is_mxfp4(part) else served.get(part, 4)),
        attention_side_bytes=served_bytes(attention_side_tensor_shapes(config)),
        kv_bytes_per_token=cache_numbers_per_token(config) * kv_dtype_bytes * config.num_layers,
        servers=servers,
        replication=replication,
    )
