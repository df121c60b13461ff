"""The one protocol exception: a status code the server answers with, and a message naming the field."""

from __future__ import annotations

from eaas.runtime.protocol.header import Status


class ProtocolError(ValueError):
    """A refused request: ``status`` goes back in the response header, ``message`` in its payload."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message
