"""``eaas expert-server``: serve the experts a placement assigns to one ordinal."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import click

from eaas.kernels import available_backends
from eaas.runtime import contract
from eaas.runtime.auth import data_token_options, data_tokens_from
from eaas.runtime.lease import LeaseOptions, drain_timeout_option, lease_options
from eaas.runtime.serving.cli_options import (
    apply_threads,
    check_kernel_backend,
    log_level_option,
    model_revision_option,
    threads_option,
)
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
    checkpoint: Path,
    placement_path: Path | None,
    placement_dir: Path | None,
    placement_poll_seconds: float,
    ordinal: int,
    host: str,
    control_port: int,
    tcp_port: int,
    transports: str,
    max_clients: int,
    max_tokens: int,
    kernel_backend: str,
    dtype: str | None,
    device: str,
    batch_wait_us: float,
    threads: int | None,
    ready_file: Path | None,
    exit_with_parent: int | None,
    peers_service: str | None,
    peer_specs: tuple[str, ...],
    drain_timeout_seconds: float,
    model_revision: str | None,
    lease: LeaseOptions,
    data_tokens: tuple[str, ...],
    data_token_file: Path | None,
    log_level: str,
) -> None:
    """Serve the (layer, expert) pairs that the placement gives ORDINAL."""
    from eaas.runtime.lease import Heartbeat, pool_of
    from eaas.runtime.placement import PlacementError, stored
    from eaas.runtime.server.client_leases import ClientLeaseWatch
    from eaas.runtime.server.daemon import end_process
    from eaas.runtime.server.departure import Departure
    from eaas.runtime.server.expert_server import ExpertServer, ServerConfig
    from eaas.runtime.server.loop import LoopOptions
    from eaas.runtime.server.peers import holders_in
    from eaas.runtime.server.placement_watch import PlacementFiles, PlacementWatcher, initial_target

    if (placement_path is None) == (placement_dir is None):
        raise click.UsageError("give exactly one of --placement FILE and --placement-dir DIR")
    heartbeat = lease.settings(contract.EXPERT_COMPONENT, pool_of(lease.pod_name or "", ordinal))

    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s expert-server[{ordinal}] %(levelname)s %(message)s"
    )
    apply_threads(threads)
    files = PlacementFiles(placement_dir) if placement_dir is not None else None
    tokens = data_tokens_from(data_tokens, data_token_file)
    peers = peer_source(ordinal, peers_service, peer_specs, control_port, tokens)
    try:
        if files is not None:
            target = initial_target(files, ordinal)
            hosted, version = tuple(sorted(target.pairs)), target.version
            if peers is not None:
                peers.follow(holders_in(*files.read()))
        else:
            assert placement_path is not None
            placement = stored.unpack(placement_path.read_bytes())
            hosted, version = tuple(placement.experts_of(ordinal)), placement.version
            if peers is not None:
                peers.follow(holders_in(placement, None))
        server = ExpertServer(
            ServerConfig(
                checkpoint,
                hosted,
                ordinal=ordinal,
                placement_version=version,
                host=host,
                control_port=control_port,
                tcp_port=tcp_port,
                transports=tuple(t.strip() for t in transports.split(",") if t.strip()),
                max_clients=max_clients,
                max_tokens=max_tokens,
                kernel_backend=kernel_backend,
                dtype=dtype,
                device=device,
                loop=LoopOptions(batch_wait_s=batch_wait_us * 1e-6, exit_with_parent=exit_with_parent),
                data_tokens=tokens,
                peers=peers,
                revision=model_revision,
            )
        )
    except (PlacementError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc

    companions: list[PlacementWatcher | Heartbeat | ClientLeaseWatch | Departure] = []
    beats = (
        Heartbeat(
            heartbeat,
            lambda: server.placement_version,
            lambda: server.loop.busy_seconds,
            routed_tokens=server.load.total,
        )
        if heartbeat is not None
        else None
    )
    watcher = (
        PlacementWatcher(server, files, placement_poll_seconds, beats.nudge if beats is not None else None)
        if files is not None
        else None
    )

    def named() -> bool | None:
        """Whether a placement still names this server: not once the operator wrote on its Lease
        that a committed one does not (a terminating pod's mounted files are not refreshed any
        more), else as the placement files last said."""
        if beats is not None and beats.released:
            return False
        return watcher.named if watcher is not None else None

    departure = (
        Departure(
            server, named, drain_timeout_seconds, beats.leave if beats is not None else lambda deadline: None
        )
        if watcher is not None
        else None
    )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and departure is not None and departure.begin():
            return  # leaving: serves on until its experts are taken over (departure.py)
        server.loop.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "control_port": server.control.port,
                    "tcp_port": server.tcp_port,
                    "pid": os.getpid(),
                    "instance": server.instance,
                    "url": server.url,
                }
            )
        )
        tmp.replace(ready_file)
    logging.getLogger("eaas.server").info(
        "serving %d experts at %s (transports %s)",
        len(server.stack.pairs),
        server.url,
        ",".join(server.transports),
    )
    if watcher is not None:
        companions.append(watcher.start())
    if departure is not None:
        companions.append(departure)
    if heartbeat is not None:
        assert beats is not None
        companions.append(beats.start())
        if heartbeat.service:  # its attention clients' Leases: free the slots of those that expired
            watch = ClientLeaseWatch(
                heartbeat.namespace,
                heartbeat.service,
                heartbeat.interval_s,
                heartbeat.timeout_s,
                server.reap_expired_leases,
                heartbeat.kubeconfig,
            )
            companions.append(watch.start())
    try:
        server.serve_forever()
    finally:
        for companion in companions:
            companion.stop()
    end_process(0)  # served and closed: no interpreter teardown (its CPU is the node's)


def peer_source(
    ordinal: int, service: str | None, specs: tuple[str, ...], control_port: int, tokens: Any
) -> Any:
    """The ``PeerSource`` of ``--peers-service``/``--peer`` (None: experts come from the checkpoint)."""
    from eaas.runtime.server.peers import PeerSource
    from eaas.runtime.serving.serve import expert_urls

    urls: dict[int, str] = {}
    for spec in specs:
        number, sep, url = spec.partition("=")
        if not sep or not number.strip().isdigit() or not url.startswith("http://"):
            raise click.BadParameter(f"expected ORDINAL=http://HOST:PORT, got {spec!r}", param_hint="--peer")
        urls[int(number)] = url.rstrip("/")
    if service:
        if control_port <= 0:
            raise click.BadParameter(
                "needs a fixed --control-port (the peers' port)", param_hint="--peers-service"
            )
        try:
            expert_urls([], service, control_port)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--peers-service") from exc
    if not urls and not service:
        return None

    def url_of(n: int) -> str | None:
        if n in urls:
            return urls[n]
        return expert_urls([n], service, control_port)[n] if service else None

    return PeerSource(url_of, ordinal, tokens)
