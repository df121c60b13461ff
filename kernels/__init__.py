"""Expert compute for EaaS: ``experts_forward`` and its backends (see registry)."""

from eaas.kernels.registry import available_backends, experts_forward, get_backend, register_backend

__all__ = ["available_backends", "experts_forward", "get_backend", "register_backend"]
