"""One expert-server process: its options (``ExpertServerOptions``, what ``eaas expert-server`` is
told, checked once) and ``ExpertServerProcess``, which starts the server they describe and runs it with
its companions (placement watcher, Lease heartbeat, client-Lease reaper, departure) until stopped."""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from eaas.runtime.auth import Tokens
from eaas.runtime.lease import Heartbeat, LeaseSettings
from eaas.runtime.placement import stored
from eaas.runtime.placement.source import ConfigMapWatch, MountedFiles, PlacementSource
from eaas.runtime.server.client_leases import ClientLeaseWatch
from eaas.runtime.server.daemon import end_process
from eaas.runtime.server.departure import Departure
from eaas.runtime.server.expert_server import ExpertServer, ServerConfig
from eaas.runtime.server.loop import LoopOptions
from eaas.runtime.server.peers import PeerSource, holders_in
from eaas.runtime.server.placement_watch import PlacementWatcher, initial_target


class OptionError(ValueError):
    """Options that do not go together; ``flag`` names the one to change (None: the message does)."""

    def __init__(self, flag: str | None, message: str) -> None:
        super().__init__(message)
        self.flag = flag
        self.message = message


@dataclass(frozen=True)
class ExpertServerOptions:
    """Everything one expert-server process is told (``eaas expert-server --help`` has each flag)."""

    checkpoint: Path  # Hugging Face-layout checkpoint; only this server's experts are read
    ordinal: int  # this server's ordinal in the placement
    placement_path: Path | None = None  # placement JSON, read once (`eaas local`) ...
    placement_dir: Path | None = None  # ... or the mounted placement ConfigMap, followed while running
    placement_poll_seconds: float = 0.25
    # With placement_dir and a heartbeat (its namespace and credentials): the placement ConfigMap,
    # watched on the API server so that a change arrives in seconds, not at the kubelet's next sync
    placement_configmap: str | None = None
    host: str = "127.0.0.1"  # address of the control port and the tcp transport
    control_port: int = 0  # 0 = any free port
    tcp_port: int = 0
    transports: tuple[str, ...] = ("shm", "tcp")
    max_clients: int = 16  # slots per transport
    max_tokens: int = 512  # tokens one slot carries per request
    kernel_backend: str = "torch"
    dtype: str | None = None  # None = the checkpoint's
    device: str = "cpu"
    batch_wait_us: float = 200.0  # longest wait for stragglers per batch
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    ready_file: Path | None = None  # {control_port, tcp_port, pid, instance, url} once serving
    exit_with_parent: int | None = None  # stop when this parent pid is gone
    peers_service: str | None = None  # headless Service of the placement's servers, to fetch experts from
    peers: PeerSource | None = None  # live servers to fetch experts from (None: the checkpoint)
    drain_timeout_seconds: float = 25.0  # with placement_dir: longest departure on SIGTERM
    model_revision: str | None = None
    heartbeat: LeaseSettings | None = None  # the Lease to keep (None outside Kubernetes)
    data_tokens: Tokens = field(default_factory=Tokens)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if (self.placement_path is None) == (self.placement_dir is None):
            raise OptionError(None, "give exactly one of --placement FILE and --placement-dir DIR")
        if self.peers_service and self.control_port <= 0:
            raise OptionError("--peers-service", "needs a fixed --control-port (the peers' port)")


def peer_urls(specs: tuple[str, ...]) -> dict[int, str]:
    """``--peer ORDINAL=URL`` values: ordinal -> control URL."""
    urls: dict[int, str] = {}
    for spec in specs:
        number, sep, url = spec.partition("=")
        if not sep or not number.strip().isdigit() or not url.startswith("http://"):
            raise OptionError("--peer", f"expected ORDINAL=http://HOST:PORT, got {spec!r}")
        urls[int(number)] = url.rstrip("/")
    return urls


def peer_source(
    ordinal: int,
    urls: dict[int, str],
    service_urls: Callable[[int], str] | None,
    tokens: Tokens,
) -> PeerSource | None:
    """The ``PeerSource`` of ``--peer`` URLs and, for the others, ``service_urls`` (the servers behind
    ``--peers-service``); None where there is neither (experts come from the checkpoint)."""
    if not urls and service_urls is None:
        return None

    def url_of(n: int) -> str | None:
        if n in urls:
            return urls[n]
        return service_urls(n) if service_urls is not None else None

    return PeerSource(url_of, ordinal, tokens)


