"""The metrics pipeline users run for autoscaling, on the test control plane: Prometheus discovering
and scraping the pods (the job of ``manifests/prometheus-scrape.yaml``) and prometheus-adapter serving
``custom.metrics.k8s.io`` from the rule of ``manifests/expertpool-hpa.yaml``, registered as an
APIService with TLS, so that the controller-manager's HorizontalPodAutoscaler controller reads it.

Both are host processes beside the control plane (:class:`e2e.controlplane.ControlPlane` with process
nodes, whose pod IPs the host reaches). What differs from a cluster, and why:

- Prometheus runs outside the cluster, so its pod discovery gets the plane's kubeconfig
  (``kubeconfig_file``) instead of in-cluster credentials; it scrapes every 1 s (users: 15-30 s).
- The adapter's rate window is ``rate_window`` (default 10 s) instead of the manifest's 1 m, so the
  drills see load change within seconds; the rule is otherwise the manifest's, unchanged.
- The APIService points at an ``ExternalName`` Service (``localhost``): the aggregator then dials the
  adapter on this host directly. Its serving certificate is signed by the plane's CA (the
  APIService's caBundle) for ``prometheus-adapter.monitoring.svc``, as the aggregator checks.
"""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from e2e.controlplane import ControlPlane
from e2e.pki import issue_serving_cert
from e2e.podrunner import quantity as exact_quantity
from e2e.processes import ManagedProcess, free_port
from e2e.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
SCRAPE_MANIFEST = ROOT / "manifests" / "prometheus-scrape.yaml"
HPA_MANIFEST = ROOT / "manifests" / "expertpool-hpa.yaml"
NAMESPACE = "monitoring"
ADAPTER_SERVICE = "prometheus-adapter"
CUSTOM_METRICS = "custom.metrics.k8s.io"
VERSIONS = ("v1beta2", "v1beta1")
MANIFEST_WINDOW = "[1m]"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def adapter_rules(rate_window: str) -> str:
    """The adapter's ``config.yaml`` from the manifest, with `rate_window` for its rate window."""
    _, config_map = yaml.safe_load_all(HPA_MANIFEST.read_text())
    text = str(config_map["data"]["config.yaml"])
    assert MANIFEST_WINDOW in text, f"the adapter rule in {HPA_MANIFEST} no longer uses {MANIFEST_WINDOW}"
    return text.replace(MANIFEST_WINDOW, f"[{rate_window}]")


def prometheus_config(kubeconfig: Path, scrape_interval: str, operator_targets: Path) -> dict[str, Any]:
    """The manifest's scrape job, its pod discovery pointed at `kubeconfig`; and the operator's
    /metrics, from the targets in `operator_targets` (the chart's ServiceMonitor's job in a
    cluster; here the operator is a host process)."""
    jobs = yaml.safe_load(SCRAPE_MANIFEST.read_text())["scrape_configs"]
    for job in jobs:
        for discovery in job["kubernetes_sd_configs"]:
            discovery["kubeconfig_file"] = str(kubeconfig)
    jobs.append(
        {
            "job_name": "eaas-operator",
            "file_sd_configs": [{"files": [str(operator_targets)], "refresh_interval": "2s"}],
        }
    )
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": jobs,
    }


