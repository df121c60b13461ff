"""``YarnScaling``: a checkpoint's rotary scaling, a field of ``MoEConfig`` that the families' config.json
readers build (apart from both, so neither imports the other for it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class YarnScaling(BaseModel):
    """YaRN rotary scaling (``rope_scaling`` / ``rope_parameters`` with type ``yarn``).

    Frequencies are blended between extrapolation and interpolation by ``factor`` over the
    correction range given by ``beta_fast``/``beta_slow``; cos/sin are scaled by the attention
    factor (given, or from ``mscale``/``mscale_all_dim``) and MLA's softmax scale by
    ``mscale(factor, mscale_all_dim)**2``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    factor: float = Field(gt=0.0)
    original_max_position_embeddings: int = Field(ge=1)
    beta_fast: float = Field(default=32.0, gt=0.0)
    beta_slow: float = Field(default=1.0, gt=0.0)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
