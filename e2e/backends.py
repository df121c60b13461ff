"""Choosing and providing the cluster for a test session (see :mod:`e2e.cluster` for the backends).

Environment:
    EAAS_E2E_KUBECONFIG   use this existing cluster (nothing is started or stopped)
    EAAS_E2E_CLUSTER      ``local`` (default) or ``kind`` (pytest-kind, needs Docker)
    EAAS_E2E_KEEP_DIR     ``1`` keeps the local control plane's directory (logs, etcd) after the run
    EAAS_E2E_GPU_NODES    number of fake GPU nodes on the local backend (default 2)
    EAAS_E2E_VOLUME_DELAY_SECONDS  process nodes: ConfigMap and Secret volumes show a change this
                          late (default 0; a kubelet takes a minute or more: test with 60)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from e2e.cluster import Cluster
from e2e.controlplane import ControlPlane, FakeNodeSpec, ProcessNodeSpec
from e2e.podnet import missing_tools

BACKENDS = ("local", "kind")


class BackendUnavailable(Exception):
    """The opt-in backend cannot run here; the message says why (tests are skipped with it)."""


def backend_name() -> str:
    if os.environ.get("EAAS_E2E_KUBECONFIG"):
        return "existing"
    name = os.environ.get("EAAS_E2E_CLUSTER", "local") or "local"
    if name not in BACKENDS:
        raise ValueError(f"EAAS_E2E_CLUSTER={name!r}: expected one of {', '.join(BACKENDS)}")
    return name


@contextlib.contextmanager
def local_cluster() -> Iterator[Cluster]:
    """Start the control plane from the cached binaries; stop it (all processes) on exit."""
    nodes = FakeNodeSpec(count=int(os.environ.get("EAAS_E2E_GPU_NODES", "2")))
    keep = os.environ.get("EAAS_E2E_KEEP_DIR", "") == "1"
    with ControlPlane(nodes=nodes, keep_work_dir=keep) as plane:
        yield plane_cluster(plane)


@contextlib.contextmanager
def process_plane(nodes: ProcessNodeSpec) -> Iterator[ControlPlane]:
    """A control plane whose nodes really run their pods (:mod:`e2e.podrunner`); skips the test
    without root, fails it without the host tools. EAAS_E2E_KEEP_DIR=1 keeps its directory."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("process nodes need root (network namespaces, a bridge, nftables)")
    if missing := missing_tools():
        pytest.fail(f"process nodes need {', '.join(missing)}: run `make host-tools`", pytrace=False)
    keep = os.environ.get("EAAS_E2E_KEEP_DIR", "") == "1"
    with ControlPlane(process_nodes=nodes, keep_work_dir=keep) as plane:
        yield plane


def plane_cluster(plane: ControlPlane) -> Cluster:
    """The :class:`Cluster` of a started local control plane."""
    return Cluster.from_kubeconfig(
        plane.kubeconfig,
        "local",
        startup_seconds=plane.startup_seconds,
        kubectl_path=str(plane.binaries.kubectl),
        helm_path=str(plane.binaries.helm),
        work_dir=plane.work_dir,
    )


@contextlib.contextmanager
def existing_cluster(kubeconfig: str) -> Iterator[Cluster]:
    path = Path(kubeconfig).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"EAAS_E2E_KUBECONFIG={kubeconfig}: no such file")
    yield Cluster.from_kubeconfig(path, "existing")


def _container_engine_ready() -> bool:
    for engine in ("docker", "podman"):
        path = shutil.which(engine)
        if path is None:
            continue
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if subprocess.run([path, "info"], capture_output=True, timeout=30).returncode == 0:
                return True
    return False


@contextlib.contextmanager
def kind_cluster() -> Iterator[Cluster]:
    """A kind cluster through pytest-kind (imported only in this opt-in mode)."""
    try:
        from pytest_kind import KindCluster  # type: ignore[import-not-found]
    except ImportError as error:
        raise BackendUnavailable(
            f"EAAS_E2E_CLUSTER=kind needs pytest-kind (pip install pytest-kind) and Docker: {error}"
        ) from error
    if not _container_engine_ready():
        raise BackendUnavailable(
            "EAAS_E2E_CLUSTER=kind needs a running Docker or Podman engine (`docker info` failed)"
        )
    # pytest-kind downloads kind and kubectl into .pytest-kind/ unless they are there already.
    kind = KindCluster(os.environ.get("EAAS_E2E_KIND_NAME", "eaas-e2e"))
    try:
        kind.create()
    except Exception as error:
        raise BackendUnavailable(f"kind cluster could not be created: {error}") from error
    try:
        yield Cluster.from_kubeconfig(Path(kind.kubeconfig_path), "kind", kubectl_path=str(kind.kubectl_path))
    finally:
        kind.delete()


def cluster_from_environment() -> contextlib.AbstractContextManager[Cluster]:
    """The cluster context manager selected by the environment (see the module docstring)."""
    name = backend_name()
    if name == "existing":
        return existing_cluster(os.environ["EAAS_E2E_KUBECONFIG"])
    if name == "kind":
        return kind_cluster()
    return local_cluster()
