"""``eaas local``: an EaaS cluster of local processes (no Kubernetes), generating text end to end."""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import click

from eaas.runtime.auth import Tokens
from eaas.runtime.commands.options import apply_threads, kernel_backend_option
from eaas.runtime.model.config import FAMILIES, Family
from eaas.runtime.transport import host_transport_names

if TYPE_CHECKING:
    from eaas.runtime.local.session import ClientRun, KillPlan


@click.command("local")
@click.option("--family", type=click.Choice(FAMILIES), default="mixtral", show_default=True)
@click.option(
    "--preset", "preset_name", default="tiny", show_default=True, help="model preset (random weights)"
)
@click.option(
    "--checkpoint",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="use this checkpoint instead of a random one",
)
@click.option("--servers", "num_servers", default=4, show_default=True, help="expert-server processes")
@click.option("--replication", default=2, show_default=True, help="replicas of every (layer, expert)")
@click.option("--transport", type=click.Choice(host_transport_names()), default="shm", show_default=True)
@click.option(
    "--clients", "num_clients", default=1, show_default=True, help="attention clients generating at once"
)
@click.option("--prompts", "num_prompts", default=8, show_default=True)
@click.option("--max-new-tokens", default=24, show_default=True)
@click.option(
    "--kill-server-after",
    type=int,
    default=None,
    help="SIGKILL one expert server when generation reaches this step (shows failover)",
)
@click.option("--kill-ordinal", type=int, default=1, show_default=True, help="which server to kill")
@kernel_backend_option
@click.option(
    "--request-timeout",
    default=30.0,
    show_default=True,
    help="seconds before a server that answers probes but not a request is failed over (hung: ~1 s)",
)
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="compare with the single-process reference model",
)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="keep checkpoint, placement and server logs here (default: a temporary directory)",
)
def local(
    family: str,
    preset_name: str,
    checkpoint: Path | None,
    num_servers: int,
    replication: int,
    transport: str,
    num_clients: int,
    num_prompts: int,
    max_new_tokens: int,
    kill_server_after: int | None,
    kill_ordinal: int,
    kernel_backend: str,
    request_timeout: float,
    verify: bool,
    seed: int,
    workdir: Path | None,
) -> None:
    """Run expert servers + attention clients locally and generate text."""
    import torch

    from eaas.runtime.client import ClientOptions
    from eaas.runtime.local.cluster import LocalCluster
    from eaas.runtime.local.session import DEMO_PROMPTS, KillPlan, run_clients
    from eaas.runtime.model import ByteTokenizer, CheckpointReader, preset, write_random_checkpoint
    from eaas.runtime.placement import PlacementError, round_robin

    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(seed)
    if num_prompts < 1 or num_clients < 1 or num_clients > num_prompts:
        raise click.BadParameter("need 1 <= --clients <= --prompts", param_hint="--clients")
    if kill_server_after is not None and not 0 <= kill_ordinal < num_servers:
        raise click.BadParameter(f"must be in [0, {num_servers})", param_hint="--kill-ordinal")
    root = workdir or Path(tempfile.mkdtemp(prefix="eaas-local-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        random = checkpoint is None
        if checkpoint is None:
            model = preset(cast(Family, family), preset_name)
            checkpoint = write_random_checkpoint(model, root / "checkpoint", seed=seed)
        config = CheckpointReader(checkpoint).config
        try:
            placement = round_robin(
                config.moe_layers, config.num_experts, num_servers, replication=replication
            )
        except PlacementError as exc:
            raise click.BadParameter(str(exc), param_hint="--servers/--replication") from exc
        tokenizer = ByteTokenizer(config.vocab_size)
        texts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(num_prompts)]
        prompts = [tokenizer.encode(t) for t in texts]
        click.echo(
            f"model {config.family} (hidden {config.hidden_size}, {len(config.moe_layers)} MoE layers x "
            f"{config.num_experts} experts, top-{config.top_k}); placement: {num_servers} servers, "
            f"replication {replication}, {len(placement.experts_of(0))} (layer, expert) pairs on server 0"
        )
        started = time.perf_counter()
        data_token = secrets.token_urlsafe(24)  # only these clients may take the servers' slots
        cluster_dir = root / "cluster"
        transports = tuple(dict.fromkeys(("shm", "tcp", transport)))  # what the servers offer
        with LocalCluster(
            checkpoint,
            placement,
            cluster_dir,
            transports=transports,
            kernel_backend=kernel_backend,
            data_token=data_token,
        ) as cluster:
            threads = torch.get_num_threads()
            apply_threads(cluster.client_threads())  # the cores the servers leave
            pids = ", ".join(f"{o}:{s.pid}" for o, s in cluster.servers.items())
            click.echo(
                f"started {num_servers} expert servers in {time.perf_counter() - started:.1f} s (pids {pids})"
            )
            batches = [prompts[i::num_clients] for i in range(num_clients)]
            kill = KillPlan(kill_server_after, kill_ordinal) if kill_server_after is not None else None
            options = ClientOptions(
                transport=transport, request_timeout_s=request_timeout, data_tokens=Tokens((data_token,))
            )
            wall = time.perf_counter()
            runs = run_clients(checkpoint, placement, cluster, batches, max_new_tokens, options, kill)
            wall = time.perf_counter() - wall
        torch.set_num_threads(threads)  # the reference below runs alone
        failed = [run for run in runs if run.error is not None]
        if failed:
            raise click.ClickException(f"{len(failed)} client(s) failed: {failed[0].error!r}")
        by_prompt: dict[int, list[int]] = {}
        for index, run in enumerate(runs):
            for j, tokens in enumerate(run.tokens):
                by_prompt[index + j * num_clients] = tokens
        note = (
            " (random weights: the text is noise, the point is that it is the same noise)" if random else ""
        )
        click.echo(f"\ngenerated{note}:")
        for i, text in enumerate(texts):
            click.echo(f"  {text!r} -> {_printable(tokenizer.decode(by_prompt[i]))!r}")
        total = num_prompts * max_new_tokens
        click.echo(
            f"\n{total} tokens from {num_clients} client(s) over {transport} in {wall:.2f} s = "
            f"{total / wall:.1f} tokens/s"
        )
        if kill is not None:
            _report_failover(kill, runs)
        if verify:
            _verify(checkpoint, runs, max_new_tokens)
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def _printable(text: str) -> str:
    return "".join(c if c.isascii() and c.isprintable() else "·" for c in text)


def _report_failover(kill: KillPlan, runs: list[ClientRun]) -> None:
    if kill.done_at is None:
        click.echo("no server was killed (generation ended before that step)")
        return
    click.echo(
        f"failover: SIGKILL expert server {kill.ordinal} (pid {kill.pid}) at decode step {kill.after_steps}"
    )
    for index, run in enumerate(runs):
        for event in run.events:
            if event.kind == "failed":
                click.echo(
                    f"  client {index}: server {event.server} failed at layer {event.layer}: {event.detail}"
                )
            elif event.kind == "resent":
                click.echo(
                    f"  client {index}: re-sent {event.resent_entries} (token, expert) entries to replicas"
                )
            else:
                click.echo(f"  client {index}: server {event.server} {event.kind}: {event.detail}")
    click.echo("  no request lost, no client restarted")


def _verify(checkpoint: Path, runs: list[ClientRun], max_new_tokens: int) -> None:
    from eaas.runtime.model import load_reference

    reference = load_reference(checkpoint)
    worst = 0.0
    same = True
    for run in runs:
        tokens, logits = reference.generate(run.prompts, max_new_tokens)
        same &= tokens == run.tokens
        assert run.logits is not None
        worst = max(worst, float((logits - run.logits).abs().max()))
    verdict = "identical" if same else "DIFFERENT"
    click.echo(f"tokens {verdict} to the single-process reference model (max |logit difference| {worst:.1e})")
    if not same:
        raise click.ClickException("the distributed output differs from the reference")
