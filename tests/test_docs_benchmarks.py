"""docs/benchmarks.md's headline names what exists: every benchmark script its rows name is in
benchmarks/, every JSON target key is one that script emits, and every link into the page lands on
one of its headings."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
SCRIPT = re.compile(r"benchmarks/\w+\.py")
CODE = re.compile(r"`([^`]+)`")


def headline_rows(text: str) -> list[dict[str, str]]:
    """The rows of the table under `## Headline`, as {column header: cell}."""
    section = text.split("\n## Headline\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def key_patterns(script: Path) -> list[re.Pattern[str]]:
    """Every string the script writes, as a pattern: an f-string's fields match anything (only
    f-strings that start with text, so that ``f"{name}"`` does not match every key)."""
    patterns = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            patterns.append(re.compile(re.escape(node.value)))
        elif isinstance(node, ast.JoinedStr) and isinstance(node.values[0], ast.Constant):
            parts = [
                re.escape(part.value) if isinstance(part, ast.Constant) else ".*" for part in node.values
            ]
            patterns.append(re.compile("".join(parts)))
    return patterns


def is_emitted(key: str, patterns: list[re.Pattern[str]]) -> bool:
    return any(pattern.fullmatch(key) for pattern in patterns)


def check_headline(text: str) -> list[str]:
    """What the headline names that does not exist, one line each."""
    problems = []
    rows = headline_rows(text)
    if not rows:
        return ["the headline table has no rows"]
    for row in rows:
        scripts = SCRIPT.findall(row.get("script", ""))
        if not scripts:
            problems.append(f"row {row.get('benchmark')!r} names no benchmarks/*.py script")
        for name in scripts:
            if not (ROOT / name).is_file():
                problems.append(f"{name}: no such script")
        present = [ROOT / name for name in scripts if (ROOT / name).is_file()]
        patterns = [pattern for script in present for pattern in key_patterns(script)]
        for key in CODE.findall(row.get("target (JSON key)", "")):
            if present and not is_emitted(key, patterns):
                problems.append(f"{key}: not a target key of {', '.join(scripts)}")
    return problems


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_headline_names_scripts_and_target_keys_that_exist() -> None:
    assert check_headline(PAGE.read_text()) == []


def test_the_check_refuses_a_missing_script_or_key() -> None:
    header = "# Benchmarks\n\n## Headline\n\n| benchmark | script | target (JSON key) |\n|---|---|---|\n"
    missing_script = header + "| x | `benchmarks/no_such_benchmark.py` | `a_key` |\n"
    assert check_headline(missing_script) == ["benchmarks/no_such_benchmark.py: no such script"]
    missing_key = header + "| x | `benchmarks/transport_rtt.py` | `shm_within_9x_copy_floor` |\n"
    assert check_headline(missing_key) == [
        "shm_within_9x_copy_floor: not a target key of benchmarks/transport_rtt.py"
    ]
    formatted_key = header + "| x | `benchmarks/placement.py` | `B.cost_aware_latency+planner_vs_none@10` |\n"
    assert check_headline(formatted_key) == []


@pytest.mark.parametrize("document", sorted(path.name for path in (ROOT / "docs").glob("*.md")))
def test_links_into_the_benchmarks_page_land_on_a_heading(document: str) -> None:
    headings = {anchor(line.lstrip("#")) for line in PAGE.read_text().splitlines() if line.startswith("#")}
    text = (ROOT / "docs" / document).read_text()
    targets = re.findall(r"\]\(benchmarks\.md#([^)]+)\)", text)
    if document == PAGE.name:
        targets += re.findall(r"\]\(#([^)]+)\)", text)
    assert [target for target in targets if target not in headings] == []
