"""``eaas local`` (what ``make demo`` runs): real processes, text out, tokens/s, transparent failover."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_eaas_local_generates_and_survives_a_sigkill(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "eaas.runtime.cli", "local", "--family", "qwen3_moe", "--servers", "3",
        "--replication", "2", "--prompts", "4", "--clients", "2", "--max-new-tokens", "6",
        "--kill-server-after", "2", "--transport", "tcp", "--workdir", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output = result.stdout
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "'Experts as a service' -> " in output
    assert re.search(r"24 tokens from 2 client\(s\) over tcp in [\d.]+ s = [\d.]+ tokens/s", output)
    assert "failover: SIGKILL expert server 1" in output and "re-sent" in output
    assert "tokens identical to the single-process reference model" in output
    # Every server process is gone and its shared memory removed.
    pids = [int(p) for p in re.findall(r"\d+:(\d+)", output.split("pids", 1)[1].split(")", 1)[0])]
    assert len(pids) == 3
    for pid in pids:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        )
        assert not list(Path("/dev/shm").glob(f"eaas-*-{pid}-*"))
    assert (tmp_path / "cluster" / "placement.json").is_file()


def test_bad_arguments_are_reported_by_name() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "eaas.runtime.cli", "local", "--servers", "1", "--replication", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )  # fmt: skip
    assert result.returncode != 0
    assert "replication=2 needs at least 2 servers" in result.stderr


def test_attention_client_command_generates_against_running_servers(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from click.testing import CliRunner
    from datapath_helpers import in_process_servers

    from eaas.runtime.commands.attention_client import attention_client
    from eaas.runtime.model import ByteTokenizer, CheckpointReader, load_reference
    from eaas.runtime.placement import round_robin

    checkpoint = tiny_checkpoints["mixtral"]
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=2)
    placement_file = tmp_path / "placement.json"
    placement_file.write_text(placement.to_json())
    with in_process_servers(checkpoint, placement) as servers:
        specs = [arg for o, s in servers.items() for arg in ("--server", f"{o}={s.url}")]
        result = CliRunner().invoke(
            attention_client,
            ["--checkpoint", str(checkpoint), "--placement", str(placement_file), *specs, "--prompt", "hello",
             "--max-new-tokens", "4"],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    tokenizer = ByteTokenizer(config.vocab_size)
    [want], _ = load_reference(checkpoint).generate([tokenizer.encode("hello")], 4)
    assert f"'hello' -> {tokenizer.decode(want)!r}" in result.output
    assert "4 tokens in" in result.output and "(0 failovers)" in result.output


@pytest.mark.parametrize(
    ("cores", "servers", "per_server", "omp", "expected"),
    [
        (16, 4, 1, None, 12),  # the cores the servers' threads leave
        (16, 4, 2, None, 8),
        (2, 3, 1, None, 1),  # fewer cores than servers: one thread, never none
        (2, 2, 1, None, 1),
        (16, 4, 1, "3", None),  # OMP_NUM_THREADS given: left as it is
    ],
)
def test_a_local_client_gets_the_cores_the_servers_leave(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cores: int,
    servers: int,
    per_server: int,
    omp: str | None,
    expected: int | None,
) -> None:
    from eaas.runtime.local.cluster import LocalCluster
    from eaas.runtime.placement import round_robin

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    placement = round_robin([0, 1], 8, servers)
    cluster = LocalCluster(
        tmp_path / "checkpoint", placement, tmp_path / "cluster", threads_per_server=per_server
    )
    assert cluster.client_threads() == expected
