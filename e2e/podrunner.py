# mypy: disable-error-code="arg-type,union-attr"
# (the kubernetes client takes plain dicts for bodies and types every model field as Optional.)
"""A process runner standing in for kubelet + container runtime on the e2e control plane's GPU nodes.

There is no container runtime on the test machines, so this runs each bound pod's containers as
local processes, as a kubelet would, and reports their status through the real API server. Images
are not pulled or used: a container's ``command`` (required, there is no image ENTRYPOINT) runs from
this checkout's virtual environment (``PATH`` starts with it). Everything else a pod of ours uses is
honoured, and anything else fails loudly (an Event and a waiting reason that name it):

* ``command``/``args`` with ``$(VAR)`` expansion (``$$`` escapes); ``env`` values and ``valueFrom``
  (``fieldRef`` metadata.name/namespace/uid/labels/annotations, spec.nodeName,
  spec.serviceAccountName, status.podIP/hostIP; ``configMapKeyRef``/``secretKeyRef`` with
  ``optional``), ``envFrom``; ``KUBERNETES_SERVICE_HOST/PORT`` as a kubelet sets them.
* Volumes at their mount paths (a mount namespace per pod, :mod:`e2e.podexec`): ``configMap`` and
  ``secret`` (files under a ``..data`` link swapped atomically when the object changes, as the
  kubelet does), ``emptyDir``, ``hostPath``, ``downwardAPI`` and ``projected`` (with real bound
  ServiceAccount tokens from the TokenRequest API, refreshed before they expire, so the pod's
  processes talk to the API server as the pod's ServiceAccount and missing RBAC fails).
* A network namespace per pod with its own IP on the test bridge (:mod:`e2e.podnet`), its hostname,
  and DNS through CoreDNS; ``hostNetwork`` and ``hostIPC`` are refused.
* ``securityContext``: runAsUser/runAsGroup/fsGroup (volumes are group-readable by fsGroup),
  readOnlyRootFilesystem, allowPrivilegeEscalation=false (no_new_privs). Capabilities are dropped by
  not being root; seccomp profiles are not applied.
* HTTP/TCP readiness and liveness probes drive the pod's conditions; a failing liveness probe
  restarts the container; ``restartPolicy`` with a (shortened) back-off. Before that restart the
  runner sends the process SIGUSR1 (EaaS processes write every thread's stack to standard error on
  it), so the log keeps where a hung process was stuck; the kubelet does not do this.
* What it reports stays true: a node the node lifecycle controller marked Unknown (its Lease looked
  too old, e.g. across an API server outage) has its status posted again, and pod conditions
  somebody else overwrote (that controller marks such a node's pods not Ready) are patched back.
* Deletion: SIGTERM to the container's process group, SIGKILL after the grace period, then the final
  delete with a UID precondition. Container output goes to ``<work>/pods/<ns>_<pod>_<uid>/<c>.log``.
* The kubelet's log endpoint (:mod:`e2e.kubeletlogs`): one HTTPS listener per node on the gateway,
  its port in the node's ``status.daemonEndpoints``, so ``kubectl logs`` works through the API server.

One runner serves several Nodes (they share this machine; the scheduler still places pods by each
node's capacity). Run it as ``python -m e2e.podrunner CONFIG.json`` (see :class:`RunnerConfig`);
:class:`e2e.controlplane.ControlPlane` does when asked for process nodes.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime as dt
import http.client
import ipaddress
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from e2e import kubeletlogs
from e2e.podnet import PodAddress, PodNetwork

log = logging.getLogger("podrunner")

PODEXEC = Path(__file__).resolve().parent / "podexec.py"
GPU_RESOURCE = "nvidia.com/gpu"
LEASE_SECONDS = 40
RENEW_SECONDS = 10
LOOP_SECONDS = 0.2
MAX_BACKOFF_SECONDS = 10.0
STACK_DUMP_PAUSE_S = 0.5  # after SIGUSR1 to a container that failed its liveness probe
CLUSTER_DOMAIN = "cluster.local"
KUBELET_VERSION = "v1.37.1-eaas-podrunner"


class Unsupported(Exception):
    """A pod asks for something this runner does not do: the pod is not started, and says why."""


class NotYet(Exception):
    """Something a pod needs does not exist yet (a ConfigMap, a Secret): retried, as a kubelet does."""


@dataclass
class RunnerConfig:
    kubeconfig: str
    nodes: list[str]
    gpus_per_node: int
    work_dir: str
    network_name: str
    bridge: str
    subnet: str
    gateway: str
    api_service_host: str  # KUBERNETES_SERVICE_HOST in every pod
    api_service_port: int
    path: str  # PATH of the containers (the virtual environment first)
    # What stands in for the image: this checkout and its interpreter. A volume mounted over one
    # of them (an emptyDir at /tmp, with the checkout under /tmp) must not hide it from the pod.
    image_paths: list[str] = field(default_factory=list)
    cpu: str = "64"
    memory: str = "512Gi"
    # The nodes' log endpoints (none without a certificate): mutual TLS with the plane's CA, and
    # the one client certificate CN they accept (the API server's kubelet client).
    kubelet_ca: str = ""
    kubelet_cert: str = ""
    kubelet_key: str = ""
    kubelet_client: str = ""
    # ConfigMap and Secret volumes show a change of their object this many seconds after it was made
    # (a kubelet takes its sync period plus its cache's TTL: a minute or more); 0: at once. A pod's
    # first projection, when it starts, is the object as it is then (as a kubelet's).
    volume_delay_s: float = 0.0

    @classmethod
    def load(cls, path: str) -> RunnerConfig:
        return cls(**json.loads(Path(path).read_text()))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.__dict__, indent=2))


def _newer(version: str, than: str) -> bool:
    """Is resourceVersion `version` later than `than`? (etcd revisions here; unequal when not numbers)"""
    if version.isdigit() and than.isdigit():
        return int(version) > int(than)
    return version != than and bool(version)


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# -- env and command expansion (the kubelet's rules) ------------------------------------------------
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: a defined variable is replaced, ``$$`` is ``$``, an unknown
    reference is left as written."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(replace, text)


def field_value(pod: dict[str, Any], path: str, pod_ip: str, host_ip: str) -> str:
    meta = pod["metadata"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if found:
        return str((meta.get(found.group(1)) or {}).get(found.group(2), ""))
    raise Unsupported(f"fieldRef {path!r} is not supported")


# -- the runner -----------------------------------------------------------------------------------
class Runner:
    def __init__(self, settings: RunnerConfig) -> None:
        self.settings = settings
        self.api = config.new_client_from_config(config_file=settings.kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.coordination = client.CoordinationV1Api(self.api)
        self.events = client.EventsV1Api(self.api)
        self.work_dir = Path(settings.work_dir)
        self.network = PodNetwork(settings.network_name, "0.0.0.0/32")
        self.network.bridge = settings.bridge
        self.network.gateway = settings.gateway
        self.network.subnet = ipaddress.ip_network(settings.subnet)
        self.workers: dict[str, PodWorker] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.node_uids: dict[str, str] = {}
        # ConfigMaps and Secrets by (kind, namespace, name), kept by watches; volumes read it.
        self.cache: dict[tuple[str, str, str], dict[str, Any]] = {}
        # With a volume delay: each object's states as the watches saw them, (when, object or None)
        self.history: dict[tuple[str, str, str], list[tuple[float, dict[str, Any] | None]]] = {}
        self.log_servers: dict[str, kubeletlogs.NodeLogServer] = {}  # by node

    # nodes ------------------------------------------------------------------------------------------
    def node_manifest(self, name: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "nvidia.com/gpu.present": "true",
                    "eaas.io/process-node": "true",
                },
            },
            "spec": {},
        }

    def node_status(self, name: str = "") -> dict[str, Any]:
        resources = {
            "cpu": self.settings.cpu,
            "memory": self.settings.memory,
            "pods": "110",
            GPU_RESOURCE: str(self.settings.gpus_per_node),
        }
        stamp = now()
        conditions = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "the e2e process runner runs this node's pods",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
        ] + [
            {
                "type": kind,
                "status": "False",
                "reason": f"KubeletHasNo{kind}",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
            for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        served = self.log_servers.get(name)
        endpoints = {"daemonEndpoints": {"kubeletEndpoint": {"Port": served.port}}} if served else {}
        return {
            "status": {
                **endpoints,
                "capacity": resources,
                "allocatable": resources,
                "conditions": conditions,
                "addresses": [
                    {"type": "InternalIP", "address": self.settings.gateway},
                ],
                "nodeInfo": {
                    "kubeletVersion": KUBELET_VERSION,
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                    "containerRuntimeVersion": "process://e2e",
                    "osImage": "e2e process runner",
                    "kernelVersion": os.uname().release,
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                },
            }
        }

    def register_nodes(self) -> None:
        for name in self.settings.nodes:
            try:
                node = self.core.create_node(self.node_manifest(name))
            except ApiException as error:
                if error.status != 409:
                    raise
                node = self.core.read_node(name)
            self.node_uids[name] = str(node.metadata.uid)
            self.core.patch_node_status(name, self.node_status(name))

    def renew_leases(self) -> None:
        while not self.stopping.wait(RENEW_SECONDS if self.node_uids else 0):
            for name in self.settings.nodes:
                try:
                    self._renew(name)
                    self._reassert_ready(name)
                except Exception as error:  # the API server may be down (a drill): try again later
                    log.warning("node lease %s: %s", name, error)

    def _reassert_ready(self, name: str) -> None:
        """Post the node's status again when the API says it is not Ready, as a kubelet does when its
        status differs from the server's: after the node lifecycle controller marked it Unknown (its
        Lease looked older than the grace period, e.g. while the API server was down) only the
        node's own agent sets it Ready again; the controller then lifts its taints."""
        node = self.core.read_node_status(name)
        ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
        if ready is None or ready.status != "True":
            log.warning(
                "node %s: Ready was %s (%s): posting its status again",
                name,
                ready and ready.status,
                ready and ready.reason,
            )
            self.core.patch_node_status(name, self.node_status(name))

    def _renew(self, name: str) -> None:
        body = {
            "metadata": {
                "name": name,
                "namespace": "kube-node-lease",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": name, "uid": self.node_uids.get(name, "")}
                ],
            },
            "spec": {
                "holderIdentity": name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now_micro(),
            },
        }
        try:
            self.coordination.patch_namespaced_lease(name, "kube-node-lease", body)
        except ApiException as error:
            if error.status != 404:
                raise
            self.coordination.create_namespaced_lease("kube-node-lease", body)

    def serve_logs(self) -> None:
        """The nodes' kubelet log endpoints (before the nodes are registered: they name the ports)."""
        settings = self.settings
        if not settings.kubelet_cert:
            return
        tls = kubeletlogs.tls_context(settings.kubelet_ca, settings.kubelet_cert, settings.kubelet_key)
        self.log_servers = kubeletlogs.serve(
            settings.nodes, settings.gateway, self.pod_on_node, tls, settings.kubelet_client, self.stopping
        )

    def pod_on_node(self, node: str, namespace: str, name: str) -> PodWorker | None:
        """The pod `namespace/name` this runner runs on `node` (the newest one of that name)."""
        with self.lock:
            workers = [
                w
                for w in self.workers.values()
                if w.namespace == namespace and w.name_ == name and w.pod["spec"].get("nodeName") == node
            ]
        workers.sort(key=lambda w: bool(w.pod["metadata"].get("deletionTimestamp")))
        return workers[0] if workers else None

    # pods --------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.serve_logs()
        self.register_nodes()
        threading.Thread(target=self.renew_leases, name="node-leases", daemon=True).start()
        threading.Thread(target=self.watch_objects, name="objects", daemon=True).start()
        self.watch_pods()

    def watch_pods(self) -> None:
        resource_version = ""
        while not self.stopping.is_set():
            try:
                if not resource_version:
                    listed = self.api.sanitize_for_serialization(self.core.list_pod_for_all_namespaces())
                    for pod in listed["items"]:
                        self.on_pod("ADDED", pod)
                    self.reconcile_gone({p["metadata"]["uid"] for p in listed["items"]})
                    resource_version = listed["metadata"]["resourceVersion"]
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    resource_version=resource_version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                    _preload_content=False,
                )
                for event in stream:
                    pod = event["raw_object"]
                    resource_version = pod["metadata"].get("resourceVersion", resource_version)
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.on_pod(event["type"], pod)
            except ApiException as error:
                if error.status == 410:
                    resource_version = ""
                    continue
                log.warning("pod watch: %s", error)
                self.stopping.wait(1)
            except Exception as error:  # connection lost (API server stopped in a drill)
                log.warning("pod watch: %s", error)
                self.stopping.wait(1)

    def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        if pod["spec"].get("nodeName") not in self.settings.nodes:
            return
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if worker is None:
                if kind == "DELETED" or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    return
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
                worker.start()
            else:
                worker.update(pod, deleted=kind == "DELETED")

    def reconcile_gone(self, uids: set[str]) -> None:
        with self.lock:
            for uid, worker in self.workers.items():
                if uid not in uids:
                    worker.update(worker.pod, deleted=True)

    def forget(self, uid: str) -> None:
        with self.lock:
            self.workers.pop(uid, None)

    # ConfigMaps and Secrets: a cache the workers read (volumes are refreshed from it) -------------
    def watch_objects(self) -> None:
        kinds: dict[str, Any] = {
            "ConfigMap": self.core.list_config_map_for_all_namespaces,
            "Secret": self.core.list_secret_for_all_namespaces,
        }
        for kind, lister in kinds.items():
            threading.Thread(target=self._watch_kind, args=(kind, lister), daemon=True).start()

    def _watch_kind(self, kind: str, lister: Any) -> None:
        resource_version = ""
        while not self.stopping.is_set():
            try:
                if not resource_version:
                    listed = self.api.sanitize_for_serialization(lister())
                    seen = set()
                    for obj in listed["items"]:
                        key = (kind, obj["metadata"]["namespace"], obj["metadata"]["name"])
                        self._cache(key, obj)
                        seen.add(key)
                    for key in [k for k in self.cache if k[0] == kind and k not in seen]:
                        self._cache(key, None)
                    resource_version = listed["metadata"]["resourceVersion"]
                stream = watch.Watch().stream(
                    lister, resource_version=resource_version, timeout_seconds=60, _preload_content=False
                )
                for event in stream:
                    obj = event["raw_object"]
                    resource_version = obj["metadata"].get("resourceVersion", resource_version)
                    key = (kind, obj["metadata"].get("namespace", ""), obj["metadata"].get("name", ""))
                    if event["type"] == "DELETED":
                        self._cache(key, None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self._cache(key, obj)
            except ApiException as error:
                if error.status == 410:
                    resource_version = ""
                    continue
                self.stopping.wait(1)
            except Exception:
                self.stopping.wait(1)

    def _cache(self, key: tuple[str, str, str], obj: dict[str, Any] | None) -> None:
        if obj is None:
            self.cache.pop(key, None)
        else:
            self.cache[key] = obj
        delay = self.settings.volume_delay_s
        if delay > 0:
            moment = time.monotonic()
            states = [*self.history.get(key, []), (moment, obj)]
            # drop what no delayed look can return any more: all but the newest state older than delay
            while len(states) > 1 and states[1][0] <= moment - delay:
                states.pop(0)
            self.history[key] = states

    def delayed(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as it was ``volume_delay_s`` ago (None: absent then, or not seen that long ago)."""
        cutoff = time.monotonic() - self.settings.volume_delay_s
        older = [obj for moment, obj in self.history.get((kind, namespace, name), []) if moment <= cutoff]
        return older[-1] if older else None

    def lookup(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.cache.get((kind, namespace, name))
        if obj is not None:
            return obj
        try:  # not in the cache yet (the watch is behind): ask
            found: Any = (
                self.core.read_namespaced_config_map(name, namespace)
                if kind == "ConfigMap"
                else self.core.read_namespaced_secret(name, namespace)
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        result: dict[str, Any] = self.api.sanitize_for_serialization(found)
        return result

    def event(self, pod: dict[str, Any], kind: str, reason: str, note: str) -> None:
        meta = pod["metadata"]
        body = {
            "metadata": {"generateName": f"{meta['name']}-", "namespace": meta["namespace"]},
            "eventTime": now_micro().strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": "eaas.io/e2e-podrunner",
            "reportingInstance": pod["spec"].get("nodeName", "podrunner"),
            "action": reason,
            "reason": reason,
            "type": kind,
            "note": note[:1000],
            "regarding": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
        }
        try:
            self.events.create_namespaced_event(meta["namespace"], body)
        except Exception as error:
            log.warning("event %s/%s %s: %s", meta["namespace"], meta["name"], reason, error)

    def shutdown(self) -> None:
        """Stop every pod's processes (the machine is going away; the API objects stay)."""
        self.stopping.set()
        kubeletlogs.close(self.log_servers)
        with self.lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.stop_now()
        for worker in workers:
            worker.join(timeout=15)


# -- one pod ------------------------------------------------------------------------------------------
@dataclass
class Probe:
    spec: dict[str, Any]
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0
    ok: bool | None = None  # None: no verdict yet


@dataclass
class Container:
    spec: dict[str, Any]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    started_mono: float = 0.0
    restarts: int = 0
    ready: bool = False
    last_terminated: dict[str, Any] | None = None
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    backoff_until: float = 0.0
    readiness: Probe | None = None
    liveness: Probe | None = None
    startup: Probe | None = None  # until it succeeds, the other two wait (the kubelet's rule)
    done: bool = False  # exited and will not be restarted
    exit_code: int | None = None
    # Per run, oldest first: where in the log its start line is, and where its output begins.
    runs: list[tuple[int, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.spec["name"])


class PodWorker(threading.Thread):
    def __init__(self, runner: Runner, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner = runner
        self.pod = pod
        self.uid = meta["uid"]
        self.dir = runner.work_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{self.uid[:8]}"
        self.changed = threading.Event()
        self.deleted = False  # gone from the API (force delete)
        self.kill_now = False
        self.address: PodAddress | None = None
        self.containers: list[Container] = []
        self.volume_versions: dict[str, str] = {}
        self.token_refresh_at: dict[str, float] = {}
        self.start_time = now()
        self.last_status: dict[str, Any] | None = None
        self.patched_version = -1  # the resourceVersion our last status patch produced
        self.problem: tuple[str, str] | None = None  # (reason, message) keeping the pod from starting

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def name_(self) -> str:
        return str(self.pod["metadata"]["name"])

    def update(self, pod: dict[str, Any], deleted: bool = False) -> None:
        self.pod = pod
        self.deleted = self.deleted or deleted
        self.changed.set()

    def stop_now(self) -> None:
        self.kill_now = True
        self.changed.set()

    # main loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception as error:
            log.exception("pod %s/%s: %s", self.namespace, self.name_, error)
        finally:
            self.runner.forget(self.uid)

    def _terminating(self) -> bool:
        return bool(self.deleted or self.kill_now or self.pod["metadata"].get("deletionTimestamp"))

    def _run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.containers = [
            Container(spec, self.dir / f"{spec['name']}.log") for spec in self.pod["spec"]["containers"]
        ]
        while not self._terminating():
            try:
                self._prepare()
                break
            except Unsupported as error:
                self._fail_to_start("Unsupported", str(error))
            except NotYet as error:
                self._fail_to_start("CreateContainerConfigError", str(error))
            except Exception as error:
                self._fail_to_start("RunnerError", f"{type(error).__name__}: {error}")
            self.changed.wait(1.0)
            self.changed.clear()
        while not self._terminating():
            self._tick()
            self.changed.wait(LOOP_SECONDS)
            self.changed.clear()
        self._terminate()

    def _fail_to_start(self, reason: str, message: str) -> None:
        if self.problem != (reason, message):
            self.problem = (reason, message)
            log.warning("pod %s/%s: %s: %s", self.namespace, self.name_, reason, message)
            self.runner.event(self.pod, "Warning", "Failed", f"{reason}: {message}")
            for container in self.containers:
                container.waiting = (reason, message)
            self._sync_status()

    # preparation --------------------------------------------------------------------------------
    def _prepare(self) -> None:
        spec = self.pod["spec"]
        for refused in ("hostNetwork", "hostPID"):
            if spec.get(refused):
                raise Unsupported(f"{refused}: pods run in their own namespaces here")
        if spec.get("initContainers"):
            raise Unsupported("initContainers are not supported by the e2e process runner")
        for container in spec["containers"]:
            if not container.get("command"):
                raise Unsupported(
                    f"container {container['name']!r} has no command (there is no image entrypoint here)"
                )
        self._resolve_env_all()  # fails before any network or process exists
        self._write_volumes(initial=True)
        if self.address is None:
            hostname = spec.get("hostname") or self.name_
            subdomain = spec.get("subdomain")
            fqdn = f"{hostname}.{subdomain}.{self.namespace}.svc.{CLUSTER_DOMAIN}" if subdomain else hostname
            search = [f"{self.namespace}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN]
            self.address = self.runner.network.attach(self.uid[:8], hostname, fqdn, search)
        self.problem = None
        for container in self.containers:
            self._start(container)
        self._sync_status()

    def _resolve_env_all(self) -> None:
        self.envs = {c["name"]: self._container_env(c) for c in self.pod["spec"]["containers"]}

    def _container_env(self, container: dict[str, Any]) -> dict[str, str]:
        settings = self.runner.settings
        env: dict[str, str] = {
            "PATH": settings.path,
            "HOSTNAME": self.pod["spec"].get("hostname") or self.name_,
            "KUBERNETES_SERVICE_HOST": settings.api_service_host,
            "KUBERNETES_SERVICE_PORT": str(settings.api_service_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(settings.api_service_port),
            "KUBERNETES_PORT": f"tcp://{settings.api_service_host}:{settings.api_service_port}",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        pod_ip = self.address.ip if self.address else "0.0.0.0"
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            for kind, ref_key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                ref = source.get(ref_key)
                if ref is None:
                    continue
                obj = self.runner.lookup(kind, self.namespace, ref["name"])
                if obj is None:
                    if ref.get("optional"):
                        continue
                    raise NotYet(f"{kind.lower()} {ref['name']!r} not found")
                for key, value in _data(kind, obj).items():
                    env[prefix + key] = value.decode(errors="replace")
        for item in container.get("env") or []:
            name = item["name"]
            if "value" in item or "valueFrom" not in item:
                env[name] = expand(item.get("value", ""), env)
                continue
            source = item["valueFrom"]
            if "fieldRef" in source:
                env[name] = field_value(self.pod, source["fieldRef"]["fieldPath"], pod_ip, settings.gateway)
            elif "configMapKeyRef" in source or "secretKeyRef" in source:
                kind = "ConfigMap" if "configMapKeyRef" in source else "Secret"
                ref = source.get("configMapKeyRef") or source["secretKeyRef"]
                obj = self.runner.lookup(kind, self.namespace, ref["name"])
                data = _data(kind, obj) if obj is not None else None
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    what = f"{kind.lower()} {ref['name']!r}" + (
                        "" if data is None else f" key {ref['key']!r}"
                    )
                    raise NotYet(f"env {name}: {what} not found")
                env[name] = data[ref["key"]].decode(errors="replace")
            elif "resourceFieldRef" in source:
                allocatable = {"cpu": settings.cpu, "memory": settings.memory}
                env[name] = _resource_value(container, source["resourceFieldRef"], allocatable)
            else:
                raise Unsupported(f"env {name}: valueFrom {sorted(source)} is not supported")
        return env

    # volumes ------------------------------------------------------------------------------------
    def _volume_dir(self, name: str) -> Path:
        return self.dir / "volumes" / name

    def _fs_group(self) -> int | None:
        value = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        return int(value) if value is not None else None

    def _write_volumes(self, initial: bool) -> None:
        for volume in self.pod["spec"].get("volumes") or []:
            name = volume["name"]
            target = self._volume_dir(name)
            if "emptyDir" in volume:
                if initial:
                    target.mkdir(parents=True, exist_ok=True)
                    target.chmod(0o1777)
            elif "hostPath" in volume:
                path = Path(volume["hostPath"]["path"])
                kind = volume["hostPath"].get("type", "")
                if kind == "Directory" and not path.is_dir():
                    raise NotYet(f"volume {name}: hostPath {path} is not a directory")
                if kind == "DirectoryOrCreate":
                    path.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    raise NotYet(f"volume {name}: hostPath {path} does not exist")
            elif "configMap" in volume or "secret" in volume:
                files, version = self._object_files(volume, initial)
                if files is not None:
                    self._publish(name, files, version)
            elif "projected" in volume or "downwardAPI" in volume:
                files, version = self._projected_files(volume)
                self._publish(name, files, version)
            else:
                kind = next((key for key in volume if key != "name"), "?")
                raise Unsupported(
                    f"volume {name}: {kind} volumes are not supported by the e2e process runner"
                )

    def _object_files(
        self, volume: dict[str, Any], initial: bool
    ) -> tuple[dict[str, tuple[bytes, int]] | None, str]:
        kind = "ConfigMap" if "configMap" in volume else "Secret"
        source = volume.get("configMap") or volume["secret"]
        object_name = source.get("name") or source.get("secretName")
        written = self.volume_versions.get(volume["name"])
        if not initial and written is not None and self.runner.settings.volume_delay_s > 0:
            obj = self.runner.delayed(kind, self.namespace, object_name)
            version = str(((obj or {}).get("metadata") or {}).get("resourceVersion", ""))
            if obj is None or not _newer(version, written):  # gone, unseen or older: kept, as a kubelet does
                return None, written
        else:
            obj = self.runner.lookup(kind, self.namespace, object_name)
        if obj is None:
            if source.get("optional"):
                return {}, "absent"
            raise NotYet(f"volume {volume['name']}: {kind.lower()} {object_name!r} not found")
        version = str(obj["metadata"].get("resourceVersion", ""))
        if self.volume_versions.get(volume["name"]) == version:
            return None, version  # unchanged since it was written: nothing to decode
        mode = int(source.get("defaultMode", 0o644))
        files = _items(_data(kind, obj), source.get("items"), mode, f"volume {volume['name']}")
        return files, version

    def _projected_files(self, volume: dict[str, Any]) -> tuple[dict[str, tuple[bytes, int]], str]:
        if "downwardAPI" in volume:
            sources = [{"downwardAPI": volume["downwardAPI"]}]
            mode = int(volume["downwardAPI"].get("defaultMode", 0o644))
        else:
            sources = volume["projected"].get("sources") or []
            mode = int(volume["projected"].get("defaultMode", 0o644))
        files: dict[str, tuple[bytes, int]] = {}
        versions = []
        for source in sources:
            if "serviceAccountToken" in source:
                token_spec = source["serviceAccountToken"]
                token, version = self._token(volume["name"], token_spec)
                files[token_spec["path"]] = (token.encode(), mode)
                versions.append(version)
            elif "configMap" in source or "secret" in source:
                kind = "ConfigMap" if "configMap" in source else "Secret"
                ref = source.get("configMap") or source["secret"]
                obj = self.runner.lookup(kind, self.namespace, ref["name"])
                if obj is None:
                    if ref.get("optional"):
                        continue
                    raise NotYet(f"volume {volume['name']}: {kind.lower()} {ref['name']!r} not found")
                files |= _items(_data(kind, obj), ref.get("items"), mode, f"volume {volume['name']}")
                versions.append(str(obj["metadata"].get("resourceVersion")))
            elif "downwardAPI" in source:
                for item in source["downwardAPI"].get("items") or []:
                    if "fieldRef" not in item:
                        raise Unsupported(f"volume {volume['name']}: downwardAPI {item} is not supported")
                    pod_ip = self.address.ip if self.address else ""
                    value = field_value(self.pod, item["fieldRef"]["fieldPath"], pod_ip, "")
                    files[item["path"]] = (value.encode(), int(item.get("mode", mode)))
                versions.append(str(self.pod["metadata"].get("resourceVersion")))
            else:
                raise Unsupported(
                    f"volume {volume['name']}: projected source {sorted(source)} is not supported"
                )
        return files, "/".join(versions)

    def _token(self, volume: str, spec: dict[str, Any]) -> tuple[str, str]:
        """A bound token for the pod's ServiceAccount (TokenRequest), kept until 80% of its life."""
        key = f"{volume}/{spec['path']}"
        cached = getattr(self, "_tokens", {}).get(key)
        if cached is not None and time.monotonic() < self.token_refresh_at[key]:
            return cached
        seconds = int(spec.get("expirationSeconds", 3607))
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [spec["audience"]] if spec.get("audience") else None,
                "expirationSeconds": seconds,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name_, "uid": self.uid},
            },
        }
        account = self.pod["spec"].get("serviceAccountName") or "default"
        answer = self.runner.core.create_namespaced_service_account_token(account, self.namespace, body)
        token = (str(answer.status.token), str(answer.status.expiration_timestamp))
        self._tokens = getattr(self, "_tokens", {}) | {key: token}
        self.token_refresh_at[key] = time.monotonic() + 0.8 * seconds
        return token

    def _publish(self, name: str, files: dict[str, tuple[bytes, int]], version: str) -> None:
        """Write `files` the way the kubelet's atomic writer does: a fresh ``..<stamp>`` directory,
        then the ``..data`` link swapped to it with one rename, then links from each name."""
        if self.volume_versions.get(name) == version:
            return
        target = self._volume_dir(name)
        target.mkdir(parents=True, exist_ok=True)
        group = self._fs_group()
        stamp = f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
        fresh = target / stamp
        fresh.mkdir()
        for relative, (content, mode) in files.items():
            path = fresh / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            if group is not None:
                os.chown(path, -1, group)
                mode |= 0o040 if mode & 0o400 else 0
            path.chmod(mode)
        if group is not None:
            os.chown(fresh, -1, group)
        fresh.chmod(0o755)
        link = target / "..data_tmp"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(stamp)
        old = os.readlink(target / "..data") if (target / "..data").is_symlink() else None
        os.replace(link, target / "..data")
        for top in {relative.split("/")[0] for relative in files}:
            entry = target / top
            if not entry.is_symlink():
                entry.symlink_to(f"..data/{top}")
        for entry in target.iterdir():  # names that left the object
            if entry.is_symlink() and not entry.name.startswith("..") and not entry.exists():
                entry.unlink()
        if old:
            shutil.rmtree(target / old, ignore_errors=True)
        self.volume_versions[name] = version

    def _mounts(self, container: dict[str, Any]) -> list[dict[str, Any]]:
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        mounts = []
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise Unsupported(f"volumeMount {mount['name']!r} names no volume of the pod")
            source = (
                Path(volume["hostPath"]["path"]) if "hostPath" in volume else self._volume_dir(mount["name"])
            )
            if mount.get("subPath"):
                source = source / mount["subPath"]
            mounts.append(
                {"source": str(source), "target": mount["mountPath"], "readOnly": bool(mount.get("readOnly"))}
            )
        targets = [Path(m["target"]) for m in mounts]
        for image_path in map(Path, self.runner.settings.image_paths):
            if any(image_path.is_relative_to(target) for target in targets):
                # Mounted after the volume above it (podexec mounts parents first): visible again.
                mounts.append({"source": str(image_path), "target": str(image_path), "readOnly": True})
        return mounts

    # processes ----------------------------------------------------------------------------------
    def _start(self, container: Container) -> None:
        assert self.address is not None
        spec = container.spec
        self._resolve_env_all()  # the pod IP is known now
        env = self.envs[container.name]
        argv = [expand(arg, env) for arg in [*spec["command"], *(spec.get("args") or [])]]
        pod_security = self.pod["spec"].get("securityContext") or {}
        security = spec.get("securityContext") or {}
        uid = security.get("runAsUser", pod_security.get("runAsUser"))
        gid = security.get("runAsGroup", pod_security.get("runAsGroup"))
        groups = [int(g) for g in pod_security.get("supplementalGroups") or []]
        if pod_security.get("fsGroup") is not None:
            groups.append(int(pod_security["fsGroup"]))
        if uid is not None and not _reachable_by_others(Path(sys.base_prefix)):
            # The image's user is not root, but this machine's interpreter may live where only root
            # can read it (a ~root install): then the container runs as root, and says so.
            self.runner.event(
                self.pod,
                "Warning",
                "RunAsUserIgnored",
                f"container {container.name}: runAsUser {uid} cannot read the interpreter at "
                f"{sys.base_prefix}; running as root (volumes, read-only root and no_new_privs still apply)",
            )
            uid = gid = None
        if security.get("privileged"):
            raise Unsupported(f"container {container.name}: privileged containers are not supported")
        launch = {
            "hostname": self.pod["spec"].get("hostname") or self.name_,
            "mounts": self._mounts(spec),
            "readOnlyRoot": bool(security.get("readOnlyRootFilesystem")),
            "uid": uid,
            "gid": gid,
            "groups": groups,
            "noNewPrivs": security.get("allowPrivilegeEscalation") is False,
            "workingDir": spec.get("workingDir", ""),
            "argv": argv,
            "env": env,
        }
        spec_path = self.dir / f"{container.name}.launch.json"
        spec_path.write_text(json.dumps(launch))
        spec_path.chmod(0o600)
        with open(container.log_path, "ab") as log_file:
            marker_at = log_file.tell()
            log_file.write(f"--- {now()} start #{container.restarts}: {' '.join(argv)}\n".encode())
            log_file.flush()
            container.runs.append((marker_at, log_file.tell()))
            container.process = subprocess.Popen(
                ["ip", "netns", "exec", self.address.namespace, "unshare", "--uts", "--",
                 sys.executable, "-I", str(PODEXEC), str(spec_path)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        container.started_at = now()
        container.started_mono = time.monotonic()
        container.waiting = None
        container.ready = False
        container.readiness = Probe(spec["readinessProbe"]) if spec.get("readinessProbe") else None
        container.liveness = Probe(spec["livenessProbe"]) if spec.get("livenessProbe") else None
        container.startup = Probe(spec["startupProbe"]) if spec.get("startupProbe") else None
        for probe in (container.readiness, container.liveness, container.startup):
            if probe is not None:
                probe.next_at = container.started_mono + float(probe.spec.get("initialDelaySeconds", 0))
        if container.readiness is None:
            container.ready = True

    @staticmethod
    def _dump_stacks(container: Container) -> None:
        """SIGUSR1 to a container whose liveness failed, so its log keeps the stacks of the hang
        (faulthandler writes them without the GIL; the pause lets the dump reach the log)."""
        process = container.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGUSR1)
            time.sleep(STACK_DUMP_PAUSE_S)

    def _stop_container(self, container: Container, grace: float) -> None:
        process = container.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=max(grace, 0.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        # Whatever the container forked stays in its group: end it too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def _tick(self) -> None:
        restart_policy = self.pod["spec"].get("restartPolicy", "Always")
        for container in self.containers:
            process = container.process
            if process is not None and process.poll() is not None:
                code = process.returncode
                code = 128 - code if code < 0 else code  # killed by a signal: 128 + signo
                container.last_terminated = {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": container.started_at,
                    "finishedAt": now(),
                    "containerID": f"proc://{process.pid}",
                }
                container.process = None
                container.ready = False
                container.exit_code = code
                if restart_policy == "Always" or (restart_policy == "OnFailure" and code != 0):
                    delay = min(MAX_BACKOFF_SECONDS, 0.5 * 2 ** min(container.restarts, 5))
                    if time.monotonic() - container.started_mono > 60:
                        delay = 0.5
                    container.backoff_until = time.monotonic() + delay
                    container.waiting = (
                        "CrashLoopBackOff",
                        f"back-off {delay:.1f}s restarting failed container",
                    )
                    self.runner.event(
                        self.pod, "Warning", "BackOff", f"container {container.name} exited with {code}"
                    )
                else:
                    container.done = True
            if (
                container.process is None
                and not container.done
                and time.monotonic() >= container.backoff_until
            ):
                container.restarts += 1
                try:
                    self._start(container)
                except (Unsupported, NotYet) as error:
                    container.waiting = ("CreateContainerConfigError", str(error))
                    container.backoff_until = time.monotonic() + 1
            if container.process is not None:
                self._probe(container)
        try:
            self._write_volumes(initial=False)
        except (NotYet, ApiException, OSError) as error:
            log.warning("pod %s/%s: volume refresh: %s", self.namespace, self.name_, error)
        self._sync_status()

    def _probe(self, container: Container) -> None:
        moment = time.monotonic()
        startup = container.startup
        probes: list[tuple[Probe | None, str]]
        if startup is not None and not startup.ok:
            probes = [(startup, "Startup")]
        else:
            probes = [(container.liveness, "Liveness"), (container.readiness, "Readiness")]
        for probe, kind in probes:
            if probe is None or moment < probe.next_at:
                continue
            period = float(probe.spec.get("periodSeconds", 10))
            probe.next_at = moment + period
            ok, detail = self._probe_once(container, probe.spec)
            if ok:
                probe.successes += 1
                probe.failures = 0
                if probe.successes >= int(probe.spec.get("successThreshold", 1)):
                    probe.ok = True
            else:
                probe.failures += 1
                probe.successes = 0
                if probe.failures >= int(probe.spec.get("failureThreshold", 3)):
                    probe.ok = False
            if kind == "Readiness":
                container.ready = bool(probe.ok)
            elif kind == "Startup" and probe.ok:  # the others start now, each after its own delay
                for other in (container.liveness, container.readiness):
                    if other is not None:
                        other.next_at = moment + float(other.spec.get("initialDelaySeconds", 0))
            elif probe.ok is False:
                self.runner.event(
                    self.pod, "Warning", "Unhealthy", f"{kind} probe failed: {detail}; restarting"
                )
                self._dump_stacks(container)
                grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
                self._stop_container(container, grace)
                probe.ok = None
                return  # the exit is seen (and the container restarted) on the next tick

    def _probe_once(self, container: Container, spec: dict[str, Any]) -> tuple[bool, str]:
        assert self.address is not None
        timeout = float(spec.get("timeoutSeconds", 1))
        if "httpGet" in spec:
            get = spec["httpGet"]
            port = _port(container.spec, get["port"])
            connection = http.client.HTTPConnection(get.get("host") or self.address.ip, port, timeout=timeout)
            try:
                connection.request("GET", get.get("path", "/"))
                response = connection.getresponse()
                response.read(65536)  # as the kubelet does (closing unread resets the connection)
                return 200 <= response.status < 400, f"HTTP {response.status}"
            except OSError as error:
                return False, str(error)
            finally:
                connection.close()
        if "tcpSocket" in spec:
            port = _port(container.spec, spec["tcpSocket"]["port"])
            try:
                socket.create_connection((self.address.ip, port), timeout=timeout).close()
                return True, "connected"
            except OSError as error:
                return False, str(error)
        raise Unsupported(f"probe {sorted(spec)} is not supported (httpGet and tcpSocket are)")

    # status -------------------------------------------------------------------------------------
    def _container_status(self, container: Container) -> dict[str, Any]:
        startup = container.startup
        state: dict[str, Any]
        if container.process is not None:
            state = {"running": {"startedAt": container.started_at}}
        elif container.done and container.last_terminated:
            state = {"terminated": container.last_terminated}
        else:
            reason, message = container.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        status: dict[str, Any] = {
            "name": container.name,
            "image": container.spec.get("image", ""),
            "imageID": "",
            "ready": container.ready and container.process is not None,
            "started": container.process is not None and (startup is None or bool(startup.ok)),
            "restartCount": container.restarts,
            "state": state,
        }
        if container.process is not None:
            status["containerID"] = f"proc://{container.process.pid}"
        if container.last_terminated:
            status["lastState"] = {"terminated": container.last_terminated}
        return status

    def _sync_status(self) -> None:
        statuses = [self._container_status(c) for c in self.containers]
        all_ready = bool(statuses) and all(s["ready"] for s in statuses)
        if all(c.done for c in self.containers):
            phase = "Succeeded" if all(c.exit_code == 0 for c in self.containers) else "Failed"
        elif any(c.process is not None for c in self.containers) or any(c.restarts for c in self.containers):
            phase = "Running"
        else:
            phase = "Pending"
        network_ready = self.address is not None

        def condition(kind: str, ok: bool) -> dict[str, Any]:
            return {"type": kind, "status": "True" if ok else "False"}

        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [
                condition("PodReadyToStartContainers", network_ready),
                condition("Initialized", True),
                condition("ContainersReady", all_ready),
                condition("Ready", all_ready),
            ],
            "containerStatuses": statuses,
            "hostIP": self.runner.settings.gateway,
            "hostIPs": [{"ip": self.runner.settings.gateway}],
            "startTime": self.start_time,
        }
        if self.address is not None:
            status["podIP"] = self.address.ip
            status["podIPs"] = [{"ip": self.address.ip}]
        if self.problem is not None:
            status["reason"], status["message"] = self.problem
        if status == self.last_status and not self._overwritten(status):
            return
        previous = {c["type"]: c["status"] for c in (self.last_status or {}).get("conditions", [])}
        stamped = copy.deepcopy(status)
        if self.problem is None:
            # A strategic merge patch keeps the keys it omits: null clears the reason that kept the
            # pod from starting, as a kubelet's status does once the containers run.
            stamped["reason"] = stamped["message"] = None
        for item in stamped["conditions"]:
            if previous.get(item["type"]) != item["status"]:
                item["lastTransitionTime"] = now()
        try:
            patched = self.runner.core.patch_namespaced_pod_status(
                self.name_, self.namespace, {"status": stamped}
            )
            self.last_status = status
            self.patched_version = _version(patched.metadata.resource_version)
        except ApiException as error:
            if error.status == 404:
                self.deleted = True
            else:
                log.warning("pod %s/%s status: %s", self.namespace, self.name_, error)
        except Exception as error:  # API server away: try again next tick
            log.warning("pod %s/%s status: %s", self.namespace, self.name_, error)

    def _overwritten(self, status: dict[str, Any]) -> bool:
        """Whether somebody else changed the conditions this runner reports since its last patch
        (the node lifecycle controller marks a NotReady node's pods not Ready): a kubelet's status
        manager then patches its own view again. Only a pod newer than that patch counts; one the
        watch delivers late does not."""
        observed = self.pod.get("status") or {}
        if _version(self.pod["metadata"].get("resourceVersion")) <= self.patched_version:
            return False
        theirs = {c.get("type"): c.get("status") for c in observed.get("conditions") or []}
        return any(theirs.get(c["type"]) != c["status"] for c in status["conditions"])

    # termination --------------------------------------------------------------------------------
    def _terminate(self) -> None:
        meta = self.pod["metadata"]
        if self.kill_now or self.deleted:
            grace = 0.0 if self.deleted else 2.0
        else:
            grace = float(
                meta.get("deletionGracePeriodSeconds")
                or self.pod["spec"].get("terminationGracePeriodSeconds", 30)
            )
        threads = [
            threading.Thread(target=self._stop_container, args=(c, grace), daemon=True)
            for c in self.containers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.address is not None:
            self.runner.network.detach(self.address)
            self.address = None
        if self.kill_now:
            return  # the runner is shutting down: leave the API objects as they are
        if not self.deleted:
            body = client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
            )
            for _ in range(30):
                try:
                    self.runner.core.delete_namespaced_pod(self.name_, self.namespace, body=body)
                    break
                except ApiException as error:
                    if error.status in (404, 409):
                        break
                    time.sleep(1)
                except Exception:
                    time.sleep(1)


def _version(resource_version: str | None) -> int:
    """A resourceVersion as a number (etcd's revision; opaque to clients in general, but this
    runner only talks to the test control plane's etcd-backed API server), -1 when absent."""
    try:
        return int(resource_version or -1)
    except ValueError:
        return -1


def _data(kind: str, obj: dict[str, Any]) -> dict[str, bytes]:
    if kind == "Secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data |= {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
    return data


def _items(
    data: dict[str, bytes], items: list[dict[str, Any]] | None, mode: int, where: str
) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {key: (value, mode) for key, value in data.items()}
    files = {}
    for item in items:
        if item["key"] not in data:
            raise NotYet(f"{where}: key {item['key']!r} not found")
        files[item["path"]] = (data[item["key"]], int(item.get("mode", mode)))
    return files


def _reachable_by_others(path: Path) -> bool:
    """Whether a user who is neither owner nor in the group can reach and read `path`."""
    for part in [path, *path.parents]:
        try:
            mode = part.stat().st_mode
        except OSError:
            return False
        if not mode & 0o001:
            return False
    return bool(path.stat().st_mode & 0o004)


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for item in container.get("ports") or []:
        if item.get("name") == port:
            return int(item["containerPort"])
    raise Unsupported(f"probe port {port!r} names no port of container {container['name']!r}")


_BINARY = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_SUFFIXES = {
    **{suffix: Fraction(1024) ** power for power, suffix in enumerate(_BINARY)},
    **{"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000)},
    **{suffix: Fraction(1000) ** power for power, suffix in enumerate(("k", "M", "G", "T", "P", "E"), 1)},
}
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))((?:[eE][+-]?\d+)|[a-zA-Z]*)")


def quantity(text: str | int | float) -> Fraction:
    """A Kubernetes resource quantity (``500m``, ``2``, ``1.5Gi``, ``1e3``), exactly; ValueError
    for anything else."""
    match = _QUANTITY.fullmatch(str(text).strip())
    if match is not None and match.group(2) in _SUFFIXES:
        return Fraction(match.group(1)) * _SUFFIXES[match.group(2)]
    if match is not None and re.fullmatch(r"[eE][+-]?\d+", match.group(2)):
        return Fraction(match.group(1)) * Fraction(10) ** int(match.group(2)[1:])
    raise ValueError(f"{text!r} is not a resource quantity")


def _resource_value(container: dict[str, Any], ref: dict[str, Any], allocatable: dict[str, str]) -> str:
    """What kubelet gives a Downward-API ``resourceFieldRef``: the container's request or limit in
    units of the divisor (default 1), rounded up; an unset limit is the node's allocatable, an unset
    request 0. CPU is counted in millicores first (``0.0001`` is 1m), memory and storage in bytes
    (rounded up) first."""
    kind, _, resource = ref["resource"].partition(".")
    if kind not in ("requests", "limits") or resource not in ("cpu", "memory", "ephemeral-storage"):
        raise Unsupported(f"resourceFieldRef {ref['resource']!r} is not supported")
    value = ((container.get("resources") or {}).get(kind) or {}).get(resource)
    if value is None and kind == "limits":
        value = allocatable.get(resource)
    unit = 1000 if resource == "cpu" else 1
    try:
        amount = math.ceil(quantity(value if value is not None else 0) * unit)
        divisor = math.ceil(quantity(ref.get("divisor") or 1) * unit)
    except ValueError as exc:
        raise Unsupported(f"resourceFieldRef {ref['resource']!r}: {exc}") from None
    return str(math.ceil(Fraction(amount, divisor)))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    runner = Runner(RunnerConfig.load(sys.argv[1]))

    def stop(signum: int, frame: Any) -> None:
        runner.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    runner.run()


if __name__ == "__main__":
    main()
