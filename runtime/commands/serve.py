"""``eaas serve``: serve a model with an OpenAI-compatible API from a local EaaS cluster of
processes (no Kubernetes), in the style of ``vllm serve``.

    eaas serve /models/Qwen3-30B-A3B --servers 4 --replication 2 --port 8000
    eaas serve --preset mixtral/tiny           # a random model, for trying it out

The expert servers run as local processes (shm by default, or tcp) over a round-robin placement
with R replicas; the attention client (continuous batching) runs in this process and serves
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/healthz``, ``/readyz`` and
``/metrics`` until Ctrl-C (or SIGTERM), then everything stops.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import tempfile
import threading
from pathlib import Path

import click

from eaas.runtime.auth import Tokens
from eaas.runtime.commands.options import (
    apply_threads,
    kernel_backend_option,
    log_level_option,
    serving_feature_options,
)
from eaas.runtime.model.config import FAMILIES
from eaas.runtime.transport import host_transport_names


@click.command("serve")
@click.argument("checkpoint", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--preset",
    "preset_spec",
    default=None,
    envvar="EAAS_PRESET",
    help=f"serve a random model of FAMILY/PRESET instead of a checkpoint (families: {', '.join(FAMILIES)})",
)
@click.option("--servers", "num_servers", default=2, show_default=True, help="expert-server processes")
@click.option("--replication", default=1, show_default=True, help="replicas of every (layer, expert)")
@click.option(
    "--transport",
    type=click.Choice(host_transport_names()),
    default="shm",
    show_default=True,
    help="how the attention client reaches the expert servers (shm: every process is on this host; "
    "attention-client's default is tcp, for pods on several hosts)",
)
@click.option("--host", default="127.0.0.1", show_default=True, envvar="EAAS_HOST", show_envvar=True)
@click.option("--port", default=8000, show_default=True, envvar="EAAS_PORT", show_envvar=True)
@click.option(
    "--served-model-name", default=None, help="model id of the API (default: the checkpoint's name)"
)
@click.option(
    "--batching", type=click.Choice(["continuous", "static"]), default="continuous", show_default=True
)
@click.option("--max-num-seqs", default=32, show_default=True, help="sequences running at once")
@click.option("--kv-cache-mb", default=256, show_default=True, help="size of the paged KV cache")
@click.option("--max-tokens", default=1024, show_default=True, help="most new tokens per request")
@kernel_backend_option
@click.option(
    "--api-key",
    default=None,
    envvar="EAAS_API_KEY",
    show_envvar=True,
    help="require this bearer key on /v1/ (401 otherwise)",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write {port} here once serving (for scripts)",
)
@log_level_option
@serving_feature_options
def serve(
    checkpoint: Path | None,
    preset_spec: str | None,
    num_servers: int,
    replication: int,
    transport: str,
    host: str,
    port: int,
    served_model_name: str | None,
    batching: str,
    max_num_seqs: int,
    kv_cache_mb: int,
    max_tokens: int,
    kernel_backend: str,
    api_key: str | None,
    ready_file: Path | None,
    tool_call_parser: str,
    reasoning_parser: str,
    structured_outputs_in_reasoning: bool,
    prefix_caching: bool,
    attention: str,
    micro_batches: str,
    default_max_tokens: int | None,
    log_level: str,
) -> None:
    """Serve CHECKPOINT (or a random --preset model) with an OpenAI-compatible API."""
    from eaas.runtime.client import ClientOptions
    from eaas.runtime.local.cluster import ClusterError, LocalCluster
    from eaas.runtime.model import CheckpointReader
    from eaas.runtime.model.checkpoint import CheckpointError
    from eaas.runtime.placement import round_robin
    from eaas.runtime.serving.serve import AttentionService, ServeOptions, static_discovery

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (checkpoint is None) == (preset_spec is None):
        raise click.UsageError("give a CHECKPOINT directory or --preset FAMILY/PRESET (e.g. mixtral/tiny)")
    if not 1 <= replication <= num_servers:
        raise click.BadParameter(
            f"must be in [1, --servers={num_servers}], got {replication}", param_hint="--replication"
        )
    with tempfile.TemporaryDirectory(prefix="eaas-serve-") as tmp:
        workdir = Path(tmp)
        if checkpoint is None:
            checkpoint = _random_checkpoint(str(preset_spec), workdir)
        try:
            config = CheckpointReader(checkpoint).config
        except (CheckpointError, ValueError) as exc:
            raise click.ClickException(str(exc)) from exc
        placement = round_robin(config.moe_layers, config.num_experts, num_servers, replication=replication)
        random_weights = preset_spec is not None  # a preset is written with random weights
        name = served_model_name or (preset_spec if preset_spec else checkpoint.resolve().name)
        click.echo(
            f"model {name}: {config.family}, {config.num_layers} layers ({len(config.moe_layers)} MoE), "
            f"{config.num_experts} experts top-{config.top_k}, {config.attention} attention",
            err=True,
        )
        click.echo(f"starting {num_servers} expert servers ({transport}, R={replication}) ...", err=True)
        data_token = secrets.token_urlsafe(24)  # only this client may take the servers' slots
        try:
            cluster = LocalCluster(
                checkpoint,
                placement,
                workdir / "cluster",
                transports=(transport,),
                kernel_backend=kernel_backend,
                data_token=data_token,
            ).start()
        except ClusterError as exc:
            raise click.ClickException(f"expert servers did not start: {exc}") from exc
        apply_threads(cluster.client_threads())  # the cores the expert servers leave this process
        try:
            for ordinal in placement.ordinals:
                pairs, url = len(list(placement.experts_of(ordinal))), cluster.urls[ordinal]
                click.echo(f"  expert server {ordinal}: {pairs} (layer, expert) pairs at {url}", err=True)
            options = ServeOptions(
                host=host,
                port=port,
                model_name=name,
                max_batch_size=max_num_seqs,
                max_tokens=max_tokens,
                batching=batching,
                kv_cache_bytes=kv_cache_mb << 20,
                api_keys=(api_key,) if api_key else (),
                tool_call_parser=tool_call_parser,
                reasoning_parser=reasoning_parser,
                structured_outputs_in_reasoning=structured_outputs_in_reasoning,
                prefix_caching=prefix_caching,
                attention=attention,
                micro_batches=micro_batches if micro_batches == "auto" else int(micro_batches),
                default_max_tokens=default_max_tokens,
                client=ClientOptions(transport=transport, data_tokens=Tokens((data_token,))),
            )
            stop = threading.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            with AttentionService(
                checkpoint, cluster.placement_path, static_discovery(cluster.urls), options
            ) as service:
                if ready_file is not None:
                    partial = ready_file.with_name(ready_file.name + ".partial")
                    partial.write_text(json.dumps({"port": service.port}) + "\n")
                    partial.replace(ready_file)
                if random_weights:
                    click.echo(
                        f"{name} has random weights (a preset, for trying EaaS out): its answers are "
                        "noise; serve a real checkpoint with `eaas serve CHECKPOINT`",
                        err=True,
                    )
                click.echo(
                    f"serving {name} on {service.url}/v1 ({batching} batching); Ctrl-C stops\n"
                    f"  curl {service.url}/v1/chat/completions -H 'Content-Type: application/json' "
                    f'-d \'{{"model": "{name}", "messages": [{{"role": "user", "content": "hi"}}]}}\'',
                    err=True,
                )
                while not stop.wait(0.5):
                    pass
        finally:
            cluster.stop()
    click.echo("stopped", err=True)


def _random_checkpoint(spec: str, workdir: Path) -> Path:
    from eaas.runtime.model import preset_of_spec, write_random_checkpoint

    try:
        config = preset_of_spec(spec)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--preset") from exc
    click.echo(f"writing a random {spec} checkpoint ...", err=True)
    return write_random_checkpoint(config, workdir / "checkpoint", seed=0)
