"""Bearer tokens: the API keys of the OpenAI-compatible API and the data token of the expert servers.

``Tokens`` holds the accepted tokens, given directly or read from a file (whitespace-separated,
as a Kubernetes Secret mounted as a volume holds them). A file is read again whenever it changes,
so a rotation needs no restart: write ``new old``, wait until clients present ``new``, then write
``new``. Clients present the first token; servers accept any listed one. Every check compares
the presented token with every accepted one in constant time (no early exit), so timing says
nothing about how much of a token was right.
"""

from __future__ import annotations

import hmac
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from eaas.runtime import contract

F = TypeVar("F", bound=Callable[..., Any])


class Tokens:
    def __init__(self, tokens: tuple[str, ...] = (), path: Path | None = None) -> None:
        self._fixed = tuple(t for token in tokens for t in token.split())
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._from_file: tuple[str, ...] = ()
        if path is not None:
            self.accepted()  # a missing or unreadable file is an error at start, not at the first client

    @property
    def required(self) -> bool:
        return bool(self._fixed) or self.path is not None

    def accepted(self) -> tuple[str, ...]:
        """The tokens accepted now (the file's, re-read if it changed, after the fixed ones)."""
        if self.path is None:
            return self._fixed
        with self._lock:
            stat = os.stat(self.path)  # follows the ..data link a Secret volume swaps on update
            stamp = (stat.st_mtime_ns, stat.st_ino)
            if stamp != self._stamp:
                self._from_file = tuple(self.path.read_text().split())
                self._stamp = stamp
            if not self._from_file:  # every time, not only when the emptied file is first read
                raise ValueError(f"{self.path}: no token in the file")
            return self._fixed + self._from_file

    def presented(self) -> str | None:
        """What a client sends: the first accepted token (None when none is required)."""
        tokens = self.accepted()
        return tokens[0] if tokens else None

    def allows(self, authorization: str | None) -> bool:
        """``Authorization: Bearer <token>`` against every accepted token, each in constant time."""
        tokens = self.accepted()
        if not authorization or not authorization.startswith("Bearer "):
            return False
        presented = authorization[len("Bearer ") :].strip().encode()
        matches = [hmac.compare_digest(presented, token.encode()) for token in tokens]
        return any(matches)


def data_token_options(command: F) -> F:
    """``--data-token`` and ``--data-token-file``: the expert servers' data token, for both roles."""
    command = click.option(
        "--data-token-file",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        envvar=contract.ENV_DATA_TOKEN_FILE,
        show_envvar=True,
        default=None,
        help="file of data tokens (a mounted Secret), read again when it changes",
    )(command)
    return click.option(
        "--data-token",
        "data_tokens",
        multiple=True,
        envvar=contract.ENV_DATA_TOKENS,
        show_envvar=True,
        help="data token the expert servers' slot handshake requires (whitespace-separated in the env; "
        "servers accept each, clients present the first)",
    )(command)


def data_tokens_from(tokens: tuple[str, ...], path: Path | None) -> Tokens:
    try:
        return Tokens(tokens, path)
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"--data-token-file: {exc}") from exc
