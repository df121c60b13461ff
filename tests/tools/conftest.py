"""Fixtures of the tool tests: the tools' venv (built once by ``build-venv.sh``, cached outside the
repository), one ``eaas serve --preset`` process on a free loopback port, the preset's tokenizer
directory (``eaas model tokenizer``) and the monolithic reference of the same random weights.

The tools run as their own processes, unmodified, from their venv; a tool that cannot be installed
fails the tests (it is never skipped)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from eaas.runtime.model import Decoder, load_reference, preset_of_spec, write_random_checkpoint
from tools.tool_helpers import Served

HERE = Path(__file__).parent
PRESET = "mixtral/tiny"
START_TIMEOUT_S = 300  # expert servers + API on a busy 2-core machine
INSTALL_TIMEOUT_S = 1800  # a fresh install downloads a few hundred MB


@pytest.fixture(scope="session")
def tool_venv() -> Path:
    """The tools' venv: built by ``build-venv.sh`` when it is not cached yet; a failed install
    fails the test with the end of pip's log."""
    try:
        result = subprocess.run(
            ["bash", str(HERE / "build-venv.sh")],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            env={**os.environ, "EAAS_PROJECT_PYTHON": sys.executable},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"build-venv.sh did not finish in {INSTALL_TIMEOUT_S} s: {exc.stderr!r}")
    if result.returncode != 0:
        pytest.fail(
            f"the tools could not be installed (build-venv.sh exit {result.returncode}):\n{result.stderr}"
        )
    venv = Path(result.stdout.strip().splitlines()[-1])
    assert (venv / ".complete").is_file(), result.stderr
    return venv


@pytest.fixture(scope="package")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``eaas serve --preset mixtral/tiny`` on port 0 (loopback), until this folder's tests are
    done (not the session: the later tests, e2e drills among them, do not share the cores with it)."""
    workdir = tmp_path_factory.mktemp("served")
    tokenizer = workdir / "tokenizer"
    cli = [sys.executable, "-m", "eaas.runtime.cli"]
    subprocess.run([*cli, "model", "tokenizer", PRESET, str(tokenizer)], check=True, timeout=120)
    ready = workdir / "ready.json"
    log = (workdir / "serve.log").open("w")
    command = [
        *cli, "serve", "--preset", PRESET, "--port", "0", "--servers", "2", "--transport", "tcp",
        "--ready-file", str(ready),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            assert process.poll() is None, (workdir / "serve.log").read_text()
            assert time.monotonic() < deadline, (
                "eaas serve did not start:\n" + (workdir / "serve.log").read_text()
            )
            time.sleep(0.2)
        port = json.loads(ready.read_text())["port"]
        yield Served(url=f"http://127.0.0.1:{port}", model=PRESET, tokenizer=tokenizer)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    """The monolithic reference of the weights `eaas serve --preset` writes (seed 0)."""
    directory = tmp_path_factory.mktemp("reference") / "checkpoint"
    return load_reference(write_random_checkpoint(preset_of_spec(PRESET), directory, seed=0))
