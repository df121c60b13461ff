"""Kernel tests run on CUDA when it is there, else on CPU through Triton's interpreter.

``TRITON_INTERPRET`` must be set before the Triton kernel modules are imported (Triton decides
at decoration time), so it is set here, before any test module imports them.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
