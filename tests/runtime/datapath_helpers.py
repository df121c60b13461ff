"""Helpers shared by the data-path tests: in-process expert servers and concurrent clients."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from eaas.runtime.client import AttentionClient, ClientOptions
from eaas.runtime.placement import Placement
from eaas.runtime.server import ExpertServer

PROMPTS: list[list[int]] = [[72, 101, 108, 108, 111], [7, 8], [100, 200, 300, 250], [42]]
MAX_NEW_TOKENS = 5


@contextmanager
def in_process_servers(
    checkpoint: Path, placement: Placement, **options: Any
) -> Iterator[dict[int, ExpertServer]]:
    """Every server of ``placement`` in this process (loop + control port in threads); stopped on exit."""
    with ExitStack() as stack:
        servers = {}
        for ordinal in placement.ordinals:
            server = ExpertServer.from_placement(checkpoint, placement, ordinal, **options)
            stack.callback(server.stop)
            servers[ordinal] = server.start()
        yield servers


def urls(servers: dict[int, ExpertServer]) -> dict[int, str]:
    return {ordinal: server.url for ordinal, server in servers.items()}


def generate_concurrently(
    checkpoint: Path,
    placement: Placement,
    server_urls: dict[int, str],
    transports: Sequence[str],
    prompts: list[list[int]],
    max_new_tokens: int,
    timeout_s: float = 120.0,
) -> list[tuple[list[list[int]], torch.Tensor]]:
    """One attention client per transport, all generating ``prompts`` at the same time."""
    results: list[Any] = [None] * len(transports)

    def work(index: int, client: AttentionClient) -> None:
        try:
            results[index] = client.generate(prompts, max_new_tokens)
        except BaseException as exc:
            results[index] = exc

    with ExitStack() as stack:
        clients = []
        for transport in transports:
            options = ClientOptions(transport=transport, request_timeout_s=10.0)
            client = AttentionClient(checkpoint, placement, server_urls, options)
            stack.callback(client.close)
            clients.append(client.connect())
        threads = [threading.Thread(target=work, args=(i, c), daemon=True) for i, c in enumerate(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
        assert not any(thread.is_alive() for thread in threads), "generation did not finish in time"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
