"""An in-memory stand-in for the API server, for reconciler unit tests (the real one runs in
e2e/operator)."""

from __future__ import annotations

import copy
from typing import Any


def patched(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = patched(result.get(key), value)
    return result


class MemoryKube:
    """Just enough of :class:`eaas.operator.kube.Kube` for the reconcilers: objects by (kind, name)
    in one namespace; merge patches are applied to stored objects (and recorded)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.status_patches: list[dict[str, Any]] = []  # every merge patch, in order
        self.deleted: list[tuple[str, str]] = []
        self.unreadable_at = 0.0  # never blind

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((kind, name)))

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (k, _), obj in self.objects.items()
            if k == kind and selector.items() <= (obj["metadata"].get("labels") or {}).items()
        ]

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.objects[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)
        return obj

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return None
        stored = copy.deepcopy(obj)
        stored["metadata"].setdefault("uid", f"uid-{len(self.objects)}")
        stored["metadata"]["generation"] = 1
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def merge_patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        self.status_patches.append(patch)
        stored = self.objects.get((kind, name))
        if stored is None:  # an object the test passed in without storing it
            return patch
        updated = patched(stored, patch)
        if subresource is None and updated.get("spec") != stored.get("spec"):
            updated["metadata"]["generation"] = stored["metadata"].get("generation", 1) + 1
        self.objects[(kind, name)] = updated
        return copy.deepcopy(updated)

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        self.deleted.append((kind, name))
        return self.objects.pop((kind, name), None) is not None
