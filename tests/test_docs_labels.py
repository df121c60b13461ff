"""README.md and docs/ describe what exists, not the history of its making: no internal issue
numbers ("issue 30", "issue 35's target"), no internal source labels ("seed 002"), and no account of
when work was done ("the seventeenth session", "this session", "the day before"). Name the thing
itself: the target, the drill, the design decision, the paper."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))]

ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
            "eighteenth", "nineteenth", "twentieth"]  # fmt: skip
WHEN = [*ORDINALS, "this", "that", "last", "previous", "next", "same", "earlier", "later", "morning",
        "afternoon", "evening", "night"]  # fmt: skip
LABELS = {
    "an issue number": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    "a source's internal label": re.compile(r"\bseeds?\s+\d{3}\b", re.IGNORECASE),
    "a session": re.compile(
        r"\b(?:" + "|".join(WHEN) + r"|\d+(?:st|nd|rd|th)|twenty-\w+)\s+session\b"
        r"|\bthe session (?:that|which|before|after)\b",
        re.IGNORECASE,
    ),
    "a day relative to the writing": re.compile(r"\b(?:the (?:day|night) before|yesterday)\b", re.IGNORECASE),
}


def labels_in(text: str) -> list[str]:
    """Each internal label in `text`, as 'line N: kind: the words'."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in LABELS.items():
            found += [f"line {number}: {kind}: {match.group(0)!r}" for match in pattern.finditer(line)]
    return found


@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_docs_name_no_internal_labels(document: str) -> None:
    assert labels_in((ROOT / document).read_text()) == []


@pytest.mark.parametrize(
    "text",
    [
        "the targets of issue 30 are met",
        "Issue 35's target",
        "see issues 18 and 31",
        "(issue #4)",
        "the planner of seed 002",
        "measured in the seventeenth session",
        "(2026-11-28, the 18th session)",
        "not reproduced in this session",
        "the afternoon session's run",
        "twenty-first session",
        "No GPU was lent to the session that built it.",
        "The day before, it read 1.67",
        "as measured yesterday",
    ],
)
def test_the_check_finds_each_kind_of_label(text: str) -> None:
    assert len(labels_in(text)) == 1


@pytest.mark.parametrize(
    "text",
    [
        "every component runs in its own session/process group",
        "`cluster` (session): an `e2e.cluster.Cluster`",
        "a pytest session-scoped fixture",
        "vLLM #43189 reports 8 minutes to ready",
    ],
)
def test_the_check_leaves_ordinary_words_alone(text: str) -> None:
    assert labels_in(text) == []
