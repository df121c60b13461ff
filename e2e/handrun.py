"""Run the local control plane by hand, detached from any Python process (``make cluster-up``).

    python -m e2e.handrun up [--dir DIR] [--gpu-nodes N] [--nodes process|fake]   # prints `export ...`
    python -m e2e.handrun status [--dir DIR]
    python -m e2e.handrun down [--dir DIR]

(``python -m e2e.controlplane ...`` is the same.) The default DIR is ``$EAAS_CLUSTER_DIR`` or
``<cache>/cluster``; it holds the kubeconfig, logs and ``state.json`` with the pids and binaries
of the components. ``--nodes process`` (the default) gives GPU nodes whose pods run as local
processes (:mod:`e2e.podrunner`, with a pod network, kube-proxy and CoreDNS: root, ``nft`` and
``ip``; one such cluster per machine: kube-proxy's nftables table is the machine's, and ``down``
removes it); ``--nodes fake``, kwok's, where pods run nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from e2e import binaries as bins
from e2e.controlplane import SERVICE_CIDR, STATE_FILE, ControlPlane, FakeNodeSpec, ProcessNodeSpec
from e2e.podnet import PodNetwork
from e2e.processes import kill_group, process_alive
from e2e.waiting import WaitTimeout


def default_cluster_dir() -> Path:
    return Path(os.environ.get("EAAS_CLUSTER_DIR") or bins.cache_dir() / "cluster")


def _state(directory: Path) -> dict | None:
    try:
        return dict(json.loads((directory / STATE_FILE).read_text()))
    except (OSError, ValueError):
        return None


def _our_process(entry: dict) -> bool:
    """The recorded pid is still the binary we started (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{entry['pid']}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return bool(cmdline == entry["binary"] and process_alive(int(entry["pid"])))


def cluster_down(directory: Path) -> int:
    state = _state(directory)
    if state is None:
        print(f"no cluster state in {directory}; nothing to stop")
        return 0
    for entry in reversed(state["processes"]):
        if _our_process(entry):
            kill_group(int(entry["pid"]))
            print(f"stopped {entry['name']} (pid {entry['pid']})")
    if state.get("network"):  # process nodes: the pods' namespaces, the bridge, kube-proxy's rules
        PodNetwork(state["network"], SERVICE_CIDR).down()
        for family in ("ip", "ip6"):
            subprocess.run(["nft", "delete", "table", family, "kube-proxy"], capture_output=True, timeout=30)
        print(f"removed the pod network {state['network']}")
    shutil.rmtree(directory, ignore_errors=True)
    print(f"removed {directory}")
    return 0


def cluster_up(directory: Path, node_count: int, process_nodes: bool = True) -> int:
    state = _state(directory)
    if state is not None:
        if all(_our_process(entry) for entry in state["processes"]):
            print(f"# already running; to use it:\nexport KUBECONFIG={state['kubeconfig']}")
            print(f"export PATH={Path(state['processes'][0]['binary']).parent}:$PATH")
            return 0
        cluster_down(directory)  # a stale or half-dead one
    directory.mkdir(parents=True, exist_ok=True)
    if process_nodes:
        plane = ControlPlane(
            work_dir=directory, process_nodes=ProcessNodeSpec(count=node_count, gpus=4), attached=False
        )
    else:
        plane = ControlPlane(work_dir=directory, nodes=FakeNodeSpec(count=node_count), attached=False)
    try:
        plane.start()
    except (RuntimeError, WaitTimeout, bins.MissingBinariesError) as error:
        print(f"cluster-up failed: {error}\nlogs kept in {plane.log_dir}", file=sys.stderr)
        return 1
    plane.write_state()
    print(f"# control plane up in {plane.startup_seconds:.1f} s ({plane.server}); logs in {plane.log_dir}")
    kind = "GPU nodes whose pods run as processes" if process_nodes else "fake GPU nodes (kwok)"
    print(f"# {kind}: {' '.join(plane.node_names)}; stop with `make cluster-down`")
    print(f"export KUBECONFIG={plane.kubeconfig}")
    print(f"export PATH={plane.binaries.kubectl.parent}:$PATH")
    return 0


def cluster_status(directory: Path) -> int:
    state = _state(directory)
    if state is None:
        print(f"no cluster in {directory} (make cluster-up starts one)")
        return 0
    alive = {entry["name"]: _our_process(entry) for entry in state["processes"]}
    print(json.dumps({"kubeconfig": state["kubeconfig"], "running": alive}, indent=2))
    return 0 if all(alive.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.handrun", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=None, help="state directory (default: <cache>/cluster)")
    parser.add_argument("--gpu-nodes", type=int, default=2, help="number of GPU nodes (default 2)")
    parser.add_argument(
        "--nodes",
        choices=["process", "fake"],
        default=os.environ.get("EAAS_CLUSTER_NODES", "process"),
        help="process: pods run as local processes (default); fake: kwok nodes, where pods run nothing",
    )
    args = parser.parse_args(argv)
    directory = (args.dir or default_cluster_dir()).expanduser().resolve()
    if args.command == "up":
        return cluster_up(directory, args.gpu_nodes, args.nodes == "process")
    if args.command == "down":
        return cluster_down(directory)
    return cluster_status(directory)


def run() -> None:
    """Entry point: exit with main()'s status (130 on Ctrl-C)."""
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)


if __name__ == "__main__":
    run()
