"""The command-line options the commands share: ``--log-level``, ``--threads``, ``--model-revision``,
``--placement-configmap``,
``--kernel-backend`` (expert servers and the commands that start them) and the serving features of
``eaas serve`` and ``eaas attention-client`` (kept free of heavy imports: ``--help`` must not load
torch)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

import click

from eaas.runtime import contract
from eaas.runtime.serving.micro_batches import AUTO as MICRO_BATCHES_AUTO
from eaas.runtime.serving.micro_batches import CHOICES as MICRO_BATCH_CHOICES

F = TypeVar("F", bound=Callable[..., object])

# auto + ``serving.tools.FORMATS``; auto, none + ``serving.reasoning.STYLES``
TOOL_CALL_PARSERS = ("auto", "hermes", "glm45", "deepseek_v3", "kimi_k2", "harmony")
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3", "harmony")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
REVISION_PATTERN = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"


def check_revision(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A ``--model-revision`` callback: empty means none; anything else is a short name."""
    if not value:
        return None
    if not re.fullmatch(REVISION_PATTERN, value):
        raise click.BadParameter(
            f"{value!r}: 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        )
    return value


def model_revision_option(role: str) -> Callable[[F], F]:
    """``--model-revision`` (``EAAS_MODEL_REVISION``): the checkpoint's revision, for expert servers and
    attention clients alike (`role` says what this process does with it)."""
    return click.option(
        "--model-revision",
        envvar=contract.ENV_MODEL_REVISION,
        show_envvar=True,
        default=None,
        callback=check_revision,
        help=f"the checkpoint's revision (set in pods by the operator): {role}",
    )


def placement_configmap_option(needs: str, files: str) -> Callable[[F], F]:
    """``--placement-configmap`` (``EAAS_PLACEMENT_CONFIGMAP``): the placement ConfigMap a pod
    watches on the API server (`needs`: the options it goes with; `files`: what the kubelet keeps)."""
    return click.option(
        "--placement-configmap",
        envvar=contract.ENV_PLACEMENT_CONFIGMAP,
        show_envvar=True,
        default=None,
        help=f"with {needs}: watch this placement ConfigMap on the API server too (a change arrives in "
        f"seconds; {files} follows at the kubelet's next sync)",
    )


def log_level_option(command: F) -> F:
    """``--log-level``, the same choices and default for every long-running command."""
    return click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default="INFO",
        show_default=True,
        help="logging level of this process (and of the processes it starts)",
    )(command)


def threads_option(command: F) -> F:
    """``--threads`` (``EAAS_THREADS``): torch's intra-op threads, for expert servers and attention
    clients alike; see :func:`apply_threads`."""
    return click.option(
        "--threads",
        type=click.IntRange(min=0),
        envvar=contract.ENV_THREADS,
        show_envvar=True,
        default=None,
        help="torch intra-op threads; 0 or none: torch's default, one per core of the host. In pods the "
        "operator gives the container's CPU request, rounded up",
    )(command)


def apply_threads(threads: int | None) -> None:
    """Give torch `threads` intra-op threads (none or 0: leave torch's default). A process whose
    parallel ops have more threads than the cores it gets waits at each op's closing barrier for the
    thread whose core another process took (docs/run-without-kubernetes.md, "How to run")."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def check_kernel_backend(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A ``--kernel-backend`` callback: an unknown backend is refused while the options are read,
    before any checkpoint is written or process started."""
    if value is None:
        return value
    from eaas.kernels.registry import check_backend_name  # torch: only once the option is given

    try:
        check_backend_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def kernel_backend_option(command: F) -> F:
    """``--kernel-backend`` of the commands that start expert servers (checked while read; the help
    names the shipped backends without importing torch: a test keeps it equal to the registry's)."""
    return click.option(
        "--kernel-backend",
        default="torch",
        show_default=True,
        callback=check_kernel_backend,
        help="expert compute of the expert servers: torch, triton, grouped_mm or "
        "simulated:EXPERT_US:ENTRY_US",
    )(command)


# eaas.runtime.model.attention.PATHS, named here without importing torch (a test keeps them equal)
ATTENTION_PATHS = ("paged", "reference")


def serving_feature_options(command: F) -> F:
    """``--tool-call-parser``, ``--reasoning-parser``, ``--structured-outputs-in-reasoning``,
    ``--enable-prefix-caching/--no-...``, ``--micro-batches``, ``--default-max-tokens`` and
    ``--attention``."""
    command = click.option(
        "--attention",
        type=click.Choice(ATTENTION_PATHS),
        default="paged",
        show_default=True,
        envvar="EAAS_ATTENTION",
        show_envvar=True,
        help="how attention reads the KV cache: paged (in place; Triton on CUDA, chunked torch on CPU) "
        "or reference (the gathered oracle)",
    )(command)
    command = click.option(
        "--default-max-tokens",
        type=click.IntRange(min=1),
        default=None,
        envvar="EAAS_DEFAULT_MAX_TOKENS",
        show_envvar=True,
        help="new tokens of a chat request that sets no max_tokens [default: the rest of the context, "
        "as OpenAI and vLLM]",
    )(command)
    command = click.option(
        "--micro-batches",
        type=click.Choice([*(str(m) for m in MICRO_BATCH_CHOICES), MICRO_BATCHES_AUTO]),
        default="1",
        show_default=True,
        envvar=contract.ENV_MICRO_BATCHES,
        show_envvar=True,
        help="micro-batches a step is cut into, pipelined so one's attention runs while another's experts "
        "compute (auto: tries each on live steps and keeps the fastest, logging what it picked)",
    )(command)
    command = click.option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        "prefix_caching",
        default=True,
        show_default=True,
        envvar="EAAS_PREFIX_CACHING",
        show_envvar=True,
        help="reuse the computed KV blocks of prompts' shared prefixes (continuous batching)",
    )(command)
    command = click.option(
        "--structured-outputs-in-reasoning/--no-structured-outputs-in-reasoning",
        "structured_outputs_in_reasoning",
        default=False,
        show_default=True,
        envvar="EAAS_STRUCTURED_OUTPUTS_IN_REASONING",
        show_envvar=True,
        help="a reasoning model's grammar (structured outputs, a required tool call) from its first "
        "token; by default it starts after the thinking",
    )(command)
    command = click.option(
        "--reasoning-parser",
        type=click.Choice(REASONING_PARSERS),
        default="auto",
        show_default=True,
        envvar="EAAS_REASONING_PARSER",
        show_envvar=True,
        help="how the model's thinking is marked in chat answers (auto: by its family; none: not split)",
    )(command)
    return click.option(
        "--tool-call-parser",
        type=click.Choice(TOOL_CALL_PARSERS),
        default="auto",
        show_default=True,
        envvar="EAAS_TOOL_CALL_PARSER",
        show_envvar=True,
        help="the format of the model's tool calls (auto: by its family; hermes: <tool_call> JSON blocks; "
        "glm45: <tool_call> blocks of <arg_key>/<arg_value> pairs; deepseek_v3, kimi_k2: their marker "
        "tokens, tool_choice auto only)",
    )(command)
