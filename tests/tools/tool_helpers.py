"""Helpers of the tool tests: what the served preset is, and running a tool as its own process."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Served:
    url: str  # http://127.0.0.1:PORT (no /v1)
    model: str
    tokenizer: Path  # the preset's tokenizer directory, as `eaas model tokenizer` writes it


def tool_env(home: Path, offline: bool = True) -> dict[str, str]:
    """The tools' environment: caches under `home`; with `offline`, the Hugging Face libraries are
    told not to reach a hub (the tokenizer and the datasets are local files anyway)."""
    env = {
        **os.environ,
        "HF_HOME": str(home / "hf"),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    if offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def run_tool(command: list[str], cwd: Path, home: Path, offline: bool = True, timeout_s: float = 600) -> str:
    """Run a tool to its end; its combined output, or a test failure that shows it."""
    env = tool_env(home, offline)
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{command[0]} exited {result.returncode}:\n{output[-6000:]}"
    return output


def tokenize_chat(served: Served, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt ids of `messages` as the server renders them (its chat template), from its /tokenize."""
    body = json.dumps({"model": served.model, "messages": messages, "add_generation_prompt": True})
    request = urllib.request.Request(
        f"{served.url}/tokenize", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return list(json.load(answer)["tokens"])
