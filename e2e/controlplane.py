"""A real Kubernetes control plane from local binaries: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (which plays the kubelet of fake GPU nodes, so scheduled Pods become Running).

With ``process_nodes`` the GPU nodes are served by :mod:`e2e.podrunner` instead of kwok: pods run
their containers as local processes, each in a network namespace on a bridge (:mod:`e2e.podnet`),
with kube-proxy (nftables) for ClusterIP Services and CoreDNS for Service and pod names. The API
server then listens on the bridge's gateway address, where pods reach it (through the
``kubernetes`` Service, as in a real cluster).

Like controller-runtime's envtest and kwokctl's ``binary`` runtime, everything listens on free
127.0.0.1 ports and lives in one temporary directory (certificates, etcd data, logs, kubeconfig).

In tests use it through the ``cluster`` fixture (``e2e/conftest.py``); in code::

    with ControlPlane() as plane:        # plane.kubeconfig, plane.server, plane.node_names
        ...

By hand, detached: ``make cluster-up`` / ``make cluster-down`` (:mod:`e2e.handrun`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import yaml

from e2e import binaries as bins
from e2e.pki import FRONT_PROXY_CLIENT, KUBELET_CLIENT, Pki, issue_serving_cert, write_pki
from e2e.podnet import PodNetwork, missing_tools
from e2e.processes import ManagedProcess, free_port
from e2e.waiting import wait_until

SERVICE_CIDR = "10.0.0.0/24"  # only allocated, never routed: no traffic goes there
POD_CIDR = "10.244.0.0/16"  # pod IPs kwok writes into Pod status
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
STATE_FILE = "state.json"
KWOK_STAGES = Path(__file__).resolve().parent / "kwok-stages.yaml"
START_TIMEOUT_SECONDS = 120.0
HPA_SYNC_SECONDS = 2  # the controller-manager's HorizontalPodAutoscaler sync period
ROOT = Path(__file__).resolve().parents[1]
API_SERVICE_IP = "10.0.0.1"  # the `kubernetes` Service: first address of SERVICE_CIDR


@dataclass(frozen=True)
class FakeNodeSpec:
    """Shape of the fake nodes kwok manages (no taints, so ordinary Pods schedule onto them)."""

    count: int = 2
    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    name_prefix: str = "kwok-gpu-"

    def names(self) -> list[str]:
        return [f"{self.name_prefix}{index}" for index in range(self.count)]

    def manifest(self, name: str) -> dict:
        resources = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            GPU_RESOURCE: str(self.gpus),
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {FAKE_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "kubernetes.io/role": "agent",
                    "node-role.kubernetes.io/agent": "",
                    "type": "kwok",
                    "nvidia.com/gpu.present": "true",
                },
            },
            "spec": {},
            "status": {"capacity": resources, "allocatable": resources},
        }


def volume_delay_from_environment() -> float:
    """``EAAS_E2E_VOLUME_DELAY_SECONDS`` (seconds, >= 0; unset: 0)."""
    text = os.environ.get("EAAS_E2E_VOLUME_DELAY_SECONDS", "") or "0"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"EAAS_E2E_VOLUME_DELAY_SECONDS={text!r}: expected seconds >= 0")
    return value


@dataclass(frozen=True)
class ProcessNodeSpec:
    """GPU nodes whose pods really run (:mod:`e2e.podrunner`); no kwok nodes are made then."""

    count: int = 2
    gpus: int = 8
    name_prefix: str = "gpu-node-"
    # How late ConfigMap and Secret volumes show a change (:class:`e2e.podrunner.RunnerConfig`);
    # default: EAAS_E2E_VOLUME_DELAY_SECONDS, else 0 (a kubelet takes a minute or more)
    volume_delay_s: float = field(default_factory=volume_delay_from_environment)

    def names(self) -> list[str]:
        return [f"{self.name_prefix}{index}" for index in range(self.count)]


def _corefile(gateway: str, kubeconfig: Path) -> str:
    """Cluster names from the API (pods' A records for headless Services included); nothing else
    resolves, since nothing outside this machine may be reached."""
    return f"""cluster.local:53 {{
    bind {gateway}
    errors
    kubernetes cluster.local {{
        kubeconfig {kubeconfig}
        pods insecure
        ttl 1
    }}
}}
.:53 {{
    bind {gateway}
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


def _kubeconfig(server: str, pki: Pki) -> dict:
    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "eaas-e2e",
                "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_cert)},
            }
        ],
        "users": [
            {
                "name": "eaas-e2e-admin",
                "user": {
                    "client-certificate-data": b64(pki.admin_cert),
                    "client-key-data": b64(pki.admin_key),
                },
            }
        ],
        "contexts": [{"name": "eaas-e2e", "context": {"cluster": "eaas-e2e", "user": "eaas-e2e-admin"}}],
        "current-context": "eaas-e2e",
    }