def placement_source(options: ExpertServerOptions) -> PlacementSource | None:
    """What the server follows with a placement directory: its files, and the placement ConfigMap's
    watch where the ConfigMap, its namespace and the credentials are known (None without a
    directory: ``--placement`` is read once)."""
    if options.placement_dir is None:
        return None
    heartbeat = options.heartbeat
    watch = (
        ConfigMapWatch(heartbeat.namespace, options.placement_configmap, heartbeat.kubeconfig)
        if options.placement_configmap and heartbeat is not None
        else None
    )
    return PlacementSource(MountedFiles.directory(options.placement_dir), watch)


class ExpertServerProcess:
    """The server of `options`, started (its experts loaded) on construction, which raises
    ``PlacementError``, ``ValueError`` or ``OSError`` on a placement, checkpoint or port it cannot use."""

    def __init__(self, options: ExpertServerOptions) -> None:
        self.options = options
        self.source = placement_source(options)
        peers = options.peers
        if self.source is not None:
            try:
                target = initial_target(self.source.start(), options.ordinal)
                if peers is not None:
                    peers.follow(holders_in(*self.source.read().parse()))
            except BaseException:
                self.source.stop()
                raise
            hosted, version = tuple(sorted(target.pairs)), target.version
        else:
            assert options.placement_path is not None
            placement = stored.unpack(options.placement_path.read_bytes())
            hosted, version = tuple(placement.experts_of(options.ordinal)), placement.version
            if peers is not None:
                peers.follow(holders_in(placement, None))
        self.server = ExpertServer(
            ServerConfig(
                options.checkpoint,
                hosted,
                ordinal=options.ordinal,
                placement_version=version,
                host=options.host,
                control_port=options.control_port,
                tcp_port=options.tcp_port,
                transports=options.transports,
                max_clients=options.max_clients,
                max_tokens=options.max_tokens,
                kernel_backend=options.kernel_backend,
                dtype=options.dtype,
                device=options.device,
                loop=LoopOptions(
                    batch_wait_s=options.batch_wait_us * 1e-6, exit_with_parent=options.exit_with_parent
                ),
                data_tokens=options.data_tokens,
                peers=peers,
                revision=options.model_revision,
            )
        )

    def run(self) -> None:
        """Serve until SIGINT, or SIGTERM (with a placement directory: once departed), then end the
        process."""
        options, server, source, heartbeat = self.options, self.server, self.source, self.options.heartbeat
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
            PlacementWatcher(
                server, source, options.placement_poll_seconds, beats.nudge if beats is not None else None
            )
            if source is not None
            else None
        )

        # What the placement said when SIGTERM came. A server that keeps a Lease leaves on the
        # operator's word (its release, written once every live client routes by a placement
        # without it), not on its own reading of the watched placement: a client that reads its
        # placement late may still attach here until then.
        at_sigterm: list[bool | None] = []

        def named() -> bool | None:
            """Whether a placement still names this server: not once the operator wrote on its Lease
            that a committed one does not; with a Lease, otherwise as the placement said at SIGTERM;
            without one, as the placement last said."""
            if beats is not None and beats.released:
                return False
            if beats is not None and at_sigterm:
                return at_sigterm[0]
            return watcher.named if watcher is not None else None

        departure = (
            Departure(
                server,
                named,
                options.drain_timeout_seconds,
                beats.leave if beats is not None else lambda deadline: None,
            )
            if watcher is not None
            else None
        )

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if signum == signal.SIGTERM and watcher is not None and not at_sigterm:
                at_sigterm.append(watcher.named)
            if signum == signal.SIGTERM and departure is not None and departure.begin():
                return  # leaving: serves on until its experts are taken over (departure.py)
            server.loop.stop_event.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if options.ready_file is not None:
            tmp = options.ready_file.with_suffix(".tmp")
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
            tmp.replace(options.ready_file)
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
            if source is not None:
                source.stop()
        end_process(0)  # served and closed: no interpreter teardown (its CPU is the node's)
