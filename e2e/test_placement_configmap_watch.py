# mypy: disable-error-code="arg-type,union-attr,index,operator,call-overload"
# (the kubernetes client types every model field as Optional; a None here is a test failure anyway.)
"""A pod's watch on its placement ConfigMap against the real API server, with only the Role the
operator makes for it (``<moeservice>-runtime-placement``: get, list, watch on its placement
ConfigMaps by name).

A committed placement must reach every pod in seconds, not at the kubelet's next sync (a minute or
more): the source (:mod:`eaas.runtime.placement.source`) must see each change of the ConfigMap
within 2 s while the mounted files stay behind; survive the ConfigMap's deletion and re-creation;
and, refused by RBAC, log why and follow the files. An expert server started with
``--placement-configmap`` loads a pending placement that only the ConfigMap has, and an attention
client routes by a commit that only the ConfigMap has.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from e2e.cluster import Cluster
from e2e.operator.harness import service_account_kubeconfig
from eaas.operator import naming
from eaas.operator.builders.common import runtime_placement_role, runtime_placement_role_binding
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import preset, write_random_checkpoint
from eaas.runtime.placement import Placement, round_robin, stored
from eaas.runtime.placement.source import ConfigMapWatch, MountedFiles, PlacementSource

SERVICE = "tiny"
POOL = naming.expert_pool_name(SERVICE)
CONFIG_MAP = naming.placement_config_map_name(POOL)
ACCOUNT = naming.runtime_account_name(SERVICE)
PROPAGATION_S = 2.0  # the target: a change is seen by every pod this soon


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float) -> float:
    """Seconds until `condition` held; fails after `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def placement(version: int, servers: int = 2) -> Placement:
    model = preset("mixtral")
    return round_robin(model.moe_layers, model.num_experts, servers, replication=1).with_version(version)


def body(committed: Placement | None, pending: Placement | None) -> dict[str, Any]:
    """The placement ConfigMap as the operator writes it."""
    return {
        "metadata": {"name": CONFIG_MAP},
        "binaryData": stored.config_map_data(committed, pending),
    }


def versions(source: PlacementSource) -> tuple[int | None, int | None]:
    committed, pending = source.read().parse()
    return (
        committed.version if committed is not None else None,
        pending.version if pending is not None else None,
    )


def account(cluster: Cluster, namespace: str, tmp_path: Path, role: bool) -> Path:
    """The pods' ServiceAccount, with the operator's placement Role bound (or none), as a kubeconfig."""
    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": ACCOUNT}})
    if role:
        owner = {
            "metadata": {"name": SERVICE, "namespace": namespace, "uid": "u"},
            "apiVersion": "eaas.io/v1alpha1",
        }
        for made in (runtime_placement_role(owner), runtime_placement_role_binding(owner)):
            made["metadata"].pop("ownerReferences")  # no MoEService here (the collector would delete them)
            create = (
                cluster.rbac.create_namespaced_role
                if made["kind"] == "Role"
                else cluster.rbac.create_namespaced_role_binding
            )
            create(namespace, made)
    return service_account_kubeconfig(cluster, namespace, ACCOUNT, tmp_path / "pod.kubeconfig")


@pytest.fixture
def placement_dir(tmp_path: Path) -> Path:
    """The mounted ConfigMap, as a kubelet keeps it: v1 committed, then never refreshed here."""
    directory = tmp_path / "placement"
    directory.mkdir()
    (directory / naming.PLACEMENT_KEY).write_bytes(stored.pack(placement(1)))
    return directory


@pytest.fixture
def watched(
    cluster: Cluster, namespace: str, tmp_path: Path, placement_dir: Path
) -> Iterator[PlacementSource]:
    cluster.core.create_namespaced_config_map(namespace, body(placement(1), None))
    kubeconfig = account(cluster, namespace, tmp_path, role=True)
    source = PlacementSource(
        MountedFiles.directory(placement_dir), ConfigMapWatch(namespace, CONFIG_MAP, kubeconfig)
    )
    source.start(wait_s=10)
    yield source
    source.stop()


def test_each_change_of_the_config_map_is_seen_within_two_seconds(
    cluster: Cluster, namespace: str, watched: PlacementSource
) -> None:
    assert watched.watch is not None and watched.watch.synced.is_set()
    assert versions(watched) == (1, None)
    seen: dict[tuple[int, int | None], float] = {}
    # The operator's steps: propose v2, commit it; the mounted files stay at v1 throughout.
    for committed, pending in ((1, 2), (2, None)):
        proposal = placement(pending, servers=3) if pending is not None else None
        cluster.core.replace_namespaced_config_map(
            CONFIG_MAP, namespace, body(placement(committed), proposal)
        )
        expected = (committed, pending)

        def arrived(expected: tuple[int, int | None] = expected) -> bool:
            return versions(watched) == expected

        seen[expected] = wait_for(arrived, f"{expected}", 10)
    assert watched.read().origin == f"ConfigMap {namespace}/{CONFIG_MAP}"
    # Deleted (the pool is being deleted, or by hand): the last placement is kept...
    cluster.core.delete_namespaced_config_map(CONFIG_MAP, namespace)
    time.sleep(0.5)
    assert versions(watched) == (2, None)
    # ... and a new ConfigMap of the name is followed again (the watch is on the name).
    cluster.core.create_namespaced_config_map(namespace, body(placement(3), None))
    seen[(3, None)] = wait_for(lambda: versions(watched) == (3, None), "the re-created ConfigMap", 10)
    print(f"seconds from the API write to the source: {seen}")  # the measurement
    assert all(seconds <= PROPAGATION_S for seconds in seen.values()), seen
    assert watched.watch.failures == 0


def test_the_pods_role_reads_their_placement_config_maps_and_nothing_else(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    kubeconfig = account(cluster, namespace, tmp_path, role=True)
    cluster.core.create_namespaced_config_map(namespace, body(placement(1), None))
    cluster.core.create_namespaced_config_map(namespace, {"metadata": {"name": "other"}, "data": {"k": "v"}})
    pod = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    assert pod.read_namespaced_config_map(CONFIG_MAP, namespace).metadata.name == CONFIG_MAP
    by_name = pod.list_namespaced_config_map(namespace, field_selector=f"metadata.name={CONFIG_MAP}")
    assert [item.metadata.name for item in by_name.items] == [CONFIG_MAP]
    for forbidden in (
        lambda: pod.read_namespaced_config_map("other", namespace),
        lambda: pod.list_namespaced_config_map(namespace),  # every ConfigMap: not allowed
        lambda: pod.list_namespaced_config_map(namespace, field_selector="metadata.name=other"),
        lambda: pod.patch_namespaced_config_map(CONFIG_MAP, namespace, {"data": {"x": "y"}}),
        lambda: pod.delete_namespaced_config_map(CONFIG_MAP, namespace),
    ):
        with pytest.raises(client.ApiException) as refused:
            forbidden()
        assert refused.value.status == 403


def test_refused_by_rbac_the_watch_says_why_and_the_files_are_followed(
    cluster: Cluster,
    namespace: str,
    tmp_path: Path,
    placement_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster.core.create_namespaced_config_map(namespace, body(placement(1), placement(2, servers=3)))
    kubeconfig = account(cluster, namespace, tmp_path, role=False)
    watch = ConfigMapWatch(namespace, CONFIG_MAP, kubeconfig)
    source = PlacementSource(MountedFiles.directory(placement_dir), watch)
    with caplog.at_level(logging.WARNING, logger="eaas.placement.source"):
        source.start(wait_s=2)
        try:
            wait_for(lambda: watch.failures > 0, "the refused listing", 10)
            assert not watch.synced.is_set() and versions(source) == (1, None)  # the files
            (placement_dir / naming.PENDING_KEY).write_bytes(stored.pack(placement(2, servers=3)))
            assert versions(source) == (1, 2)  # the kubelet's refresh is followed
        finally:
            source.stop()
    (warning,) = [r.getMessage() for r in caplog.records if "not watched" in r.getMessage()]
    assert (
        "403" in warning
        and f"configmaps named {CONFIG_MAP}" in warning
        and "following the mounted files" in warning
    )


def test_an_expert_server_loads_a_placement_only_the_config_map_has(
    cluster: Cluster, namespace: str, tmp_path: Path, placement_dir: Path
) -> None:
    """The files say v1 (a kubelet a minute behind); the ConfigMap proposes v2 with a third server:
    the server loads it and reports v2 in seconds."""
    cluster.core.create_namespaced_config_map(namespace, body(placement(1), None))
    kubeconfig = account(cluster, namespace, tmp_path, role=True)
    checkpoint = write_random_checkpoint(preset("mixtral"), tmp_path / "checkpoint", seed=3)
    ready = tmp_path / "ready.json"
    env = {
        **os.environ,
        naming.ENV_POD_NAME: f"{POOL}-0",
        naming.ENV_NAMESPACE: namespace,
        naming.ENV_POOL: POOL,
        naming.ENV_PLACEMENT_CONFIGMAP: CONFIG_MAP,
    }
    command = [
        sys.executable, "-m", "eaas.runtime.server", "--checkpoint", str(checkpoint),
        "--placement-dir", str(placement_dir), "--ordinal", "0", "--transports", "tcp", "--threads", "1",
        "--kubeconfig", str(kubeconfig), "--exit-with-parent", str(os.getpid()), "--ready-file", str(ready),
    ]  # fmt: skip
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(ready.exists, "the server to serve", 60)
        url = json.loads(ready.read_text())["url"]

        def version() -> int:
            with urllib.request.urlopen(f"{url}/v1/info", timeout=5) as response:
                return int(json.loads(response.read())["placement_version"])

        assert version() == 1
        moved = placement(2, servers=3)
        cluster.core.replace_namespaced_config_map(CONFIG_MAP, namespace, body(placement(1), moved))
        seconds = wait_for(lambda: version() == 2, "the server to load v2", 30)
        print(f"pending v2 loaded {seconds:.2f} s after the ConfigMap was written")
        assert (placement_dir / naming.PENDING_KEY).exists() is False  # the files never said so
        assert process.poll() is None, log_path.read_text()
        assert "not watched" not in log_path.read_text()
    finally:
        process.kill()
        process.wait(timeout=10)


def test_an_attention_client_routes_by_commits_only_the_config_map_has(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """``eaas attention-client`` as pods run it, its mounted placement file never written (a kubelet
    that has not synced yet): it becomes ready on the first commit of the ConfigMap and routes by
    the next one within 2 s."""
    kubeconfig = account(cluster, namespace, tmp_path, role=True)
    model = preset("mixtral")
    checkpoint = write_random_checkpoint(model, tmp_path / "checkpoint", seed=3)
    first = round_robin(model.moe_layers, model.num_experts, 1, replication=1).with_version(1)
    ready_file = tmp_path / "ready.json"
    env = {
        **os.environ,
        naming.ENV_PORT: "0",
        naming.ENV_CHECKPOINT: str(checkpoint),
        naming.ENV_PLACEMENT_FILE: str(tmp_path / "placement" / naming.PLACEMENT_KEY),  # never there
        naming.ENV_PLACEMENT_CONFIGMAP: CONFIG_MAP,
        naming.ENV_POD_NAME: "tiny-attention-abc",
        naming.ENV_POOL: "tiny-attention",
        naming.ENV_NAMESPACE: namespace,
        naming.ENV_TRANSPORT: "tcp",
    }
    with LocalCluster(checkpoint, first, tmp_path / "servers", transports=("tcp",)) as servers:
        command = [
            sys.executable, "-m", "eaas.runtime.cli", "attention-client", "--host", "127.0.0.1",
            "--server", f"0={servers.urls[0]}", "--ready-file", str(ready_file),
            "--kubeconfig", str(kubeconfig),
        ]  # fmt: skip
        log_path = tmp_path / "client.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: ready_file.exists() or process.poll() is not None, "the client to start", 90)
            assert process.poll() is None, log_path.read_text()
            url = f"http://127.0.0.1:{json.loads(ready_file.read_text())['port']}"

            def routed_version() -> int | None:
                try:
                    with urllib.request.urlopen(f"{url}/readyz", timeout=5) as response:
                        return int(json.loads(response.read())["placement_version"])
                except urllib.error.HTTPError:
                    return None  # 503: no placement yet

            assert routed_version() is None
            cluster.core.create_namespaced_config_map(namespace, body(first, None))  # the first commit
            wait_for(lambda: routed_version() == 1, "the first placement to be routed by", 30)
            cluster.core.replace_namespaced_config_map(
                CONFIG_MAP, namespace, body(first.with_version(2), None)
            )
            seconds = wait_for(lambda: routed_version() == 2, "the commit of v2 to be routed by", 10)
            print(
                f"commit of v2 routed by {seconds:.2f} s after the ConfigMap was written"
            )  # the measurement
            assert seconds <= PROPAGATION_S
            assert "not watched" not in log_path.read_text()
        finally:
            process.kill()
            process.wait(timeout=10)
