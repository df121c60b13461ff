"""``eaas model``: random checkpoints, presets and reference generation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from eaas.runtime.model.config import FAMILIES


@click.group()
def model() -> None:
    """Random checkpoints, presets, inspecting a checkpoint, reference generation."""


@model.command("presets")
def presets_cmd() -> None:
    """List the presets of every family."""
    from eaas.runtime.model.presets import preset, preset_names

    rows = [
        (
            family,
            name,
            f"layers={c.num_layers} hidden={c.hidden_size} experts={c.num_experts} top_k={c.top_k} "
            f"expert_intermediate={c.expert_intermediate_size}",
        )
        for family in FAMILIES
        for name in preset_names(family)
        for c in [preset(family, name)]
    ]
    family_width = max(len(row[0]) for row in rows)
    name_width = max(len(row[1]) for row in rows)
    for family, name, shape in rows:
        click.echo(f"{family:{family_width}s}  {name:{name_width}s}  {shape}".rstrip())


@model.command("init")
@click.option("--family", type=click.Choice(FAMILIES), required=True)
@click.option("--preset", "preset_name", default="tiny", show_default=True, help="see `eaas model presets`")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True
)
@click.option(
    "--max-shard-mb", default=2048.0, show_default=True, help="split tensors into shards of this size"
)
@click.option(
    "--fp8-block",
    type=int,
    default=None,
    help="store projections as block-scaled FP8 (DeepSeek's layout) with this block size",
)
def init_cmd(
    family: str,
    preset_name: str,
    out: Path,
    seed: int,
    dtype: str,
    max_shard_mb: float,
    fp8_block: int | None,
) -> None:
    """Write a random checkpoint (Hugging Face layout) of a preset."""
    from eaas.runtime.model.checkpoint import write_random_checkpoint
    from eaas.runtime.model.presets import preset

    try:
        config = preset(family, preset_name)  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--preset") from exc
    if fp8_block is not None and fp8_block < 1:
        raise click.BadParameter(f"must be >= 1, got {fp8_block}", param_hint="--fp8-block")
    write_random_checkpoint(
        config,
        out,
        seed=seed,
        dtype=dtype,
        max_shard_bytes=int(max_shard_mb * 2**20),
        fp8_block=(fp8_block, fp8_block) if fp8_block else None,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = len(set(index["weight_map"].values()))
    size_mib = index["metadata"]["total_size"] / 2**20
    click.echo(f"wrote {family}/{preset_name} ({size_mib:.1f} MiB, {shards} shards) to {out}")


@model.command("tokenizer", short_help="Write a preset's tokenizer as Hugging Face files.")
@click.argument("preset_spec", metavar="FAMILY/PRESET")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
def tokenizer_cmd(preset_spec: str, out: Path) -> None:
    """Write the tokenizer `eaas serve --preset FAMILY/PRESET` uses (the byte tokenizer: one token
    per UTF-8 byte) as tokenizer.json + tokenizer_config.json in OUT, for tools that load a
    tokenizer by directory (transformers' AutoTokenizer, GuideLLM, lm-evaluation-harness, AIPerf)."""
    from eaas.runtime.model.presets import preset_of_spec
    from eaas.runtime.model.tokenizer import write_byte_tokenizer

    try:
        config = preset_of_spec(preset_spec)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="FAMILY/PRESET") from exc
    write_byte_tokenizer(out, config.max_position_embeddings)
    click.echo(f"wrote the tokenizer of {preset_spec} (one token per UTF-8 byte) to {out}")


@model.command("inspect", short_help="Family, sizes, dtypes and memory per server of a checkpoint.")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--servers", default=8, show_default=True, help="expert servers in the pool")
@click.option("--replication", default=2, show_default=True, help="copies of each expert (R)")
def inspect_cmd(checkpoint: Path, servers: int, replication: int) -> None:
    """Family, sizes, dtypes and memory per expert server of a checkpoint (reads headers only)."""
    from eaas.runtime.model.checkpoint import CheckpointError, CheckpointReader
    from eaas.runtime.model.inspect import summarize

    try:
        summary = summarize(CheckpointReader(checkpoint), servers, replication)
    except CheckpointError as exc:
        raise click.ClickException(str(exc)) from exc
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--servers/--replication") from exc
    for line in summary.lines():
        click.echo(line)


@model.command("generate", short_help="Greedy generation with the reference model (no servers).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--prompt", "prompts", multiple=True, default=["Experts as a service"], show_default=True)
@click.option("--max-new-tokens", default=16, show_default=True)
def generate_cmd(checkpoint: Path, prompts: tuple[str, ...], max_new_tokens: int) -> None:
    """Greedy generation with the monolithic reference model (byte-level tokens)."""
    from eaas.runtime.model.reference import load_reference
    from eaas.runtime.model.tokenizer import ByteTokenizer

    decoder = load_reference(checkpoint)
    tokenizer = ByteTokenizer(decoder.config.vocab_size)
    start = time.perf_counter()
    generated, _ = decoder.generate([tokenizer.encode(p) for p in prompts], max_new_tokens)
    elapsed = time.perf_counter() - start
    for prompt, ids in zip(prompts, generated, strict=True):
        click.echo(f"{prompt!r} -> {tokenizer.decode(ids)!r}  ids={ids}")
    total = sum(len(g) for g in generated)
    click.echo(f"{total} tokens in {elapsed:.2f} s = {total / elapsed:.1f} tokens/s (reference, 1 process)")
