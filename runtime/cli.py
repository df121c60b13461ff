"""The ``eaas`` command line. Subcommands load lazily (torch is slow to import) and are listed by role."""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import io
import signal
import sys
from typing import NamedTuple

import click


class Entry(NamedTuple):
    module: str  # module holding the click command
    attr: str  # the command object's name in that module
    role: str  # heading in ``eaas --help``
    summary: str  # one line for ``eaas --help`` (read without importing the module)


ROLES = ("Run locally", "Serve", "Operate on Kubernetes", "Tools")

COMMANDS: dict[str, Entry] = {
    "model": Entry(
        "eaas.runtime.commands.model",
        "model",
        "Tools",
        "Random checkpoints, presets, inspecting a checkpoint, reference generation.",
    ),
    "serve": Entry(
        "eaas.runtime.commands.serve",
        "serve",
        "Run locally",
        "Serve a model (OpenAI API) from a local EaaS cluster of processes.",
    ),
    "local": Entry(
        "eaas.runtime.commands.local",
        "local",
        "Run locally",
        "A local EaaS cluster of processes; shows failover.",
    ),
    "expert-server": Entry(
        "eaas.runtime.commands.expert_server", "expert_server", "Serve", "Serve one ordinal's experts."
    ),
    "attention-client": Entry(
        "eaas.runtime.commands.attention_client",
        "attention_client",
        "Serve",
        "Generate with the experts on expert servers.",
    ),
    "operator": Entry(
        "eaas.operator.cli", "operator", "Operate on Kubernetes", "Run the operator (MoEService, pools)."
    ),
    "crds": Entry("eaas.operator.crdgen", "main", "Tools", "Generate the eaas.io CRDs from the models."),
}


class RoleGroup(click.Group):
    """A group whose commands are imported on first use and listed under role headings."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        command = getattr(importlib.import_module(entry.module), entry.attr)
        assert isinstance(command, click.Command), f"{entry.module}.{entry.attr} is not a click command"
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for role in ROLES:
            rows = [(name, e.summary) for name, e in sorted(COMMANDS.items()) if e.role == role]
            if rows:
                with formatter.section(role):
                    formatter.write_dl(rows)


@click.group(cls=RoleGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="eaas")
def main() -> None:
    """EaaS: Mixture-of-Experts serving with experts as a service.

    Attention clients send each token to the expert servers hosting its experts; expert
    servers are stateless, scale one GPU at a time and fail over to replicas.
    """
    # `kill -USR1 <pid>` writes every thread's stack to standard error (the container log), even
    # while a thread is stuck in native code holding the GIL: how a hung process is diagnosed.
    # (Not where standard error is no file, as under a test's CLI runner.)
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True)


if __name__ == "__main__":
    main()
