"""``eaas attention-client``: generate with remote expert servers.

Two modes, one command (the operator's AttentionPool pods run plain ``eaas attention-client`` with
their settings in ``EAAS_*`` environment variables):

- **serve** when ``--port`` / ``EAAS_PORT`` is set: the OpenAI-compatible HTTP server
  (``serve.AttentionService``); expert servers from ``--server`` or, in Kubernetes, from the
  headless Service in ``EAAS_EXPERT_SERVICE``;
- **one-shot** otherwise: generate ``--prompt``s, print them and exit (checks and scripts).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import click

from eaas.runtime import contract
from eaas.runtime.auth import data_token_options, data_tokens_from
from eaas.runtime.commands.options import (
    apply_threads,
    log_level_option,
    model_revision_option,
    placement_configmap_option,
    serving_feature_options,
    threads_option,
)
from eaas.runtime.lease import LeaseOptions, drain_timeout_option, lease_options
from eaas.runtime.transport import host_transport_names

if TYPE_CHECKING:
    from eaas.runtime.client import ClientOptions


LINGER_S = 5.0  # after SIGTERM: how long requests may still arrive through endpoints not yet updated
QUIET_S = 1.0  # ... and how long nothing may be in flight before the process goes


@dataclass
class Drain:
    """When an attention client that received SIGTERM may exit: once it has lingered
    ``LINGER_S`` (kube-proxy and other routers drop a not-ready endpoint within a few seconds; a
    request they still send is answered) and nothing has been in flight for ``QUIET_S``, or when
    ``timeout_s`` has passed, whatever is left (those requests fail: the grace period is over)."""

    timeout_s: float
    reason: str = ""
    _quiet_since: float | None = None

    def done(self, elapsed: float, idle: bool) -> bool:
        """Fed every poll: seconds since SIGTERM, and whether nothing is in flight now."""
        if not idle:
            self._quiet_since = None
        elif self._quiet_since is None:
            self._quiet_since = elapsed
        quiet = self._quiet_since is not None and elapsed - self._quiet_since >= QUIET_S
        if quiet and elapsed >= min(LINGER_S, self.timeout_s):
            self.reason = f"nothing in flight after {elapsed:.1f} s"
            return True
        if elapsed >= self.timeout_s:
            left = "" if idle else ", requests still in flight"
            self.reason = f"drain timeout ({self.timeout_s:.0f} s){left}"
            return True
        return False


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
    envvar=contract.ENV_CHECKPOINT,
    show_envvar=True,
    required=True,
    help="checkpoint; only the attention side is loaded",
)
@click.option(
    "--placement",
    "placement_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=contract.ENV_PLACEMENT_FILE,
    show_envvar=True,
    required=True,
    help="placement JSON the servers were started with; re-read while serving (it may appear later)",
)
@placement_configmap_option("--port and --namespace", "the mounted --placement file")
@click.option(
    "--server",
    "server_specs",
    multiple=True,
    help="ORDINAL=http://HOST:PORT of an expert server's control port (repeat for each)",
)
@click.option(
    "--expert-service",
    envvar=contract.ENV_EXPERT_SERVICE,
    show_envvar=True,
    help="headless Service of the expert pool, <pool>.<namespace>.svc: ordinal N is reached at "
    "<pool>-N.<pool>.<namespace>.svc (instead of --server)",
)
@click.option(
    "--expert-port",
    type=click.IntRange(1, 65535),
    envvar=contract.ENV_EXPERT_PORT,
    show_envvar=True,
    default=9100,
    show_default=True,
    help="control port of the expert servers with --expert-service",
)
@click.option(
    "--transport",
    type=click.Choice(host_transport_names()),
    envvar=contract.ENV_TRANSPORT,
    show_envvar=True,
    default="tcp",
    show_default=True,
    help="how this client reaches the expert servers (tcp: across hosts, as pods are; eaas serve's "
    "default is shm, every process on one host)",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    envvar=contract.ENV_PORT,
    show_envvar=True,
    help="serve the HTTP API on this port (0: any free port) instead of generating once",
)
@click.option("--host", default="0.0.0.0", show_default=True, help="serve: address to bind")
@click.option(
    "--model-name",
    envvar=contract.ENV_SERVICE,
    show_envvar=True,
    help="serve: the model id of /v1/models (default: the checkpoint directory's name)",
)
@click.option(
    "--max-batch-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="serve: sequences generated together (running at once, with continuous batching)",
)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    envvar=contract.ENV_API_KEYS,
    show_envvar=True,
    help="serve: require this bearer key on /v1/ (repeat, or whitespace-separated in the env, to accept "
    "several during a rotation)",
)
@click.option(
    "--batching",
    type=click.Choice(["continuous", "static"]),
    default="continuous",
    show_default=True,
    envvar="EAAS_BATCHING",
    show_envvar=True,
    help="serve: continuous (iteration-level, paged KV cache) or static (one batch at a time, greedy)",
)
@click.option(
    "--kv-cache-mb",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    envvar="EAAS_KV_CACHE_MB",
    show_envvar=True,
    help="serve: size of the paged KV cache (continuous batching)",
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="serve: waiting sequences before 503",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="serve: most new tokens per request",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="serve: write {port} here once serving",
)
@drain_timeout_option(
    f"(serve) report not ready and answer on until nothing is in flight (at least {LINGER_S:.0f} "
    "s, while the Service forgets this pod)"
)
@lease_options
@data_token_options
@log_level_option
@click.option("--prompt", "prompts", multiple=True, default=["Experts as a service"], show_default=True)
@click.option("--max-new-tokens", default=16, show_default=True)
@click.option(
    "--request-timeout",
    default=30.0,
    show_default=True,
    help="seconds before a server that answers probes but not a request is failed over (hung: ~1 s)",
)
@serving_feature_options
@threads_option
@model_revision_option("uses only expert servers of this revision and names it in every answer")
def attention_client(
    checkpoint: Path,
    placement_path: Path,
    placement_configmap: str | None,
    server_specs: tuple[str, ...],
    expert_service: str | None,
    expert_port: int,
    transport: str,
    port: int | None,
    host: str,
    model_name: str | None,
    tool_call_parser: str,
    reasoning_parser: str,
    structured_outputs_in_reasoning: bool,
    prefix_caching: bool,
    attention: str,
    micro_batches: str,
    default_max_tokens: int | None,
    max_batch_size: int,
    api_keys: tuple[str, ...],
    batching: str,
    kv_cache_mb: int,
    max_queue: int,
    max_tokens: int,
    ready_file: Path | None,
    log_level: str,
    prompts: tuple[str, ...],
    max_new_tokens: int,
    request_timeout: float,
    drain_timeout_seconds: float,
    lease: LeaseOptions,
    data_tokens: tuple[str, ...],
    data_token_file: Path | None,
    threads: int | None,
    model_revision: str | None,
) -> None:
    """Greedy generation with the attention side here and the experts on expert servers.

    With --port (or EAAS_PORT) it serves an OpenAI-compatible API (POST /v1/completions with
    sampling and streaming, GET /v1/models, /healthz, /readyz, /metrics) until SIGTERM; otherwise it
    generates --prompt once (greedy).
    """
    from eaas.runtime.client import ClientOptions

    if server_specs and expert_service:
        raise click.UsageError("give either --server or --expert-service (EAAS_EXPERT_SERVICE), not both")
    if not server_specs and not expert_service:
        raise click.UsageError("expert servers: give --server ORDINAL=URL (repeat) or --expert-service")
    heartbeat = lease.settings(contract.ATTENTION_COMPONENT) if port is not None else None
    apply_threads(threads)
    options = ClientOptions(
        transport=transport,
        request_timeout_s=request_timeout,
        data_tokens=data_tokens_from(data_tokens, data_token_file),
        lease=heartbeat.pod_name if heartbeat else None,  # the servers free our slots when it expires
        revision=model_revision,
    )
    if port is None:
        _one_shot(
            checkpoint,
            placement_path,
            server_specs,
            expert_service,
            expert_port,
            options,
            prompts,
            max_new_tokens,
        )
        return
    from eaas.runtime.lease import Heartbeat
    from eaas.runtime.placement.source import ConfigMapWatch, MountedFiles, PlacementSource
    from eaas.runtime.server.daemon import end_process
    from eaas.runtime.serving.serve import AttentionService, ServeOptions, dns_discovery, static_discovery

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        discovery = (
            static_discovery(_parse_servers(server_specs))
            if server_specs
            else dns_discovery(str(expert_service), expert_port)
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--expert-service") from exc
    serve_options = ServeOptions(
        host=host,
        port=port,
        model_name=model_name or checkpoint.resolve().name,
        model_revision=model_revision,
        max_batch_size=max_batch_size,
        max_queue=max_queue,
        max_tokens=max_tokens,
        batching=batching,
        kv_cache_bytes=kv_cache_mb << 20,
        api_keys=tuple(k for key in api_keys for k in key.split()),
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        structured_outputs_in_reasoning=structured_outputs_in_reasoning,
        prefix_caching=prefix_caching,
        attention=attention,
        micro_batches=micro_batches if micro_batches == "auto" else int(micro_batches),
        default_max_tokens=default_max_tokens,
        client=options,
    )
    watch = (
        ConfigMapWatch(heartbeat.namespace, placement_configmap, heartbeat.kubeconfig)
        if heartbeat is not None and placement_configmap
        else None
    )
    service = AttentionService(
        checkpoint, PlacementSource(MountedFiles(placement_path), watch), discovery, serve_options
    )
    stop = threading.Event()
    leaving = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and not leaving.is_set():
            leaving.set()  # drain: see the loop below
        else:
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    beats = (
        Heartbeat(
            heartbeat,
            lambda: service.placement.version if service.placement else 0,
            lambda: service.worker.busy_seconds if service.worker else 0.0,
            # measured per decoder step: continuous batching only (else no annotation: the size holds)
            (lambda: service.expert_wait) if service.worker is not None else None,
            tpot=service.metrics.recent_tpot.micros,
            failed_over=service.failed_servers,
        )
        if heartbeat
        else None
    )
    if beats is not None:  # a failover reaches the operator now, not at the next renewal
        service.on_liveness = beats.nudge
    with service:
        if beats is not None:
            beats.start()
        if ready_file is not None:
            partial = ready_file.with_name(ready_file.name + ".partial")
            partial.write_text(f'{{"port": {service.port}}}\n')
            partial.replace(ready_file)  # readers never see a half-written file
        click.echo(f"serving {serve_options.model_name} on {service.url}", err=True)
        drain = Drain(drain_timeout_seconds)
        while not stop.wait(0.1):
            if leaving.is_set() and service.leaving_since is None:
                service.begin_leaving()
                if beats is not None:
                    beats.leave(datetime.now(UTC) + timedelta(seconds=drain_timeout_seconds))
            if service.leaving_since is not None and drain.done(
                time.monotonic() - service.leaving_since, service.idle()
            ):
                click.echo(f"left: {drain.reason}", err=True)
                break
        if beats is not None:
            beats.stop()
    click.echo("stopped", err=True)
    end_process(0)  # stopped and closed: no interpreter teardown (its CPU is the node's)


def _one_shot(
    checkpoint: Path,
    placement_path: Path,
    server_specs: tuple[str, ...],
    expert_service: str | None,
    expert_port: int,
    options: ClientOptions,
    prompts: tuple[str, ...],
    max_new_tokens: int,
) -> None:
    from eaas.runtime.client import AttentionClient, ExpertUnavailable, HandshakeError
    from eaas.runtime.model import ByteTokenizer
    from eaas.runtime.placement import PlacementError, stored
    from eaas.runtime.serving.serve import expert_urls

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        placement = stored.unpack(placement_path.read_bytes())
    except (OSError, PlacementError) as exc:
        raise click.BadParameter(str(exc), param_hint="--placement") from exc
    try:
        servers = (
            _parse_servers(server_specs)
            if server_specs
            else expert_urls(placement.ordinals, str(expert_service), expert_port)
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--expert-service") from exc
    try:
        with AttentionClient(checkpoint, placement, servers, options) as client:
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
