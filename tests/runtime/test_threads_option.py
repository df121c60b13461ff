"""``--threads`` / ``EAAS_THREADS``: the torch threads of expert servers and attention clients, which the
operator sets in pods to the container's CPU request (tests/operator/test_pool_builders.py)."""

from __future__ import annotations

import click
import pytest
import torch
from click.testing import CliRunner

from eaas.runtime import contract
from eaas.runtime.commands.attention_client import attention_client
from eaas.runtime.commands.expert_server import expert_server
from eaas.runtime.commands.options import apply_threads, threads_option


@threads_option
@click.command()
def show(threads: int | None) -> None:
    click.echo(repr(threads))


@pytest.mark.parametrize("command", [expert_server, attention_client], ids=lambda c: c.name)
def test_both_pod_commands_read_eaas_threads(command: click.Command) -> None:
    (option,) = [param for param in command.params if param.name == "threads"]
    assert option.envvar == contract.ENV_THREADS


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        ([], {}, "None"),
        ([], {contract.ENV_THREADS: "3"}, "3"),
        ([], {contract.ENV_THREADS: "0"}, "0"),  # what kubelet gives a pod that requests no CPU
        (["--threads", "2"], {contract.ENV_THREADS: "3"}, "2"),
    ],
)
def test_threads_come_from_the_option_else_the_environment(
    args: list[str], env: dict[str, str], said: str
) -> None:
    result = CliRunner().invoke(show, args, env={contract.ENV_THREADS: None, **env})
    assert result.exit_code == 0, result.output
    assert result.output.strip() == said


def test_a_negative_or_malformed_thread_count_is_refused_by_name() -> None:
    for value in ("-1", "many"):
        result = CliRunner().invoke(show, [], env={contract.ENV_THREADS: value})
        assert result.exit_code == 2 and "'--threads'" in result.output, result.output


def test_apply_threads_sets_torch_and_leaves_its_default_for_none_or_zero() -> None:
    before = torch.get_num_threads()
    wanted = before + 1  # a count torch does not have yet, whatever the machine
    try:
        apply_threads(wanted)
        assert torch.get_num_threads() == wanted
        apply_threads(None)
        apply_threads(0)
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)
