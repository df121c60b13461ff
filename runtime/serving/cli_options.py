"""The serving features' command-line options, shared by ``eaas serve`` and ``eaas attention-client``
(kept free of heavy imports: ``--help`` must not load torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

F = TypeVar("F", bound=Callable[..., object])

TOOL_CALL_PARSERS = ("auto", "hermes")  # auto + ``client.tools.FORMATS``
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")  # auto, none + ``client.reasoning.STYLES``


def serving_feature_options(command: F) -> F:
    """``--tool-call-parser``, ``--reasoning-parser``, ``--enable-prefix-caching/--no-...`` and
    ``--default-max-tokens``."""
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
        "--enable-prefix-caching/--no-enable-prefix-caching",
        "prefix_caching",
        default=True,
        show_default=True,
        envvar="EAAS_PREFIX_CACHING",
        show_envvar=True,
        help="reuse the computed KV blocks of prompts' shared prefixes (continuous batching)",
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
        help="the format of the model's tool calls (auto: by its family; hermes: <tool_call> blocks)",
    )(command)
