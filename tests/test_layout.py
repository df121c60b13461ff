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
    every --attention offers the attention paths; every --kernel-backend lists the registry's backends
    and refuses an unknown one while reading the options (before a checkpoint is written or a
    process started)."""
    from eaas.kernels.registry import SHIPPED_BACKENDS
    from eaas.runtime.cli import main
    from eaas.runtime.commands.options import LOG_LEVELS
    from eaas.runtime.model.attention import PATHS

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
        attention = next((p for p in command.params if "--attention" in getattr(p, "opts", ())), None)
        if attention is not None:
            assert isinstance(attention.type, click.Choice), words
            assert (tuple(attention.type.choices), attention.default) == (PATHS, "paged"), words
        backend = next((p for p in command.params if "--kernel-backend" in getattr(p, "opts", ())), None)
        if backend is None:
            continue
        help_text = " ".join(shown.output.split())
        for name in SHIPPED_BACKENDS:  # (tests may register more in this process)
            assert name.partition(":")[0] in help_text, (words, name)
        refused = CliRunner().invoke(main, [*words, "--kernel-backend", "no-such-backend"])
        assert refused.exit_code == 2, (words, refused.output)
        assert "unknown kernel backend 'no-such-backend'; available: grouped_mm, " in refused.output


def module_name(path: Path) -> str:
    """``operator/api/kinds.py`` -> ``eaas.operator.api.kinds``; a package's ``__init__.py`` is it."""
    parts = ("eaas", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking_block(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports that never run."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_statements(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import that runs: at module level and inside functions and classes alike (a deferred import is
    still a dependency), but not under ``if TYPE_CHECKING:`` (names for annotations, never imported)."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not is_type_checking_block(node):
            pending.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module of the ``eaas`` package -> the modules of the package it imports. ``from a import b`` is an
    edge to the module ``a.b`` where that is one, else to ``a``; an import of a module outside the
    source tree (a name inside a module) counts as its module."""
    files = {
        module_name(path): path
        for layer in ("operator", "runtime", "kernels")
        for path in (ROOT / layer).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in import_statements(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets |= {
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names
            }
        graph[name] = set()
        for target in targets:
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) through each set of modules that import each other."""
    cycles: list[list[str]] = []
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        # depth-first from `start`, remembering the path; an edge back into the path closes a cycle
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, rest = stack[-1]
            if not rest:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
                continue
            nxt = rest.pop(0)
            if nxt in on_path:
                cycle = [*path[path.index(nxt) :], nxt]
                if not any(set(cycle) == set(seen) for seen in cycles):
                    cycles.append(cycle)
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return cycles


def test_import_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\ndef f():\n    import y\n"
    )
    assert sorted(n.names[0].name for n in import_statements(tree)) == ["TYPE_CHECKING", "y"]


def test_no_import_cycles() -> None:
    """Modules of the ``eaas`` package never import each other, directly or around a circle: two modules
    that need each other are one module or a missing third (a deferred import inside a function is
    still a dependency)."""
    graph = import_graph()
    assert "eaas.runtime.cli" in graph and "eaas.operator.crdgen" in graph
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_commands_sit_on_top() -> None:
    """The runtime's commands (``eaas.runtime.commands``) import the packages they launch and the options
    they share; nothing below imports a command (``python -m`` entry points aside), and the attention
    client's data path never imports the serving front that runs on it."""
    graph = import_graph()
    below = {
        name: sorted(t for t in targets if t.startswith("eaas.runtime.commands"))
        for name, targets in graph.items()
        if not name.startswith(("eaas.runtime.commands", "eaas.runtime.cli"))
        and not name.endswith("__main__")
    }
    assert not {name: targets for name, targets in below.items() if targets}, "imports a command"
    client = {
        name: sorted(t for t in targets if t.startswith("eaas.runtime.serving"))
        for name, targets in graph.items()
        if name.startswith("eaas.runtime.client")
    }
    assert not {name: targets for name, targets in client.items() if targets}, "the client imports serving"
    assert {"eaas.runtime.commands.expert_server", "eaas.runtime.commands.options"} <= set(graph)


def test_the_top_level_name_kernels_is_not_the_repository_folder() -> None:
    """transformers imports Hugging Face's ``kernels`` distribution; the repository's ``kernels/``
    (``eaas.kernels``) must not stand in for it, whatever is on ``sys.path`` (tests/conftest.py)."""
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    if spec is None:
        return  # the distribution is not installed: nothing to shadow
    import kernels

    assert Path(str(kernels.__file__)).resolve().parent != ROOT / "kernels", kernels.__file__
