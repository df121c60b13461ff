"""Reasoning models' thinking told apart from their answers, whole and streamed piece by piece."""

from __future__ import annotations

import pytest

from eaas.runtime.commands.options import REASONING_PARSERS
from eaas.runtime.serving.reasoning import STYLES, StreamedReasoning, reasoning_style

R1, QWEN3 = STYLES["deepseek_r1"], STYLES["qwen3"]


@pytest.mark.parametrize(
    ("style", "text", "reasoning", "content"),
    [
        (R1, "weigh it up\n</think>\n\nIt is 4.", "weigh it up", "It is 4."),
        (R1, "<think>weigh</think>4", "weigh", "4"),  # a template that leaves the opening to the model
        (R1, "still thinking when cut off", "still thinking when cut off", ""),
        (QWEN3, "<think>\nhmm\n</think>\n\nYes.", "hmm", "Yes."),
        (QWEN3, "Yes, no thinking asked.", "", "Yes, no thinking asked."),
        (QWEN3, "<think>cut off", "cut off", ""),
    ],
)
def test_whole_outputs_are_split(style: object, text: str, reasoning: str, content: str) -> None:
    assert style.split(text) == (reasoning, content)  # type: ignore[attr-defined]


@pytest.mark.parametrize("style", [R1, QWEN3])
def test_streamed_pieces_give_the_same_split_with_markers_split_over_pieces(style: object) -> None:
    text = "<think>\nlet me see: 2+2 < 5 </th" + "ink> x</think>\n\nIt is 4 </"
    for size in (1, 2, 3, 5, 8):
        stream = StreamedReasoning(style)  # type: ignore[arg-type]
        reasoning = content = ""
        for i in range(0, len(text), size):
            r, c = stream.push(text[i : i + size])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        reasoning, content = reasoning + r, content + c
        whole = style.split(text)  # type: ignore[attr-defined]
        assert (reasoning.strip(), content.strip()) == (whole[0], whole[1].strip()), size
        assert "</think>" not in reasoning and "<think>" not in content


def test_parsers_by_family_and_by_flag() -> None:
    assert reasoning_style(None, "qwen3_moe") is QWEN3 and reasoning_style("auto", "mixtral") is None
    assert (
        reasoning_style("deepseek_r1", "deepseek_v3") is R1 and reasoning_style("none", "qwen3_moe") is None
    )
    assert reasoning_style(None, "gpt_oss") is STYLES["harmony"]
    with pytest.raises(ValueError, match="reasoning-parser"):
        reasoning_style("granite", "mixtral")
    assert set(REASONING_PARSERS) == {"auto", "none", *STYLES}  # the CLI offers exactly the styles
