"""The reference MoE model: config, checkpoints, attention side, expert side, decoder."""

from eaas.runtime.model.attention_side import AttentionSide
from eaas.runtime.model.checkpoint import CheckpointError, CheckpointReader, write_random_checkpoint
from eaas.runtime.model.config import FAMILIES, MoEConfig
from eaas.runtime.model.decoder import Decoder, MoEExecutor
from eaas.runtime.model.expert_side import ExpertStack, LocalExperts
from eaas.runtime.model.kv_cache import KVCache, KVCacheFull
from eaas.runtime.model.presets import preset, preset_names, preset_of_spec
from eaas.runtime.model.reference import load_reference
from eaas.runtime.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, write_byte_tokenizer

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
