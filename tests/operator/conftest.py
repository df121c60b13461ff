"""Fixtures of the operator's unit tests: valid specs and owner bodies, as the API server stores them."""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from eaas.operator.api import ExpertPoolSpec, MoEServiceSpec
from eaas.operator.builders import moeservice as build_moeservice

ROOT = Path(__file__).resolve().parents[2]
TINY_MANIFEST = ROOT / "manifests" / "moeservice-tiny-cpu.yaml"
BENCHMARKS = ROOT / "benchmarks"


@contextlib.contextmanager
def _benchmark_module(name: str) -> Iterator[ModuleType]:
    """benchmarks/<name>.py imported by name (its siblings ``_common``, ``_load``, ``elasticity``
    are found next to it), forgotten again afterwards."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop(name, None)


@pytest.fixture(scope="session")
def import_benchmark() -> Callable[[str], contextlib.AbstractContextManager[ModuleType]]:
    """``with import_benchmark("fault_drill") as module:`` the pure parts of a benchmark script."""
    return _benchmark_module


def tiny_manifest() -> dict[str, Any]:
    """The tiny CPU MoEService of manifests/ (what users apply first)."""
    return yaml.safe_load(TINY_MANIFEST.read_text())


def body(
    kind: str, name: str, spec: dict[str, Any], uid: str = "uid-1", namespace: str = "ns"
) -> dict[str, Any]:
    return {
        "apiVersion": "eaas.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": 1},
        "spec": copy.deepcopy(spec),
    }


@pytest.fixture
def moes_spec() -> MoEServiceSpec:
    return MoEServiceSpec.from_k8s(tiny_manifest()["spec"])


@pytest.fixture
def moes_body() -> dict[str, Any]:
    return body("MoEService", "tiny", tiny_manifest()["spec"], uid="moes-uid")


@pytest.fixture
def pool_body(moes_body: dict[str, Any], moes_spec: MoEServiceSpec) -> dict[str, Any]:
    """The ExpertPool the tiny MoEService creates, with a uid as if the API server stored it."""
    pool = build_moeservice.expert_pool(moes_body, moes_spec)
    pool["metadata"]["uid"] = "pool-uid"
    return pool


@pytest.fixture
def pool_spec(pool_body: dict[str, Any]) -> ExpertPoolSpec:
    return ExpertPoolSpec.from_k8s(pool_body["spec"])
