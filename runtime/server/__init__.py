"""The expert server: hosts (layer, expert) pairs, serves slots over every enabled transport."""

from eaas.runtime.server.expert_server import ExpertServer, ServerConfig
from eaas.runtime.server.loop import LoopOptions

__all__ = ["ExpertServer", "LoopOptions", "ServerConfig"]
