"""docs/failures.md's conditions tables list every reason the operator can set: the reasons of
``Observation.of``, ``Observation(...)`` and an ExpertPool step's ``working``/``_drain``, read from
the operator's source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where a call carries the condition's reason: (function name, index of the reason argument).
REASON_ARGUMENT = {"of": 2, "Observation": 2, "working": 0, "_drain": 3}


def reasons_in(source: str) -> set[str]:
    """Every string literal a reason argument can take (both arms of a conditional, an `or`'s
    default); f-strings and names are not reasons."""
    reasons: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        index = REASON_ARGUMENT.get(name or "")
        if index is None or len(node.args) <= index:
            continue
        for part in ast.walk(node.args[index]):
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                reasons.add(part.value)
    return reasons


def operator_reasons() -> set[str]:
    return set().union(*(reasons_in(path.read_text()) for path in (ROOT / "operator").rglob("*.py")))


def conditions_section() -> str:
    text = (ROOT / "docs" / "failures.md").read_text()
    return text.split("\n## Conditions\n", 1)[1].split("\n## ", 1)[0]


def test_the_reasons_are_found_in_the_source() -> None:
    found = operator_reasons()
    # One of each way a reason is given: a literal, a conditional's arms, an `or` default, _drain's.
    assert {"ExpertsServed", "ClientsReady", "NoClientReady", "Stable", "Retiring", "Healthy"} <= found
    assert reasons_in('Observation.of(READY, ok, f"{x}")') == set()


def test_the_conditions_tables_list_every_reason_the_operator_sets() -> None:
    section = conditions_section()
    assert sorted(reason for reason in operator_reasons() if f"`{reason}`" not in section) == []
