"""``status.conditions``: Ready, Progressing and Degraded, with observedGeneration.

A reconcile computes the three conditions from scratch (level-based); :func:`merge` keeps a
condition's ``lastTransitionTime`` when its status did not change, so rewriting an unchanged status
is a no-op for the API server.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED)

Status = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Observation:
    """One condition as a reconcile sees it (no timestamps)."""

    type: str
    status: Status
    reason: str
    message: str = ""

    @classmethod
    def of(cls, type_: str, holds: bool, reason: str, message: str = "") -> Observation:
        return cls(type_, "True" if holds else "False", reason, message)


def now() -> str:
    """The current time in the API's RFC 3339 form (seconds, ``Z``)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(
    previous: list[dict[str, Any]] | None,
    observations: list[Observation],
    generation: int,
    timestamp: str | None = None,
) -> list[dict[str, Any]]:
    """The new ``status.conditions`` list (camelCase dicts), in the order of `observations`.

    ``lastTransitionTime`` moves only when a condition's status changes; conditions of other
    types in `previous` (written by someone else) are kept after ours.
    """
    old = {condition.get("type"): condition for condition in previous or []}
    stamp = timestamp or now()
    merged: list[dict[str, Any]] = []
    for observation in observations:
        before = old.get(observation.type)
        changed = before is None or before.get("status") != observation.status
        merged.append(
            {
                "type": observation.type,
                "status": observation.status,
                "reason": observation.reason,
                "message": observation.message[:32768],
                "lastTransitionTime": stamp if changed else before["lastTransitionTime"],  # type: ignore[index]
                "observedGeneration": generation,
            }
        )
    ours = {observation.type for observation in observations}
    merged += [condition for condition in previous or [] if condition.get("type") not in ours]
    return merged


def find(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    """The condition of `type_` in a status, if any."""
    return next((condition for condition in conditions or [] if condition.get("type") == type_), None)


def is_true(conditions: list[dict[str, Any]] | None, type_: str) -> bool:
    condition = find(conditions, type_)
    return condition is not None and condition.get("status") == "True"


def unknown(reason: str = "Reconciling", message: str = "first reconcile in progress") -> list[Observation]:
    """What a fresh object reports before anything is observed."""
    return [Observation(type_, "Unknown", reason, message) for type_ in CONDITION_TYPES]
