"""Every relative link of README.md and docs/ leads somewhere: ``[text](path)`` names a file of this
repository, and ``[text](path#anchor)`` or ``[text](#anchor)`` a heading of that Markdown file, by
GitHub's anchor rules (lowercase, punctuation dropped, spaces to ``-``, ``-1``, ``-2`` ... after
repeated headings). Links inside code (fenced blocks, inline code) are text, not links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of ``text`` outside fenced code blocks, inline code removed."""
    lines, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            lines.append((number, re.sub(r"`[^`]*`", "", line)))
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of every heading of a Markdown text (repeats numbered as GitHub does)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    inside = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        match = None if inside else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            name = anchor(match.group(1))
            count = seen.get(name, 0)
            seen[name] = count + 1
            found.add(name if count == 0 else f"{name}-{count}")
    return found


def broken_links(document: Path, text: str) -> list[str]:
    """Why each relative link of ``text`` (the contents of ``document``) leads nowhere."""
    problems = []
    for number, line in prose(text):
        for target in LINK.findall(line):
            if EXTERNAL.match(target):
                continue
            path, _, name = target.partition("#")
            where = f"{document.relative_to(ROOT).as_posix()}:{number}: ({target})"
            linked = (document.parent / path).resolve() if path else document
            if not linked.exists():
                problems.append(f"{where}: {path} does not exist")
            elif name and linked.suffix == ".md":
                headings = anchors(text if linked == document else linked.read_text())
                if name not in headings:
                    problems.append(f"{where}: {linked.name} has no heading with anchor #{name}")
    return problems


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(document: Path) -> None:
    problems = broken_links(document, document.read_text())
    assert not problems, "\n".join(problems)


def test_the_docs_have_links_to_check() -> None:
    links = [t for d in DOCUMENTS for _, line in prose(d.read_text()) for t in LINK.findall(line)]
    assert sum("#" in t and not EXTERNAL.match(t) for t in links) > 20


def test_the_check_refuses_a_broken_link() -> None:
    """The checker itself: a missing file, a missing heading in another page or in the same page
    are each reported; a link in code, an external link and good anchors are not."""
    document = ROOT / "docs" / "operations.md"
    text = (
        "# A page\n\n## The `nixl` transport (RDMA; any host)\n\n## Twice\n\n## Twice\n\n"
        "[a](no-such-page.md) [b](install.md#no-such-heading) [c](#no-such-heading)\n"
        "[d](#the-nixl-transport-rdma-any-host) [e](#twice-1) [f](install.md#container-image)\n"
        "`[g](missing.md)` [h](https://example.com/x#y)\n```\n[i](missing.md)\n```\n"
    )
    problems = broken_links(document, text)
    assert len(problems) == 3, problems
    assert "no-such-page.md does not exist" in problems[0]
    assert "install.md has no heading with anchor #no-such-heading" in problems[1]
    assert "operations.md has no heading with anchor #no-such-heading" in problems[2]
