"""docs/install.md's "Try it on a local cluster", run as written: ``make cluster-up`` with
process nodes, the chart with its operator pod, the tiny MoEService, two answers through its
Service around a ``kubectl drain`` of a node with expert servers, ``make cluster-down``.

Two substitutions only: the checkpoint goes to this test's directory instead of /var/lib/eaas
(and the sample manifest's hostPath with it), and ``make cluster-up`` does not re-link the
virtual environment the suite is running from (``-o install``; the suite did it).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = "/var/lib/eaas"
MANIFEST = "manifests/moeservice-tiny-cpu.yaml"
ANSWER = re.compile(r'\{"id": "chatcmpl-.*?"usage": \{[^}]*\}\}')


def walkthrough() -> str:
    """The bash block of the section."""
    section = (ROOT / "docs" / "install.md").read_text().split("## Try it on a local cluster", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None, "docs/install.md: the walkthrough has no bash block"
    return block.group(1)


def deploy_example_headers() -> set[tuple[str, ...]]:
    """The column headers of docs/deploy.md's example output of ``kubectl get eaas`` (one table
    per kind)."""
    text = (ROOT / "docs" / "deploy.md").read_text().split("kubectl get eaas", 1)[1]
    block = re.search(r"```text\n(.*?)```", text, re.DOTALL)
    assert block is not None, "docs/deploy.md: no example output after kubectl get eaas"
    headers = {tuple(line.split()) for line in block.group(1).splitlines() if line.startswith("NAME ")}
    assert len(headers) == 3, "docs/deploy.md: the example should show the three kinds' tables"
    return headers


def test_the_local_cluster_walkthrough_runs_as_written(tmp_path: Path) -> None:
    script = walkthrough()
    needed_commands = (
        "make -s cluster-up",
        "kubectl get eaas",
        "kubectl logs deploy/eaas-operator",
        "kubectl drain",
    )
    for needed in (CHECKPOINTS, MANIFEST, *needed_commands, "make cluster-down"):
        assert needed in script, f"the walkthrough no longer has {needed!r}: update this test"
    manifest = tmp_path / "moeservice-tiny-cpu.yaml"
    manifest.write_text((ROOT / MANIFEST).read_text().replace(CHECKPOINTS, str(tmp_path)))
    script = (
        script.replace(CHECKPOINTS, str(tmp_path))
        .replace(MANIFEST, str(manifest))
        .replace("make -s cluster-up", "make -s -o install cluster-up")
    )
    environment = {**os.environ, "EAAS_CLUSTER_DIR": str(tmp_path / "cluster")}
    try:
        run = subprocess.run(
            ["bash", "-euxo", "pipefail", "-c", script],
            cwd=ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:  # whatever failed, nothing of the cluster is left behind
        subprocess.run(
            ["make", "-s", "cluster-down"], cwd=ROOT, env=environment, capture_output=True, timeout=120
        )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    answers = ANSWER.findall(run.stdout)
    assert len(answers) == 2 and all('"completion_tokens": 8' in answer for answer in answers), output[-6000:]
    assert "node/gpu-node-0 drained" in output
    for reason in ("ServerLeaving", "PlacementCommitted", "ServerReleased"):
        assert reason in run.stdout, f"no {reason} Event after the drain:\n{run.stdout[-4000:]}"
    printed = {tuple(line.split()) for line in run.stdout.splitlines() if line.startswith("NAME ")}
    assert printed >= deploy_example_headers(), (
        f"kubectl get eaas printed other columns:\n{run.stdout[:4000]}"
    )
    assert not (tmp_path / "cluster").exists()  # make cluster-down removed it
