"""The repository layout and packaging promises: the top-level directories, the ``eaas`` package
mapping, the CLI's vocabulary and the Makefile's help."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def test_layout_has_every_top_level_directory() -> None:
    for name in (
        "operator",
        "runtime",
        "kernels",
        "crds",
        "charts",
        "manifests",
        "e2e",
        "tests",
        "benchmarks",
        "docs",
    ):
        assert (ROOT / name).is_dir(), name
    for name in ("pyproject.toml", "README.md", "Makefile", ".ci/run"):
        assert (ROOT / name).is_file(), name


def test_operator_dir_does_not_shadow_stdlib_operator() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    code = "import operator, sys; print(operator.__file__); print(operator.attrgetter('real')(3))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    module_file, value = out.stdout.split()
    assert Path(module_file).parent != ROOT / "operator"
    assert Path(module_file).name == "operator.py"
    assert value == "3"


def test_packages_map_into_eaas() -> None:
    import eaas.kernels
    import eaas.runtime

    assert Path(eaas.runtime.__file__).resolve().parent == ROOT / "runtime"
    assert Path(eaas.kernels.__file__).resolve().parent == ROOT / "kernels"


def test_cli_help_lists_commands_by_role() -> None:
    from eaas.runtime.cli import COMMANDS, ROLES, main

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    for entry in COMMANDS.values():
        assert entry.role in ROLES
    for name in COMMANDS:
        assert name in result.output
    assert "Tools:" in result.output
    # Every registered command imports and has its own help.
    for name in COMMANDS:
        sub = CliRunner().invoke(main, [name, "--help"])
        assert sub.exit_code == 0, (name, sub.output)


def imported_modules(directory: Path) -> dict[str, set[str]]:
    """Every module each file under `directory` imports (absolute imports, from the syntax tree)."""
    found: dict[str, set[str]] = {}
    for path in directory.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_layers_point_one_way() -> None:
    """kernels <- runtime <- operator: the runtime never imports the operator (the names both share
    live in eaas.runtime.contract), the kernels import neither."""
    for layer, forbidden in (("runtime", ("eaas.operator",)), ("kernels", ("eaas.operator", "eaas.runtime"))):
        offenders = {
            path: sorted(name for name in names if name.startswith(forbidden))
            for path, names in imported_modules(ROOT / layer).items()
        }
        assert not {p: n for p, n in offenders.items() if n}, f"{layer} imports a higher layer"


def test_make_help_lists_every_target() -> None:
    """Every target of the Makefile (and e2e/k8s.mk) says what it does in `make help`."""
    import re

    targets = {
        match.group(1)
        for makefile in (ROOT / "Makefile", ROOT / "e2e" / "k8s.mk")
        for match in re.finditer(r"^([a-z][a-z0-9-]*):(?!=)", makefile.read_text(), re.MULTILINE)
    }
    shown = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    listed = {line.split()[1] for line in shown.stdout.splitlines() if line.startswith("make ")}
    assert targets >= {"serve", "test", "cluster-status"}
    assert listed == targets, (sorted(targets - listed), sorted(listed - targets))


def every_command(
    group: click.Group, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], click.Command]]:
    """(words, command) for every command under ``group``, groups included."""
    found: list[tuple[tuple[str, ...], click.Command]] = [(path, group)]
    with click.Context(group) as ctx:
        for name in group.list_commands(ctx):
            sub = group.get_command(ctx, name)
            assert sub is not None, name
            if isinstance(sub, click.Group):
                found += every_command(sub, (*path, name))
            else:
                found.append(((*path, name), sub))
    return found


def test_one_cli_vocabulary() -> None:
    """No description in any help is cut off; every --log-level has the same choices and default;
    every --kernel-backend lists the registry's backends
    and refuses an unknown one while reading the options (before a checkpoint is written or a
    process started)."""
    from eaas.kernels.registry import SHIPPED_BACKENDS
    from eaas.runtime.cli import main
    from eaas.runtime.serving.cli_options import LOG_LEVELS

    for words, command in every_command(main):
        shown = CliRunner().invoke(main, [*words, "--help"], terminal_width=80)
        assert shown.exit_code == 0, (words, shown.output)
        described = [line for line in shown.output.splitlines() if not line.startswith("Usage:")]
        cut = [line for line in described if line.rstrip().endswith("...") and "simulated:..." not in line]
        assert not cut, (words, cut)  # click cuts a summary too long for its column with "..."
        level = next((p for p in command.params if "--log-level" in getattr(p, "opts", ())), None)
        if level is not None:
            assert isinstance(level.type, click.Choice), words
            assert (tuple(level.type.choices), level.default) == (LOG_LEVELS, "INFO"), words
        backend = next((p for p in command.params if "--kernel-backend" in getattr(p, "opts", ())), None)
        if backend is None:
            continue
        help_text = " ".join(shown.output.split())
        for name in SHIPPED_BACKENDS:  # (tests may register more in this process)
            assert name.partition(":")[0] in help_text, (words, name)
        refused = CliRunner().invoke(main, [*words, "--kernel-backend", "no-such-backend"])
        assert refused.exit_code == 2, (words, refused.output)
        assert "unknown kernel backend 'no-such-backend'; available: grouped_mm, " in refused.output
