"""pytest fixtures for everything under e2e/: a real Kubernetes API for the whole session.

Fixtures (documented API, reused by the operator's e2e tests):

``cluster`` (session)
    an :class:`e2e.cluster.Cluster`: ``kubeconfig`` (Path), the ``kubernetes`` package's clients
    ``core``/``apps``/``custom``/``apiextensions``/``coordination``/``rbac``, ``kubectl(*args)``,
    ``helm(*args)``, ``apply(manifest, namespace)``, ``gpu_nodes()``, ``namespace()``.
``namespace`` (function)
    the name of a fresh namespace (its ``default`` ServiceAccount exists), deleted after the test.

The backend is chosen by the environment (:mod:`e2e.backends`): local binaries by default,
``EAAS_E2E_KUBECONFIG`` for an existing cluster, ``EAAS_E2E_CLUSTER=kind`` for pytest-kind.
Every test collected under e2e/ gets the ``e2e`` marker, so ``pytest -m "not e2e"`` skips them.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from e2e.backends import BackendUnavailable, cluster_from_environment
from e2e.binaries import MissingBinariesError
from e2e.cluster import Cluster

E2E_DIR = Path(__file__).resolve().parent
_session_clusters: list[Cluster] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_on_termination_signals() -> None:
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt so pytest runs the fixture teardown (which stops
    the control plane). Processes also die with us on SIGKILL (PR_SET_PDEATHSIG, see processes.py)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _interrupt)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The session's cluster (started once, stopped after the last test)."""
    _stop_on_termination_signals()
    with contextlib.ExitStack() as stack:
        unavailable = missing = ""
        try:
            provided = stack.enter_context(cluster_from_environment())
        except BackendUnavailable as error:
            unavailable = str(error)
        except MissingBinariesError as error:
            missing = str(error)
        # Outside the `except` blocks, so the report shows the reason alone, not a chained traceback.
        if unavailable:
            pytest.skip(unavailable)
        if missing:
            pytest.fail(missing, pytrace=False)
        _session_clusters.append(provided)
        yield provided


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test, deleted (in the background) afterwards."""
    with cluster.namespace(prefix=request.node.name.removeprefix("test_")) as name:
        yield name


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for provided in _session_clusters:
        line = f"e2e cluster: backend={provided.backend} kubeconfig={provided.kubeconfig}"
        if provided.backend == "local":
            line += f" started in {provided.startup_seconds:.1f} s (EAAS_E2E_KEEP_DIR=1 keeps its logs)"
        terminalreporter.write_line(line)
