"""The model families EaaS serves, registered by name (the Hugging Face ``model_type``).

Adding a family: write ``families/<model_type>.py`` with a ``SPEC`` (see ``base.FamilySpec``),
add it to ``_MODULES`` below and to ``config.Family``, and add a tiny preset; the parity tests
then load a checkpoint ``transformers`` wrote for it. docs/models.md walks through it.
"""

from __future__ import annotations

import importlib

from eaas.runtime.model.families.base import FamilySpec, HFConfig, write_common

_MODULES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
_SPECS: dict[str, FamilySpec] = {}


def family_spec(name: str) -> FamilySpec:
    """The registered family ``name``; a ValueError names the known ones."""
    if not _SPECS:
        for module in _MODULES:
            spec = importlib.import_module(f"{__name__}.{module}").SPEC
            _SPECS[spec.name] = spec
    if name not in _SPECS:
        raise ValueError(f"family: must be one of {', '.join(_SPECS)}, got {name!r}")
    return _SPECS[name]


__all__ = ["FamilySpec", "HFConfig", "family_spec", "write_common"]
