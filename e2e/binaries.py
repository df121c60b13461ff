"""Where the Kubernetes test binaries live and which versions they are.

Versions are pinned in ``e2e/versions.env`` (shared with ``e2e/bin/build-k8s.sh``); each can be
overridden by an environment variable of the same name. Binaries are cached in
``${EAAS_CACHE_DIR:-~/.cache/eaas}/k8s-<version>/bin`` unless ``EAAS_K8S_BIN_DIR`` points elsewhere.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent
VERSIONS_FILE = E2E_DIR / "versions.env"
BUILD_SCRIPT = E2E_DIR / "bin" / "build-k8s.sh"

BINARY_NAMES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
    "kubectl",
    "helm",
    "kwok",
    "coredns",
    "prometheus",
    "prometheus-adapter",
)
# What a control plane with kwok nodes only uses (no process nodes, no metrics pipeline).
KWOK_PLANE = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "helm",
    "kwok",
)


class MissingBinariesError(RuntimeError):
    """The control-plane binaries have not been built (run ``make k8s-bins``)."""


def pinned_versions() -> dict[str, str]:
    """``EAAS_*_VERSION`` pins from versions.env, with environment overrides applied."""
    versions: dict[str, str] = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        versions[key.strip()] = os.environ.get(key.strip()) or value.strip()
    return versions


def cache_dir() -> Path:
    """The EaaS cache directory: ``$EAAS_CACHE_DIR`` or ``~/.cache/eaas``."""
    if override := os.environ.get("EAAS_CACHE_DIR"):
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "eaas"


def kubernetes_version() -> str:
    """The pinned Kubernetes release, e.g. ``1.37.1`` (no leading v)."""
    return pinned_versions()["EAAS_K8S_VERSION"]


def bin_dir() -> Path:
    """Directory holding the cached binaries (``$EAAS_K8S_BIN_DIR`` wins)."""
    if override := os.environ.get("EAAS_K8S_BIN_DIR"):
        return Path(override).expanduser()
    return cache_dir() / f"k8s-{kubernetes_version()}" / "bin"


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of the control-plane executables."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kube_proxy: Path
    kubectl: Path
    helm: Path
    kwok: Path
    coredns: Path
    prometheus: Path
    prometheus_adapter: Path

    @classmethod
    def from_dir(cls, directory: Path, required: tuple[str, ...] = BINARY_NAMES) -> Binaries:
        """Binaries in `directory`; raises :class:`MissingBinariesError` naming what is missing of
        `required` (default: all)."""
        paths = {name: directory / name for name in BINARY_NAMES}
        missing = [name for name in required if not os.access(paths[name], os.X_OK)]
        if missing:
            raise MissingBinariesError(
                f"Kubernetes test binaries missing in {directory}: {', '.join(missing)}. "
                f"Build them once with `make k8s-bins` (runs {BUILD_SCRIPT.relative_to(E2E_DIR.parent)}, "
                "~11-20 min on 2 cores), or point EAAS_E2E_KUBECONFIG at an existing cluster."
            )
        return cls(**{name.replace("-", "_"): path for name, path in paths.items()})

    @classmethod
    def locate(cls, required: tuple[str, ...] = BINARY_NAMES) -> Binaries:
        """The cached binaries for the pinned versions (`required`: those that must be there)."""
        return cls.from_dir(bin_dir(), required)


def tool_path(name: str) -> str:
    """Path of a client tool (``kubectl``/``helm``): the cached build if present, else from PATH."""
    cached = bin_dir() / name
    if os.access(cached, os.X_OK):
        return str(cached)
    found = shutil.which(name)
    if found is None:
        raise MissingBinariesError(f"{name} is neither in {bin_dir()} nor on PATH; run `make k8s-bins`.")
    return found
