"""Errors an attention client raises to its caller."""

from __future__ import annotations


class ExpertUnavailable(RuntimeError):
    """No live server hosts (layer, expert): the answer cannot be computed (never a wrong answer instead)."""

    def __init__(self, layer: int, expert: int, replicas: list[int]) -> None:
        where = f"its replicas on servers {replicas} are all down" if replicas else "no server hosts it"
        super().__init__(f"expert unavailable: (layer {layer}, expert {expert}): {where}")
        self.layer = layer
        self.expert = expert
        self.replicas = replicas


class HandshakeError(ConnectionError):
    """The control port of an expert server refused or did not answer the slot handshake."""
