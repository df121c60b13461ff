"""The sampler: greedy, penalties, truncation, seeds and log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from eaas.runtime.serving.sampling import SamplingParams, new_generator, sample


def one(logits: list[float], params: SamplingParams, counts: list[int] | None = None, seed: int = 0):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(seed)
    row = torch.tensor([logits])
    seen = torch.tensor(counts or [0] * len(logits))
    return sample(row, [params], [generator], [seen])[0]


def test_greedy_takes_the_arg_max_and_reports_model_logprobs() -> None:
    logits = [0.0, 2.0, 1.0, -1.0]
    choice = one(logits, SamplingParams(logprobs=2))
    expected = torch.log_softmax(torch.tensor(logits), 0)
    assert choice.token == 1
    assert math.isclose(choice.logprob, float(expected[1]), rel_tol=1e-6)
    assert [t for t, _ in choice.top] == [1, 2]


def test_penalties_follow_openai() -> None:
    # logit - frequency * count - presence * (count > 0): token 1 (seen 3x) drops below token 2.
    logits, counts = [0.0, 2.0, 1.5, 0.0], [0, 3, 0, 0]
    assert one(logits, SamplingParams(), counts).token == 1
    assert one(logits, SamplingParams(frequency_penalty=0.2), counts).token == 2  # 2 - 0.6 < 1.5
    assert one(logits, SamplingParams(presence_penalty=0.6), counts).token == 2  # 2 - 0.6 < 1.5
    assert one(logits, SamplingParams(presence_penalty=0.4), counts).token == 1


def test_truncation_and_temperature() -> None:
    logits = [0.0, 3.0, 2.9, -5.0]
    draws = {one(logits, SamplingParams(temperature=1.0, top_k=2), seed=s).token for s in range(60)}
    assert draws == {1, 2}
    draws = {one(logits, SamplingParams(temperature=1.0, top_p=0.3), seed=s).token for s in range(30)}
    assert draws == {1}  # token 1 alone holds more than 30% of the mass
    draws = {one(logits, SamplingParams(temperature=2.0), seed=s).token for s in range(200)}
    assert {0, 1, 2} <= draws


def test_seeds_reproduce_and_differ() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=1.0, seed=11)
    generator_a, generator_b = new_generator(params), new_generator(params)
    counts = torch.zeros(50, dtype=torch.int64)
    row = torch.tensor([logits])
    a = [sample(row, [params], [generator_a], [counts])[0].token for _ in range(20)]
    b = [sample(row, [params], [generator_b], [counts])[0].token for _ in range(20)]
    assert a == b and len(set(a)) > 3


def test_a_seeded_row_draws_the_same_whatever_else_is_in_the_batch() -> None:
    vocab = 64
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    mine = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    others = [
        SamplingParams(),
        SamplingParams(temperature=1.5, top_k=3, seed=1),
        SamplingParams(temperature=1.0, frequency_penalty=1.0),
        SamplingParams(temperature=0.5, logprobs=4),
    ]
    counts = [torch.zeros(vocab, dtype=torch.int64) for _ in range(5)]

    def run(batch: bool) -> list[int]:
        generator = new_generator(mine)
        tokens = []
        for _ in range(30):
            if batch:
                rows = [*others, mine]
                gens = [new_generator(p) for p in others] + [generator]
                tokens.append(sample(logits, rows, gens, counts)[4].token)
            else:
                tokens.append(sample(logits[4:], [mine], [generator], counts[4:])[0].token)
        return tokens

    assert run(batch=True) == run(batch=False)


@pytest.mark.parametrize(
    "mine", [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.7, top_k=0, seed=9)]
)
def test_a_seeded_row_without_truncation_draws_the_same_beside_rows_that_truncate(
    mine: SamplingParams,
) -> None:
    """OpenAI's defaults (top_p 1, no top_k) beside a top-k or top-p row: the row's draw is laid
    along its own (vocabulary) order, as when it is alone."""
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2))
    others = [SamplingParams(temperature=1.0, top_k=3, seed=1), SamplingParams(temperature=1.0, top_p=0.5)]
    counts = [torch.zeros(vocab, dtype=torch.int64) for _ in range(3)]
    alone_generator, batch_generator = new_generator(mine), new_generator(mine)
    alone = [sample(logits[2:], [mine], [alone_generator], counts[2:])[0].token for _ in range(30)]
    batched = [
        sample(logits, [*others, mine], [*(new_generator(p) for p in others), batch_generator], counts)[
            2
        ].token
        for _ in range(30)
    ]
    assert batched == alone


def test_draws_follow_the_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]] * 4000)
    params = [SamplingParams(temperature=1.0)] * 4000
    generators = [torch.Generator().manual_seed(s) for s in range(4000)]
    counts = [torch.zeros(5, dtype=torch.int64)] * 4000
    tokens = torch.tensor([c.token for c in sample(logits, params, generators, counts)])
    frequency = torch.bincount(tokens, minlength=5).float() / 4000
    expected = torch.softmax(logits[0], 0)
    assert torch.allclose(frequency, expected, atol=0.03), (frequency, expected)


def test_truncation_never_draws_a_cut_token() -> None:
    logits = torch.randn(200, 32, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=2.0, top_k=1 + r % 5, top_p=0.2 + (r % 7) / 10) for r in range(200)]
    generators = [torch.Generator().manual_seed(r) for r in range(200)]
    counts = [torch.zeros(32, dtype=torch.int64)] * 200
    for row, choice in enumerate(sample(logits, params, generators, counts)):
        allowed = torch.topk(logits[row], params[row].top_k).indices.tolist()
        assert choice.token in allowed


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
def test_a_temperature_too_small_for_float32_is_greedy(temperature: float) -> None:
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=temperature, top_k=5 * (r % 2), top_p=0.9, logprobs=2) for r in range(8)
    ]
    generators = [torch.Generator().manual_seed(r) for r in range(8)]
    counts = [torch.zeros(64, dtype=torch.int64)] * 8
    tokens = [c.token for c in sample(logits, params, generators, counts)]
    assert tokens == torch.argmax(logits, dim=-1).tolist()


def test_a_top_k_beyond_the_vocabulary_keeps_every_token() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(5)).tolist()
    for seed in range(10):
        for top_p in (1.0, 0.9):  # below 1: the truncating path, where top_k goes into a tensor
            everything = one(logits, SamplingParams(temperature=1.0, top_p=top_p), seed=seed).token
            huge = SamplingParams(temperature=1.0, top_p=top_p, top_k=10**23)  # past int64 too
            assert one(logits, huge, seed=seed).token == everything


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 3.0, r"temperature: must be in \[0, 2\]"),
        ("top_p", 0.0, r"top_p: must be in \(0, 1\]"),
        ("top_k", -1, "top_k: must be >= 0"),
        ("presence_penalty", 2.5, r"presence_penalty: must be in \[-2, 2\]"),
        ("logprobs", 21, r"logprobs: must be in \[0, 20\]"),
        ("max_tokens", -1, "max_tokens: must be >= 0"),
        ("prompt_logprobs", 21, r"prompt_logprobs: must be in \[0, 20\]"),
    ],
)
def test_bad_parameters_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
