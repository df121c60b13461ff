"""Kernel backends by name. A backend is a function with the ``experts_forward`` signature.

Built-in backends:

- ``torch``: the per-group loop in plain PyTorch (the reference); runs anywhere.
- ``triton``: Triton kernels (device-side alignment, group shrink, SiLU·mul fused into the first
  GEMM, router weight and combine fused into the second); CUDA, or CPU under ``TRITON_INTERPRET=1``.
- ``grouped_mm``: ``torch._grouped_mm`` over all hosted groups; CUDA SM80+ (CUTLASS fast path for
  bf16 on SM90/SM100), or torch's CPU fallback.

``triton`` and ``grouped_mm`` live in their own modules and are imported on first use, so
``import eaas.kernels`` never imports Triton.

Backends with arguments in their name, built on first use:

- ``simulated:EXPERT_US:ENTRY_US``: the ``torch`` computation stretched to a modelled device time
  (:mod:`eaas.kernels.simulated`); for capacity tests on machines without GPUs, never for serving.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

from eaas.kernels.activation import SILU, Activation, BlockScales
from eaas.kernels.reference import experts_forward_reference


class ExpertsForward(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        group_of: torch.Tensor,
        weight_of: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        activation: Activation = SILU,
        scales: BlockScales | None = None,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, ExpertsForward] = {"torch": experts_forward_reference}

# Built-ins imported lazily: name -> "module:function".
_LAZY_BACKENDS: dict[str, str] = {
    "triton": "eaas.kernels.triton_backend:experts_forward_triton",
    "grouped_mm": "eaas.kernels.grouped_mm_backend:experts_forward_grouped_mm",
}
# Built on first use from the arguments after the first ":" of the name: prefix -> "module:factory".
_FACTORIES: dict[str, str] = {"simulated": "eaas.kernels.simulated:from_arguments"}


def register_backend(name: str, fn: ExpertsForward) -> None:
    """Register ``fn`` under ``name`` (overwrites an earlier registration of the same name)."""
    _LAZY_BACKENDS.pop(name, None)
    _BACKENDS[name] = fn


def available_backends() -> list[str]:
    """Names that :func:`get_backend` accepts (a listed backend may still refuse a device); a
    backend with arguments is listed as ``<prefix>:...``."""
    return sorted({*(n for n in _BACKENDS if n.partition(":")[0] not in _FACTORIES), *_LAZY_BACKENDS}) + [
        f"{prefix}:..." for prefix in sorted(_FACTORIES)
    ]


def check_backend_name(name: str) -> None:
    """``ValueError`` naming the choices unless :func:`get_backend` knows ``name`` (a factory's
    arguments are checked too), without importing a lazily loaded backend."""
    prefix, _, arguments = name.partition(":")
    if name in _BACKENDS or name in _LAZY_BACKENDS:
        return
    if prefix in _FACTORIES:
        _load(_FACTORIES[prefix])(arguments)
        return
    raise ValueError(f"unknown kernel backend {name!r}; available: {', '.join(available_backends())}")


def _load(reference: str) -> Any:
    module_name, attribute = reference.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def get_backend(name: str) -> ExpertsForward:
    if name not in _BACKENDS and name in _LAZY_BACKENDS:
        _BACKENDS[name] = _load(_LAZY_BACKENDS[name])
    prefix, _, arguments = name.partition(":")
    if name not in _BACKENDS and prefix in _FACTORIES:
        _BACKENDS[name] = _load(_FACTORIES[prefix])(arguments)  # ValueError names a bad argument
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown kernel backend {name!r}; available: {', '.join(available_backends())}"
        ) from None


def experts_forward(
    x: torch.Tensor,  # [T, H]
    group_of: torch.Tensor,  # [T, K] int, -1 = skip
    weight_of: torch.Tensor,  # [T, K]
    w13: torch.Tensor,  # [G, 2I, H]
    w2: torch.Tensor,  # [G, H, I]
    backend: str = "torch",
    *,
    b13: torch.Tensor | None = None,  # [G, 2I] gate then up biases
    b2: torch.Tensor | None = None,  # [G, H] down biases
    activation: Activation = SILU,
    scales: BlockScales | None = None,  # FP8 w13/w2: their block scales
) -> torch.Tensor:  # [T, H]
    """For each token, the router-weighted sum over its K entries of the group's gated expert
    ``down(act(gate(x), up(x)))`` (plus the biases, when given)."""
    fn = get_backend(backend)
    if scales is None:
        return fn(x, group_of, weight_of, w13, w2, b13=b13, b2=b2, activation=activation)
    return fn(x, group_of, weight_of, w13, w2, b13=b13, b2=b2, activation=activation, scales=scales)


# The backends this package ships (before any ``register_backend``): what the CLIs' help lists.
SHIPPED_BACKENDS: tuple[str, ...] = tuple(available_backends())
