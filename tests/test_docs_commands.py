"""The commands in README.md and docs/ work as written on a fresh checkout, as far as can be known
without running them against a cluster: every shell block holds commands only (output goes in a
``text`` block), every ``make`` target exists, every ``eaas`` command and option exists, every file
of this repository that a command names exists, and every namespace a ``kubectl``/``helm``
command uses is created earlier in the same document, or in the walkthrough the other documents
build on (install.md, then deploy.md; or is ``default``)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The pages a reader follows in this order, which the other documents build on.
WALKTHROUGH = ["docs/install.md", "docs/deploy.md"]
SHELL_FENCES = ("```bash", "```sh", "```shell", "```console")
# What a line of a shell block may start with: the commands and shell words the docs use.
COMMANDS = {
    "make", "kubectl", "helm", "eaas", "python", "python3", "pip", "curl", "export", "cd", "git",
    "apt-get", "openssl", "skopeo", "for", "do", "done", "if", "then", "fi", "while", "echo", "cat",
    "sudo", "mkdir", "ls", "rm", "cp", "kill", "bash", "source", "docker", "pytest", "ulimit",
    "watch", "nvidia-smi", "ibv_devinfo", "ucx_info", "grep", "sleep", "uv", "time", "unset", "go", "eval",
    "guidellm", "lm-eval", "aiperf",
}  # fmt: skip
REPO_PATH = re.compile(
    r"^(?:\./)?((?:manifests|charts|benchmarks|e2e|docs|crds|image|tests|kernels)/[\w./-]+)"
)


def shell_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, command line) of every shell block of ``path``, continuations joined."""
    inside, pending, start = False, "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            inside = not inside and stripped.split()[0] in SHELL_FENCES
            continue
        if not inside:
            continue
        if not pending:
            start = number
        pending = f"{pending} {stripped.removeprefix('$ ')}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        if _open_quote(pending):  # a quoted argument goes on over the next line
            continue
        if pending:
            yield start, pending
        pending = ""


def _open_quote(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:
        return True
    return False


def simple_commands(line: str) -> list[list[str]]:
    """The words of each simple command of ``line`` (split at ``&& || ; | &`` and subshell
    parentheses; comments dropped; a leading ``VAR=value`` or ``VAR=$(`` dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="();&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: the words as written
        tokens = line.split()
    found: list[list[str]] = [[]]
    for token in tokens:
        if token and set(token) <= set("();&|"):
            found.append([])
        elif not found[-1] and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token):
            continue  # an assignment before (or instead of) the command
        else:
            found[-1].append(token)
    return [words for words in found if words]


def make_targets() -> set[str]:
    targets: set[str] = set()
    for makefile in (ROOT / "Makefile", ROOT / "e2e" / "k8s.mk"):
        for line in makefile.read_text().splitlines():
            match = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
            if match:
                targets.update(match.group(1).split())
    return targets


def eaas_problem(words: list[str]) -> str | None:
    """Why ``eaas <words>`` would be refused by the CLI's parser, or None."""
    from eaas.runtime.cli import main

    command: click.Command = main
    rest = list(words)
    with click.Context(main) as context:
        while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
            sub = command.get_command(context, rest[0])
            if sub is None:
                known = ", ".join(command.list_commands(context))
                return f"`{command.name} {rest[0]}`: no such command (there are {known})"
            command, rest = sub, rest[1:]
    options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    options.update(("--help", "-h"))
    for word in rest:
        if word.startswith("-") and not re.match(r"^-\d", word) and word != "-":
            name = word.split("=", 1)[0]
            if name not in options:
                return f"`{command.name}` has no option {name}"
    return None


def namespace_problem(words: list[str], before: str) -> str | None:
    """Why the namespace a kubectl/helm command names may not exist when the reader runs it."""
    flags = [i for i, word in enumerate(words[:-1]) if word in ("-n", "--namespace")]
    if not flags:
        return None
    namespace = words[flags[0] + 1]
    if namespace in ("default", "kube-system") or namespace.startswith("$"):
        return None
    name = re.escape(namespace)
    created = (
        re.search(rf"create (?:namespace|ns) {name}\b", before)
        or re.search(rf"-(?:n|-namespace) {name} .*--create-namespace", before)
        or re.search(rf"--create-namespace .*-(?:n|-namespace) {name}\b", before)
        or "--create-namespace" in words
        or words[1:3] == ["create", "namespace"]
    )
    return None if created else f"namespace {namespace} is never created before it is used"


def walkthrough_before(document: str) -> str:
    """The walkthrough's text a reader of ``document`` has gone through before it: the walkthrough
    pages before it, or all of them for a document outside the walkthrough."""
    pages = WALKTHROUGH[: WALKTHROUGH.index(document)] if document in WALKTHROUGH else WALKTHROUGH
    return "".join((ROOT / page).read_text() + "\n" for page in pages)


def commands() -> list[tuple[str, int, str]]:
    return [
        (path.relative_to(ROOT).as_posix(), number, command)
        for path in DOCUMENTS
        for number, command in shell_lines(path)
    ]


def test_the_docs_have_shell_blocks_to_check() -> None:
    assert len(commands()) > 30


@pytest.mark.parametrize("document", [p.relative_to(ROOT).as_posix() for p in DOCUMENTS])
def test_every_command_of_the_docs_works_as_written(document: str) -> None:
    targets = make_targets()
    lines = (ROOT / document).read_text().splitlines()
    problems = []
    for _doc, number, line in [c for c in commands() if c[0] == document]:
        before = walkthrough_before(document) + "\n".join(lines[: number - 1])
        for words in simple_commands(line):
            head = words[0].rsplit("/", 1)[-1]
            where = f"{document}:{number}: `{' '.join(words)}`"
            if head not in COMMANDS and not words[0].startswith((".venv/bin/", "./", "benchmarks/", "e2e/")):
                problems.append(f"{where}: not a command (output belongs in a ```text block)")
                continue
            if head == "make":
                missing = [
                    w for w in words[1:] if not w.startswith("-") and "=" not in w and w not in targets
                ]
                if missing:
                    problems.append(f"{where}: no make target {missing}")
            if head == "eaas" and (problem := eaas_problem(words[1:])):
                problems.append(f"{where}: {problem}")
            for word in words:
                match = REPO_PATH.match(word)
                if match and not set(match.group(1)) & set("*{<$") and not (ROOT / match.group(1)).exists():
                    problems.append(f"{where}: {match.group(1)} is not in the repository")
            if head in ("kubectl", "helm") and (problem := namespace_problem(words, before)):
                problems.append(f"{where}: {problem}")
    assert not problems, "\n".join(problems)


def test_the_checks_refuse_what_would_fail() -> None:
    """The checker itself: a wrong eaas command or option, output in a shell block, a namespace
    nobody created are each reported."""
    assert eaas_problem(["serve", "--servers", "4"]) is None
    assert eaas_problem(["model", "presets"]) is None
    assert "has no option --no-such-option" in (eaas_problem(["serve", "--no-such-option"]) or "")
    assert "no such command" in (eaas_problem(["modle", "init"]) or "")
    assert simple_commands("A=1 kubectl get pods -n x && echo ok # done") == [
        ["kubectl", "get", "pods", "-n", "x"],
        ["echo", "ok"],
    ]
    get = ["kubectl", "get", "eaas", "-n", "models"]
    assert namespace_problem(get, "") is not None
    assert namespace_problem(get, "kubectl create namespace models") is None