def _https_ok(url: str, context: ssl.SSLContext) -> bool:
    with urllib.request.urlopen(url, timeout=2, context=context) as response:
        return bool(response.status == 200)


class ControlPlane:
    """Start with :meth:`start` (or ``with ControlPlane(...) as plane``), stop with :meth:`stop`.

    Attributes after start: ``kubeconfig`` (path), ``server`` (https URL), ``work_dir``,
    ``node_names`` (the fake GPU nodes), ``startup_seconds``.
    """

    def __init__(
        self,
        binaries: bins.Binaries | None = None,
        work_dir: Path | None = None,
        nodes: FakeNodeSpec | None = None,
        attached: bool = True,
        keep_work_dir: bool = False,
        process_nodes: ProcessNodeSpec | None = None,
        api_server_args: Sequence[str] = (),
    ) -> None:
        self.binaries = binaries or bins.Binaries.locate()
        self._own_work_dir = work_dir is None
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="eaas-k8s-"))
        self.nodes = nodes or FakeNodeSpec()
        self.attached = attached
        self.keep_work_dir = keep_work_dir
        self.kubeconfig = self.work_dir / "kubeconfig"
        self.log_dir = self.work_dir / "logs"
        self.server = ""
        self.process_nodes = process_nodes
        self.api_server_args = list(api_server_args)  # extra kube-apiserver flags (e.g. audit logging)
        self.node_names = process_nodes.names() if process_nodes else self.nodes.names()
        self.startup_seconds = 0.0
        self.processes: list[ManagedProcess] = []
        self.network: PodNetwork | None = None
        self.pod_dir = self.work_dir / "pods"  # process nodes: per pod, its volumes and container logs
        self._admin: ssl.SSLContext | None = None  # a client context with the admin's certificate
        self._pki: Pki | None = None

    @property
    def pki(self) -> Pki:
        """The plane's certificates (after start)."""
        assert self._pki is not None, "the control plane was not started"
        return self._pki

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start every component and return once the cluster can run Pods (or raise, cleaned up)."""
        started = time.monotonic()
        try:
            self._start()
        except Exception as error:
            # Keep the directory so the component logs can be read; say where it is.
            self.stop(remove_work_dir=False)
            error.add_note(f"control-plane logs kept in {self.log_dir}")
            raise
        except BaseException:  # KeyboardInterrupt, SystemExit: just clean up
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def stop(self, remove_work_dir: bool | None = None) -> None:
        """Stop all components, newest first (idempotent), and remove the work dir unless kept."""
        while self.processes:
            self.processes.pop().stop()
        if self.network is not None:
            self.network.down()
            self.network = None
            # kube-proxy leaves its rules behind when it stops; they would translate ClusterIPs to
            # pod addresses that no longer exist.
            for family in ("ip", "ip6"):
                subprocess.run(
                    ["nft", "delete", "table", family, "kube-proxy"], capture_output=True, timeout=30
                )
        remove = (
            (self._own_work_dir and not self.keep_work_dir) if remove_work_dir is None else remove_work_dir
        )
        if remove:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def api_server_down(self, seconds: float) -> float:
        """Stops the kube-apiserver (SIGTERM, as a crash or an upgrade of the only replica would
        take it away), starts it again after `seconds` and waits until it is ready again; returns
        how long it was unreachable. Everything else keeps running."""
        api = next(p for p in self.processes if p.name == "kube-apiserver")
        admin = self._admin
        assert admin is not None, "the control plane was not started"
        stopped = time.monotonic()
        api.stop()
        time.sleep(max(0.0, seconds - (time.monotonic() - stopped)))
        api.start()
        self._wait(lambda: _https_ok(f"{self.server}/readyz", admin), "kube-apiserver /readyz again")
        return time.monotonic() - stopped

    def kube_proxy_routes(
        self, namespace: str, service: str, port: str, protocol: str = "TCP"
    ) -> frozenset[str]:
        """Where kube-proxy's nftables rules send a new connection to the ClusterIP of Service
        `namespace/service` (its port named `port`) right now: the endpoints, as ``IP:port``; empty
        while none is programmed. This is what a client of the Service reaches, and it lags the
        EndpointSlice until kube-proxy has synced: after an API server outage by up to a minute,
        as kube-proxy's informers retry their watches with client-go's backoff (0.8 s doubling
        to 30 s, jittered up to twice that), like every other client's. Raises if kube-proxy exited."""
        proxy = next((p for p in self.processes if p.name == "kube-proxy"), None)
        assert proxy is not None, "no kube-proxy: the plane has no process nodes"
        if not proxy.running():
            raise RuntimeError(proxy.describe_exit())
        listing = subprocess.run(
            ["nft", "list", "table", "ip", "kube-proxy"], capture_output=True, text=True, timeout=30
        )
        if listing.returncode != 0:  # kube-proxy has not written its table yet
            return frozenset()
        return service_chain_endpoints(listing.stdout, f"{namespace}/{service}/{protocol.lower()}/{port}")

    # -- internals -----------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        process = ManagedProcess(name, argv, self.log_dir / f"{name}.log", env=env, attached=self.attached)
        process.start()
        self.processes.append(process)
        return process

    def _wait(
        self, condition: Callable[[], object], description: str, timeout: float = START_TIMEOUT_SECONDS
    ) -> None:
        """Wait for `condition`, failing fast (with the log) if a component exits meanwhile."""

        def check() -> bool:
            for process in self.processes:
                if not process.running():
                    raise RuntimeError(f"while waiting for {description}: {process.describe_exit()}")
            return bool(condition())

        wait_until(check, timeout, description, ignore=(OSError, ValueError))

    def _start(self) -> None:
        b = self.binaries
        address = "127.0.0.1"
        if self.process_nodes is not None:
            if missing := missing_tools():
                raise RuntimeError(f"process nodes need {', '.join(missing)} (`make host-tools`)")
            self.network = PodNetwork(f"e{secrets.token_hex(3)}", SERVICE_CIDR)
            self.network.up()
            address = self.network.gateway
        pki = write_pki(self.work_dir / "pki", API_SERVICE_IP, (address,))
        self._pki = pki
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        kcm_port, scheduler_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self.server = f"https://{address}:{api_port}"
        # Without process nodes nothing can reach the API through the `kubernetes` Service, and
        # loopback addresses are not valid Endpoints: no endpoint reconciler then.
        endpoints = ["--endpoint-reconciler-type=none"] if self.process_nodes is None else []

        self._spawn(
            "etcd",
            [
                str(b.etcd),
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._wait(lambda: _etcd_healthy(etcd_url), "etcd /health")

        cert_dir = self.work_dir / "certs"
        self._spawn(
            "kube-apiserver",
            [
                str(b.kube_apiserver),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={address}",
                f"--advertise-address={address}",
                *endpoints,
                f"--secure-port={api_port}",
                f"--cert-dir={cert_dir}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                # The aggregation layer (prometheus-adapter's custom.metrics.k8s.io): the API server
                # authenticates the user and passes it on in X-Remote-* headers, signed in by this
                # client certificate, which the aggregated server trusts.
                f"--requestheader-client-ca-file={pki.ca_cert}",
                f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki.front_proxy_cert}",
                f"--proxy-client-key-file={pki.front_proxy_key}",
                # `kubectl logs` (pods/log): the API server connects to the node's kubelet endpoint
                # with this client certificate and checks the endpoint's certificate against the CA
                # (the process nodes serve one; kwok's nodes serve none).
                f"--kubelet-client-certificate={pki.kubelet_client_cert}",
                f"--kubelet-client-key={pki.kubelet_client_key}",
                f"--kubelet-certificate-authority={pki.ca_cert}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.service_account_public_key}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                "--profiling=false",
                *self.api_server_args,
            ],
        )
        self.kubeconfig.write_text(yaml.safe_dump(_kubeconfig(self.server, pki)))
        admin = ssl.create_default_context(cafile=str(pki.ca_cert))
        admin.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        self._admin = admin
        self._wait(lambda: _https_ok(f"{self.server}/readyz", admin), "kube-apiserver /readyz")

        kubeconfig = f"--kubeconfig={self.kubeconfig}"
        self._spawn(
            "kube-controller-manager",
            [
                str(b.kube_controller_manager),
                kubeconfig,
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--cert-dir={cert_dir / 'kcm'}",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca_cert}",
                f"--cluster-signing-cert-file={pki.ca_cert}",
                f"--cluster-signing-key-file={pki.ca_key}",
                # HorizontalPodAutoscalers act within seconds (default: every 15 s); their own
                # `behavior` sets the stabilisation windows and tolerance.
                f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_SECONDS}s",
                "--profiling=false",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(b.kube_scheduler),
                kubeconfig,
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={scheduler_port}",
                f"--cert-dir={cert_dir / 'scheduler'}",
                "--profiling=false",
            ],
        )
        if self.process_nodes is not None:
            self._start_process_nodes(kubeconfig)
            self._wait_common(kcm_port, scheduler_port)
            return
        self._spawn(
            "kwok",
            [
                str(b.kwok),
                kubeconfig,
                f"--config={KWOK_STAGES}",  # also keeps kwok from reading ~/.kwok/kwok.yaml
                "--node-lease-duration-seconds=40",  # leases keep the nodes Ready for node-lifecycle
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
                "--manage-nodes-with-label-selector=",
                "--manage-single-node=",
                f"--cidr={POD_CIDR}",
                "--node-ip=10.244.0.1",
            ],
        )
        self._create_fake_nodes()
        self._wait_common(kcm_port, scheduler_port)

    def _wait_common(self, kcm_port: int, scheduler_port: int) -> None:
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # self-signed serving certs of kcm/scheduler, loopback only
        self._wait(lambda: _https_ok(f"https://127.0.0.1:{kcm_port}/healthz", insecure), "controller-manager")
        self._wait(lambda: _https_ok(f"https://127.0.0.1:{scheduler_port}/healthz", insecure), "scheduler")
        self._wait(self._default_service_account_exists, "the 'default' ServiceAccount (controller-manager)")
        self._wait(self._fake_nodes_ready, f"nodes {self.node_names} to be Ready")

    def _start_process_nodes(self, kubeconfig: str) -> None:
        """kube-proxy and CoreDNS on the gateway, and the process runner for the GPU nodes."""
        from e2e.podrunner import RunnerConfig

        assert self.network is not None and self.process_nodes is not None
        b, gateway = self.binaries, self.network.gateway
        self._spawn(
            "kube-proxy",
            [
                str(b.kube_proxy),
                kubeconfig,
                "--proxy-mode=nftables",
                f"--hostname-override={self.node_names[0]}",
                f"--cluster-cidr={self.network.subnet}",
                f"--healthz-bind-address=127.0.0.1:{free_port()}",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                # Leave the machine's conntrack settings alone.
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
            ],
        )
        corefile = self.work_dir / "Corefile"
        corefile.write_text(_corefile(gateway, self.kubeconfig))
        self._spawn("coredns", [str(b.coredns), "-conf", str(corefile)])
        # The runner's kubelet log endpoints (one per node, on the gateway) present this certificate.
        kubelet_cert = self.pki.ca_cert.with_name("kubelet.crt")
        kubelet_key = self.pki.ca_cert.with_name("kubelet.key")
        issue_serving_cert(self.pki, kubelet_cert, kubelet_key, self.node_names, (gateway,))
        runner_config = RunnerConfig(
            kubeconfig=str(self.kubeconfig),
            nodes=self.node_names,
            gpus_per_node=self.process_nodes.gpus,
            work_dir=str(self.work_dir),
            network_name=self.network.name,
            bridge=self.network.bridge,
            subnet=str(self.network.subnet),
            gateway=gateway,
            api_service_host=API_SERVICE_IP,
            api_service_port=443,
            path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            image_paths=[str(ROOT), sys.prefix, sys.base_prefix],
            kubelet_ca=str(self.pki.ca_cert),
            kubelet_cert=str(kubelet_cert),
            kubelet_key=str(kubelet_key),
            kubelet_client=KUBELET_CLIENT,
            volume_delay_s=self.process_nodes.volume_delay_s,
        )
        config_path = self.work_dir / "podrunner.json"
        runner_config.save(config_path)
        environment = dict(os.environ, PYTHONPATH=str(ROOT))
        self._spawn("podrunner", [sys.executable, "-m", "e2e.podrunner", str(config_path)], env=environment)

    def _kubectl_json(self, *args: str) -> dict:
        output = subprocess.run(
            [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig}", *args, "-o", "json"],
            check=True,
            capture_output=True,
            timeout=30,
        ).stdout
        return dict(json.loads(output))

    def _create_fake_nodes(self) -> None:
        manifests = "\n---\n".join(yaml.safe_dump(self.nodes.manifest(name)) for name in self.node_names)
        subprocess.run(
            [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig}", "apply", "-f", "-"],
            input=manifests.encode(),
            check=True,
            capture_output=True,
            timeout=60,
        )

    def _default_service_account_exists(self) -> bool:
        try:
            return bool(self._kubectl_json("get", "serviceaccount", "default", "-n", "default"))
        except Exception:
            return False

    def _fake_nodes_ready(self) -> bool:
        nodes = self._kubectl_json("get", "nodes")["items"]
        ready = {
            node["metadata"]["name"]
            for node in nodes
            for condition in node.get("status", {}).get("conditions", [])
            if condition["type"] == "Ready" and condition["status"] == "True"
        }
        return set(self.node_names) <= ready

    # -- detached mode (cluster-up / cluster-down) -------------------------------------------------
    def write_state(self) -> Path:
        state = {
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            # process nodes: the pod network (bridge, namespaces, rules) that `down` removes
            "network": self.network.name if self.network is not None else None,
            "processes": [
                {"name": p.name, "pid": p.pid, "binary": str(p.argv[0]), "log": str(p.log_path)}
                for p in self.processes
            ],
        }
        path = self.work_dir / STATE_FILE
        path.write_text(json.dumps(state, indent=2))
        return path


