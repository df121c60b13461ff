"""Where the Triton kernels can run, and the errors a user gets when they cannot.

Triton decides at import (decoration) time whether a kernel is compiled for the GPU or run by
its CPU interpreter: ``TRITON_INTERPRET=1`` must be set before the kernel modules are imported.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

import torch


def import_triton() -> ModuleType:
    """Import ``triton`` or raise an error that says how to get it."""
    try:
        import triton
    except ImportError as error:  # pragma: no cover - triton ships with the Linux install
        raise RuntimeError(
            "the 'triton' kernel backend needs the triton package (installed with torch on Linux); "
            "use backend='torch' or backend='grouped_mm' instead"
        ) from error
    return triton


def is_interpreted(kernel: Any) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` object) runs in Triton's CPU interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"


def require_runnable(device: torch.device, kernel: Any) -> None:
    """Raise a clear error when ``kernel`` cannot run on tensors on ``device``."""
    if is_interpreted(kernel):
        return  # the interpreter runs on CPU tensors (and copies CUDA tensors through the host)
    if device.type == "cuda":
        return
    hint = (
        "TRITON_INTERPRET=1 is set but the kernels were imported before it"
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        else "set TRITON_INTERPRET=1 before importing eaas.kernels' Triton modules (slow; for tests)"
    )
    raise RuntimeError(
        f"the 'triton' kernel backend runs on CUDA tensors; got tensors on {device}. "
        f"To run it on CPU: {hint}. Otherwise use backend='torch'."
    )


@functools.lru_cache(maxsize=16)
def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (cached)."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` for CUDA devices, else ``"cpu"``."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type
