"""The reference MoE model: config, checkpoints, attention side, expert side, decoder.

The names below load on first use (PEP 562), so that importing a torch-free submodule
(:mod:`~eaas.runtime.model.config`, :mod:`~eaas.runtime.model.presets`: what the operator
validates model shapes with) does not load torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eaas.runtime.model.attention_side import AttentionSide
    from eaas.runtime.model.checkpoint import CheckpointError, CheckpointReader, write_random_checkpoint
    from eaas.runtime.model.config import FAMILIES, MoEConfig
    from eaas.runtime.model.decoder import Decoder, MoEExecutor
    from eaas.runtime.model.expert_side import ExpertStack, LocalExperts
    from eaas.runtime.model.kv_cache import KVCache, KVCacheFull
    from eaas.runtime.model.presets import preset, preset_names, preset_of_spec
    from eaas.runtime.model.reference import load_reference
    from eaas.runtime.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, write_byte_tokenizer

_SUBMODULE = {
    "AttentionSide": "attention_side",
    "CheckpointError": "checkpoint",
    "CheckpointReader": "checkpoint",
    "write_random_checkpoint": "checkpoint",
    "FAMILIES": "config",
    "MoEConfig": "config",
    "Decoder": "decoder",
    "MoEExecutor": "decoder",
    "ExpertStack": "expert_side",
    "LocalExperts": "expert_side",
    "KVCache": "kv_cache",
    "KVCacheFull": "kv_cache",
    "preset": "presets",
    "preset_names": "presets",
    "preset_of_spec": "presets",
    "load_reference": "reference",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "write_byte_tokenizer": "tokenizer",
}


def __getattr__(name: str) -> Any:
    submodule = _SUBMODULE.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBMODULE])


__all__ = [
    "FAMILIES",
    "AttentionSide",
    "ByteTokenizer",
    "CheckpointError",
    "CheckpointReader",
    "Decoder",
    "ExpertStack",
    "HFTokenizer",
    "KVCache",
    "KVCacheFull",
    "LocalExperts",
    "MoEConfig",
    "MoEExecutor",
    "load_reference",
    "load_tokenizer",
    "preset",
    "preset_names",
    "preset_of_spec",
    "write_byte_tokenizer",
    "write_random_checkpoint",
]
