"""Fixtures of the whole-system drills: a control plane whose GPU nodes really run their pods
(:mod:`e2e.podrunner`), the chart and operator on it (the fixtures of ``e2e/operator/conftest.py``,
which this ``cluster`` overrides), a tiny checkpoint on the nodes and a MoEService serving it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.backends import plane_cluster
from e2e.backends import process_plane as process_plane_of
from e2e.cluster import Cluster
from e2e.controlplane import ControlPlane, ProcessNodeSpec
from e2e.operator.conftest import Release
from e2e.operator.harness import OperatorProcess, operator_as


# Module-scoped: the plane (and its processes) goes as soon as the drills are done, so the tests
# after them do not share the machine with it.
@pytest.fixture(scope="module")
def process_plane() -> Iterator[ControlPlane]:
    with process_plane_of(ProcessNodeSpec(count=2, gpus=4)) as plane:
        yield plane


@pytest.fixture(scope="module")
def cluster(process_plane: ControlPlane) -> Cluster:
    return plane_cluster(process_plane)


@pytest.fixture(scope="module")
def node_checkpoint(process_plane: ControlPlane) -> Path:
    """The tiny mixtral checkpoint where the MoEService's hostPath points (on every node: they
    share this machine)."""
    directory = process_plane.work_dir / "checkpoints" / "tiny-mixtral"
    if not directory.exists():
        subprocess.run(
            [sys.executable, "-m", "eaas.runtime.cli", "model", "init", "--family", "mixtral",
             "--preset", "tiny", "--out", str(directory)],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    return directory


@pytest.fixture(scope="module")
def system_operator(
    cluster: Cluster, release: Release, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator, running as the chart's ServiceAccount, on this module's process plane."""
    with operator_as(
        cluster, release.namespace, release.service_account, tmp_path_factory.mktemp("operator")
    ) as process:
        yield process


def pod_logs(plane: ControlPlane, namespace: str, lines: int = 40) -> str:
    """The end of every container log of `namespace` (printed when a drill fails), after every
    running process of the namespace was asked for its threads' stacks (``eaas`` dumps them on
    SIGUSR1), so a hung one shows where it hangs."""
    if dump_stacks(namespace):
        time.sleep(1.0)  # the dumps are written from a signal handler: let them reach the logs
    lines = max(lines, 200)
    out = []
    for path in sorted(plane.pod_dir.glob(f"{namespace}_*/*.log")):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.parent.name}/{path.name}\n" + "\n".join(text))
    runner = plane.log_dir / "podrunner.log"
    if runner.exists():
        out.append("--- podrunner\n" + "\n".join(runner.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(out)


def dump_stacks(namespace: str) -> int:
    """Sends SIGUSR1 to every ``eaas`` process of a pod of `namespace`; returns how many."""
    signalled = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            if (
                f"EAAS_NAMESPACE={namespace}".encode() in environ
                and b"eaas" in (proc / "cmdline").read_bytes()
            ):
                os.kill(int(proc.name), signal.SIGUSR1)
                signalled += 1
        except (OSError, ProcessLookupError):
            continue  # gone, or not ours to read
    return signalled
