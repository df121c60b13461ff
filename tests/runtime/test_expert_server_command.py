"""``eaas expert-server`` reads its flags into one ``ExpertServerOptions``, checked once, and hands it to
the server process; a bad combination is refused by flag before anything loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from eaas.runtime import contract
from eaas.runtime.commands import expert_server as command
from eaas.runtime.server.process import ExpertServerOptions, OptionError

ERRORS = [
    ([], "give exactly one of --placement FILE and --placement-dir DIR"),
    (["--placement", "{placement}", "--placement-dir", "{checkpoint}"], "give exactly one of --placement"),
    (["--placement", "{placement}", "--peer", "one"], "Invalid value for --peer: expected ORDINAL=http"),
    (["--placement", "{placement}", "--peer", "1=ftp://x"], "Invalid value for --peer: expected ORDINAL="),
    (
        ["--placement", "{placement}", "--peers-service", "pool.ns.svc"],
        "Invalid value for --peers-service: needs a fixed --control-port (the peers' port)",
    ),
    (
        ["--placement", "{placement}", "--peers-service", ".ns.svc", "--control-port", "9100"],
        "Invalid value for --peers-service: expert service: expected <pool>[.<namespace>.svc]",
    ),
]


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "placement.json").write_text("{}")
    return {"checkpoint": str(tmp_path / "checkpoint"), "placement": str(tmp_path / "placement.json")}


@pytest.mark.parametrize(("args", "message"), ERRORS)
def test_a_bad_combination_is_refused_by_flag(
    paths: dict[str, str], monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    started: list[Any] = []
    monkeypatch.setattr(command, "ExpertServerProcess", lambda options: started.append(options))
    words = ["--checkpoint", paths["checkpoint"], "--ordinal", "0", *(a.format(**paths) for a in args)]
    result = CliRunner().invoke(command.expert_server, words)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert started == []  # refused while reading the flags, before the server starts


def test_the_flags_become_one_options_object(paths: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[ExpertServerOptions] = []

    class Process:
        def __init__(self, options: ExpertServerOptions) -> None:
            started.append(options)

        def run(self) -> None:
            pass

    monkeypatch.setattr(command, "ExpertServerProcess", Process)
    words = ["--checkpoint", paths["checkpoint"], "--ordinal", "2", "--placement", paths["placement"]]
    words += [
        "--transports",
        "tcp, shm,",
        "--batch-wait-us",
        "50",
        "--peer",
        "1=http://h:9/",
        "--max-tokens",
        "64",
    ]
    result = CliRunner().invoke(
        command.expert_server, words, env={contract.ENV_POD_NAME: None, contract.ENV_NAMESPACE: None}
    )
    assert result.exit_code == 0, result.output
    (options,) = started
    assert options.ordinal == 2 and options.placement_path == Path(paths["placement"])
    assert options.placement_dir is None and options.heartbeat is None
    assert options.transports == ("tcp", "shm") and options.max_tokens == 64
    assert options.batch_wait_us == 50.0 and options.kernel_backend == "torch"
    assert options.peers is not None and options.peers.url_of(1) == "http://h:9"


def test_options_refuse_what_the_command_would() -> None:
    with pytest.raises(OptionError, match="give exactly one of --placement FILE and --placement-dir DIR"):
        ExpertServerOptions(checkpoint=Path("."), ordinal=0)
    with pytest.raises(OptionError, match="needs a fixed --control-port") as refused:
        ExpertServerOptions(
            checkpoint=Path("."), ordinal=0, placement_path=Path("p"), peers_service="p.ns.svc"
        )
    assert refused.value.flag == "--peers-service"