class MetricsStack:
    """Start with :meth:`start` (or ``with MetricsStack(plane) as stack``), stop with :meth:`stop`.

    :meth:`stop_prometheus` / :meth:`start_prometheus` take the metrics away and bring them back
    (the adapter and the APIService stay)."""

    def __init__(self, plane: ControlPlane, rate_window: str = "10s", scrape_interval: str = "1s") -> None:
        self.plane = plane
        self.rate_window = rate_window
        self.scrape_interval = scrape_interval
        self.dir = plane.work_dir / "metrics"
        self.prometheus_url = ""
        self.operator_targets = self.dir / "operator-targets.json"
        self.prometheus: ManagedProcess | None = None
        self.adapter: ManagedProcess | None = None

    def __enter__(self) -> MetricsStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        prometheus_port, adapter_port = free_port(), free_port()
        self.prometheus_url = f"http://127.0.0.1:{prometheus_port}"
        config = self.dir / "prometheus.yml"
        self.operator_targets = self.dir / "operator-targets.json"
        self.operator_targets.write_text("[]")
        config.write_text(
            yaml.safe_dump(
                prometheus_config(self.plane.kubeconfig, self.scrape_interval, self.operator_targets)
            )
        )
        self.prometheus = ManagedProcess(
            "prometheus",
            [
                str(self.plane.binaries.prometheus),
                f"--config.file={config}",
                f"--storage.tsdb.path={self.dir / 'tsdb'}",
                "--storage.tsdb.retention.time=2h",
                f"--web.listen-address=127.0.0.1:{prometheus_port}",
                "--log.level=warn",
            ],
            self.plane.log_dir / "prometheus.log",
        )
        self.start_prometheus()

        rules = self.dir / "adapter.yaml"
        rules.write_text(adapter_rules(self.rate_window))
        cert, key = self.dir / "adapter.crt", self.dir / "adapter.key"
        pki = self.plane.pki
        issue_serving_cert(pki, cert, key, [f"{ADAPTER_SERVICE}.{NAMESPACE}.svc", "localhost"])
        kubeconfig = str(self.plane.kubeconfig)
        self.adapter = ManagedProcess(
            "prometheus-adapter",
            [
                str(self.plane.binaries.prometheus_adapter),
                f"--secure-port={adapter_port}",
                "--bind-address=127.0.0.1",
                f"--tls-cert-file={cert}",
                f"--tls-private-key-file={key}",
                f"--cert-dir={self.dir / 'adapter-certs'}",
                f"--lister-kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--prometheus-url={self.prometheus_url}/",
                f"--config={rules}",
                # A metric name is served only after a relist has seen it (default: every 10 min).
                "--metrics-relist-interval=2s",
                "--v=2",
            ],
            self.plane.log_dir / "prometheus-adapter.log",
        )
        self.adapter.start()
        self._register(adapter_port, pki.ca_cert.read_bytes())
        wait_until(self._available, 120, f"the APIService of {CUSTOM_METRICS} Available", ignore=(OSError,))

    def stop(self) -> None:
        for process in (self.adapter, self.prometheus):
            if process is not None:
                process.stop()

    def start_prometheus(self) -> None:
        assert self.prometheus is not None
        self.prometheus.start()
        wait_until(self._prometheus_ready, 60, "Prometheus ready", ignore=(OSError,))

    def scrape_operator(self, port: int) -> None:
        """Scrape the operator's /metrics on this host's `port` from now on."""
        staged = self.operator_targets.with_suffix(".tmp")
        staged.write_text(
            json.dumps([{"targets": [f"127.0.0.1:{port}"], "labels": {"component": "operator"}}])
        )
        staged.rename(self.operator_targets)  # Prometheus sees the whole file or none of it

    def stop_prometheus(self) -> None:
        assert self.prometheus is not None
        self.prometheus.stop()

    def _prometheus_ready(self) -> bool:
        assert self.prometheus is not None
        if not self.prometheus.running():
            raise RuntimeError(self.prometheus.describe_exit())
        with _DIRECT.open(f"{self.prometheus_url}/-/ready", timeout=2) as response:
            return bool(response.status == 200)

    def _register(self, port: int, ca: bytes) -> None:
        objects: list[dict[str, Any]] = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE},
                "spec": {"type": "ExternalName", "externalName": "localhost"},
            },
        ]
        for priority, version in zip((200, 100), VERSIONS, strict=True):
            objects.append(
                {
                    "apiVersion": "apiregistration.k8s.io/v1",
                    "kind": "APIService",
                    "metadata": {"name": f"{version}.{CUSTOM_METRICS}"},
                    "spec": {
                        "group": CUSTOM_METRICS,
                        "version": version,
                        "groupPriorityMinimum": 100,
                        "versionPriority": priority,
                        "caBundle": base64.b64encode(ca).decode(),
                        "service": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE, "port": port},
                    },
                }
            )
        self._kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects))

    def _available(self) -> bool:
        for process in (self.adapter, self.prometheus):
            if process is not None and not process.running():
                raise RuntimeError(process.describe_exit())
        service = json.loads(
            self._kubectl("get", "apiservice", f"{VERSIONS[0]}.{CUSTOM_METRICS}", "-o", "json")
        )
        conditions = service.get("status", {}).get("conditions", [])
        return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)

    def _kubectl(self, *args: str, input: str | None = None) -> str:
        return subprocess.run(
            [str(self.plane.binaries.kubectl), f"--kubeconfig={self.plane.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout

    # -- reading -------------------------------------------------------------------------------
    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant PromQL query's result vector (raises when Prometheus does not answer)."""
        url = f"{self.prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with _DIRECT.open(url, timeout=5) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def pods_metric(self, namespace: str, metric: str) -> dict[str, float]:
        """What custom.metrics.k8s.io serves (through the API server) for `metric` of every pod in
        `namespace`: pod name -> value. Empty when it serves nothing."""
        path = f"/apis/{CUSTOM_METRICS}/{VERSIONS[0]}/namespaces/{namespace}/pods/*/{metric}"
        items = json.loads(self._kubectl("get", "--raw", path)).get("items", [])
        return {item["describedObject"]["name"]: quantity(item["value"]) for item in items}


def quantity(text: str) -> float:
    """A Kubernetes quantity as the adapter writes values (``250m``, ``3``, ``1500k``)."""
    return float(exact_quantity(text))
