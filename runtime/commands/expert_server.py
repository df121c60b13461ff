"""``eaas expert-server``: serve the experts a placement assigns to one ordinal."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from eaas.kernels import available_backends
from eaas.runtime import contract
from eaas.runtime.auth import data_token_options, data_tokens_from
from eaas.runtime.commands.options import (
    apply_threads,
    check_kernel_backend,
    log_level_option,
    model_revision_option,
    placement_configmap_option,
    threads_option,
)
from eaas.runtime.lease import LeaseOptions, drain_timeout_option, lease_options, pool_of
from eaas.runtime.placement import PlacementError
from eaas.runtime.server.process import (
    ExpertServerOptions,
    ExpertServerProcess,
    OptionError,
    peer_source,
    peer_urls,
)
from eaas.runtime.serving.serve import expert_urls
from eaas.runtime.transport import transport_names


@click.command("expert-server")
@click.option(
    "--checkpoint",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="Hugging Face-layout checkpoint; only this server's experts are read",
)
@click.option(
    "--placement",
    "placement_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="placement JSON, read once (written by `eaas local`); or use --placement-dir",
)
@click.option(
    "--placement-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help=f"the mounted placement ConfigMap: serve {contract.PENDING_KEY} (with {contract.PLACEMENT_KEY}) "
    "and follow their changes while running",
)
@click.option(
    "--placement-poll-seconds",
    default=0.25,
    show_default=True,
    help="how often --placement-dir is checked for changes",
)
@placement_configmap_option("--placement-dir and --namespace", "the mounted --placement-dir")
@click.option("--ordinal", type=int, required=True, help="this server's ordinal in the placement")
@click.option("--host", default="127.0.0.1", show_default=True, help="address for the control port and tcp")
@click.option("--control-port", default=0, show_default=True, help="HTTP control port (0 = any free port)")
@click.option("--tcp-port", default=0, show_default=True, help="tcp transport port (0 = any free port)")
@click.option(
    "--transports",
    default="shm,tcp",
    show_default=True,
    help=f"comma-separated transports to offer, of {', '.join(transport_names())}",
)
@click.option("--max-clients", default=16, show_default=True, help="slots per transport")
@click.option(
    "--slot-tokens",
    "--max-tokens",
    "max_tokens",
    default=512,
    show_default=True,
    help="tokens one slot carries per request (clients split larger batches); --max-tokens is its "
    "old name (the serving commands' --max-tokens is new tokens per request)",
)
@click.option(
    "--kernel-backend",
    default="torch",
    show_default=True,
    callback=check_kernel_backend,
    help=f"expert compute backend ({', '.join(available_backends())})",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16", "fp8"]),
    default=None,
    help="weight dtype (default: the checkpoint's; FP8 checkpoints are dequantised to bfloat16 unless "
    "fp8 keeps them block-scaled for the triton and torch backends)",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="where experts live and compute: cpu, cuda or cuda:N (the GPU transports need cuda)",
)
@click.option(
    "--batch-wait-us", default=200.0, show_default=True, help="longest wait for stragglers per batch"
)
@threads_option
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="write {control_port, tcp_port, pid, instance} here once serving",
)
@click.option(
    "--exit-with-parent", type=int, default=None, hidden=True, help="stop when this parent pid is gone"
)
@click.option(
    "--peers-service",
    envvar=contract.ENV_EXPERT_SERVICE,
    show_envvar=True,
    default=None,
    help="fetch the experts other servers of the placement hold from them, at "
    "<pool>-<ordinal>.<this headless Service>:<control port> (set in pods; without it, or where no "
    "live server holds a pair, experts are read from the checkpoint)",
)
@click.option(
    "--peer",
    "peer_specs",
    multiple=True,
    metavar="ORDINAL=URL",
    help="a peer's control URL (repeatable; outside Kubernetes, instead of --peers-service)",
)
@drain_timeout_option(
    "with --placement-dir, serve on until no placement names this server and no client holds a slot"
)
@model_revision_option("attention clients of another revision refuse this server")
@lease_options
@data_token_options
@log_level_option
def expert_server(
    transports: str,
    peer_specs: tuple[str, ...],
    lease: LeaseOptions,
    data_tokens: tuple[str, ...],
    data_token_file: Path | None,
    **values: Any,
) -> None:
    """Serve the (layer, expert) pairs that the placement gives ORDINAL."""
    ordinal, service, control_port = values["ordinal"], values["peers_service"], values["control_port"]
    try:
        options = ExpertServerOptions(
            transports=tuple(t.strip() for t in transports.split(",") if t.strip()),
            heartbeat=lease.settings(contract.EXPERT_COMPONENT, pool_of(lease.pod_name or "", ordinal)),
            data_tokens=(tokens := data_tokens_from(data_tokens, data_token_file)),
            peers=peer_source(ordinal, peer_urls(peer_specs), service_urls(service, control_port), tokens),
            **values,
        )
    except OptionError as exc:
        if exc.flag is None:
            raise click.UsageError(exc.message) from exc
        raise click.BadParameter(exc.message, param_hint=exc.flag) from exc
    logging.basicConfig(
        level=options.log_level.upper(),
        format=f"%(asctime)s expert-server[{ordinal}] %(levelname)s %(message)s",
    )
    apply_threads(options.threads)
    try:
        process = ExpertServerProcess(options)
    except (PlacementError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    process.run()


def service_urls(service: str | None, control_port: int) -> Callable[[int], str] | None:
    """Ordinal -> control URL of the servers behind ``--peers-service`` (None without one)."""
    if not service or control_port <= 0:  # (no port: ExpertServerOptions refuses the pair)
        return None
    try:
        expert_urls([], service, control_port)
    except ValueError as exc:
        raise OptionError("--peers-service", str(exc)) from exc
    return lambda n: expert_urls([n], service, control_port)[n]
