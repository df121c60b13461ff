"""The repository layout and packaging promises of CONVENTIONS.md."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
