"""The operator runs in a small pod (the chart's 512Mi limit): nothing of the GPU stack loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What `eaas operator` (the chart's command) imports before kopf's loop starts, then what the
# reconcilers run: every example MoEService parsed (model presets and families validated) and
# the children of its ExpertPool built.
OPERATOR_AT_WORK = """
import json, sys
from pathlib import Path
import yaml
import eaas.runtime.cli, eaas.operator.cli, eaas.operator.main
from eaas.operator.api import MoEServiceSpec
from eaas.operator.builders import moeservice
for path in sorted(Path("manifests").glob("moeservice-*.yaml")):
    document = yaml.safe_load(path.read_text())
    document["metadata"] |= {"namespace": "default", "uid": "0"}
    moeservice.expert_pool(document, MoEServiceSpec.from_k8s(document["spec"]))
print(json.dumps(sorted(sys.modules)))
"""

HEAVY = ("torch", "triton", "safetensors", "transformers", "tokenizers", "scipy")


def test_operator_loads_no_gpu_stack() -> None:
    out = subprocess.run(
        [sys.executable, "-c", OPERATOR_AT_WORK], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = json.loads(out.stdout)
    assert "eaas.operator.handlers" in loaded  # the handlers are registered
    assert "eaas.runtime.model.config" in loaded  # the model shapes are validated
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, f"the operator's import graph loads {heavy}"