# An endpoint in a kube-proxy (nftables) service chain, in each form kube-proxy 1.37 writes it
# (pkg/proxy/nftables/proxier.go): one endpoint `dnat to 10.245.0.4:8000`; several
# `dnat ip addr . port to numgen random mod 2 map { 0 : 10.245.0.4 . 8000, 1 : ... }`; with session
# affinity, jumps to endpoint chains named `endpoint-<hash>-<ns>/<svc>/tcp/<port>__10.245.0.4/8000`.
_IP = r"\d{1,3}(?:\.\d{1,3}){3}"
_ENDPOINT = re.compile(rf"({_IP})(?::| \. )(\d+)|__({_IP})/(\d+)")


def service_chain_endpoints(table: str, port_name: str) -> frozenset[str]:
    """The endpoints (``IP:port``) of the service chain ``service-<hash>-<port_name>`` (port_name:
    ``<namespace>/<service>/<protocol>/<port>``) in `table`, the text of ``nft list table ip
    kube-proxy``; empty when there is no such chain (no endpoints) or it is empty."""
    name = re.escape(f"-{port_name}")
    chain = re.search(rf"\n\tchain service-[A-Z0-9]+{name} \{{(.*?)\n\t\}}", table, re.DOTALL)
    if chain is None:
        return frozenset()
    return frozenset(f"{m[1] or m[3]}:{m[2] or m[4]}" for m in _ENDPOINT.finditer(chain.group(1)))


def _etcd_healthy(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
        return bool(json.loads(response.read()).get("health") == "true")


if __name__ == "__main__":  # `python -m e2e.controlplane up|down|status` (see e2e/handrun.py)
    from e2e.handrun import run

    run()
