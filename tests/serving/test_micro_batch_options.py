"""``--micro-batches auto``: trials of each count, the fastest kept (1 unless another is clearly
faster), trials again later; counts a step cannot have are skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from eaas.runtime.serving.micro_batches import CHOICES, AutoMicroBatches


def run(auto: AutoMicroBatches, per_row: dict[int, float], steps: int, rows: int = 8) -> list[int]:
    used = []
    for _ in range(steps):
        count = auto.count(rows)
        used.append(count)
        auto.observe(count, rows, per_row[count] * rows)
    return used


def test_auto_tries_every_count_then_keeps_the_fastest() -> None:
    auto = AutoMicroBatches(trial_steps=3, keep_steps=10)
    used = run(auto, {1: 1.0, 2: 0.6, 3: 0.7}, 9)
    assert sorted(used) == [1, 1, 1, 2, 2, 2, 3, 3, 3] and not auto.trying
    assert auto.chosen == 2 and run(auto, {1: 1.0, 2: 0.6, 3: 0.7}, 5) == [2] * 5


def test_auto_keeps_one_unless_another_beats_it_by_the_margin() -> None:
    auto = AutoMicroBatches(trial_steps=2, margin=0.03)
    used = run(auto, {1: 1.0, 2: 0.98, 3: 1.5}, 4)
    assert auto.chosen == 1 and not auto.trying  # 2% faster is noise
    assert 3 not in used  # 2 did not beat 1: 3 is not tried (its trials would cost the most)


def test_auto_measures_again_after_keep_steps() -> None:
    auto = AutoMicroBatches(trial_steps=2, keep_steps=4)
    run(auto, {1: 1.0, 2: 0.5, 3: 0.9}, 6)
    assert auto.chosen == 2
    run(auto, {1: 1.0, 2: 0.5, 3: 0.9}, 4)  # kept for 4 steps: trials again
    assert auto.trying
    run(auto, {1: 1.0, 2: 2.0, 3: 3.0}, 4)  # the load changed: 1 is best now
    assert auto.chosen == 1 and not auto.trying


def test_a_step_is_never_cut_into_more_micro_batches_than_rows() -> None:
    auto = AutoMicroBatches(trial_steps=2)
    assert all(auto.count(1) == 1 for _ in CHOICES)
    used = run(auto, {1: 1.0, 2: 0.5, 3: 0.1}, 10, rows=2)
    assert 3 not in used and auto.chosen == 1 and auto.trying  # 3 never tried: never picked


class Started(Exception):
    """Raised by the stand-in service: the command got as far as starting it."""


@pytest.mark.parametrize(("given", "engine_gets"), [(None, 1), ("2", 2), ("auto", "auto")])
def test_the_attention_client_command_gives_the_engine_its_micro_batches(
    given: str | None, engine_gets: int | str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eaas.runtime.commands.attention_client import attention_client
    from eaas.runtime.serving import serve

    def service(checkpoint: Path, placement: Path, discovery: Any, options: Any) -> None:
        raise Started(options.micro_batches)

    monkeypatch.setattr(serve, "AttentionService", service)
    words = [
        "--checkpoint",
        str(tmp_path),
        "--placement",
        str(tmp_path / "p.json"),
        "--server",
        "0=http://x:1",
    ]
    words += ["--port", "0"] + (["--micro-batches", given] if given else [])
    result = CliRunner().invoke(attention_client, words, env={"POD_NAME": "a", "POD_NAMESPACE": "b"})
    assert isinstance(result.exception, Started), result.output
    assert result.exception.args[0] == engine_gets


def test_micro_batches_outside_the_choices_are_refused_naming_the_option(tmp_path: Path) -> None:
    from eaas.runtime.commands.attention_client import attention_client

    result = CliRunner().invoke(attention_client, ["--micro-batches", "4"])
    assert result.exit_code == 2 and "--micro-batches" in result.output and "auto" in result.output
