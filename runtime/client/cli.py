"""``eaas attention-client``: generate with remote expert servers (one-shot, for checks and scripts)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import click


def _parse_servers(values: tuple[str, ...]) -> dict[int, str]:
    servers = {}
    for value in values:
        ordinal, sep, url = value.partition("=")
        if not sep or not ordinal.strip().isdigit() or not url.startswith("http"):
            raise click.BadParameter(
                f"expected ORDINAL=http://HOST:PORT, got {value!r}", param_hint="--server"
            )
        servers[int(ordinal)] = url
    return servers


@click.command("attention-client")
@click.option(
    "--checkpoint",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="checkpoint; only the attention side is loaded",
)
@click.option(
    "--placement",
    "placement_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="placement JSON the servers were started with",
)
@click.option(
    "--server",
    "server_specs",
    multiple=True,
    required=True,
    help="ORDINAL=http://HOST:PORT of an expert server's control port (repeat for each)",
)
@click.option("--transport", type=click.Choice(["shm", "tcp"]), default="tcp", show_default=True)
@click.option("--prompt", "prompts", multiple=True, default=["Experts as a service"], show_default=True)
@click.option("--max-new-tokens", default=16, show_default=True)
@click.option(
    "--request-timeout", default=30.0, show_default=True, help="seconds before a silent server is failed over"
)
def attention_client(
    checkpoint: Path,
    placement_path: Path,
    server_specs: tuple[str, ...],
    transport: str,
    prompts: tuple[str, ...],
    max_new_tokens: int,
    request_timeout: float,
) -> None:
    """Greedy generation with the attention side here and the experts on expert servers."""
    from eaas.runtime.client import AttentionClient, ClientOptions, ExpertUnavailable, HandshakeError
    from eaas.runtime.model import ByteTokenizer
    from eaas.runtime.placement import Placement, PlacementError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        placement = Placement.from_json(placement_path.read_text())
    except PlacementError as exc:
        raise click.BadParameter(str(exc), param_hint="--placement") from exc
    options = ClientOptions(transport=transport, request_timeout_s=request_timeout)
    try:
        with AttentionClient(checkpoint, placement, _parse_servers(server_specs), options) as client:
            tokenizer = ByteTokenizer(client.config.vocab_size)
            start = time.perf_counter()
            generated, _ = client.generate([tokenizer.encode(p) for p in prompts], max_new_tokens)
            elapsed = time.perf_counter() - start
            failovers = client.experts.counters.failovers
    except (HandshakeError, ExpertUnavailable, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    for prompt, ids in zip(prompts, generated, strict=True):
        click.echo(f"{prompt!r} -> {tokenizer.decode(ids)!r}")
    total = sum(len(g) for g in generated)
    click.echo(f"{total} tokens in {elapsed:.2f} s = {total / elapsed:.1f} tokens/s ({failovers} failovers)")
