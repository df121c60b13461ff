"""Prompt log-probabilities (vLLM's ``prompt_logprobs``) come from the prefill pass itself and equal
the monolithic reference's ``log_softmax`` at every prompt position: every family, chunked prefill
mixed with decodes, preemption, and a prompt whose blocks the prefix cache already holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaas.runtime.model import FAMILIES, load_reference
from eaas.runtime.model.decoder import Decoder
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.paged_cache import KVPool
from eaas.runtime.serving.sampling import SamplingParams
from eaas.runtime.serving.scheduler import Sequence

SCORED = [5, 17, 200, 3, 9, 11, 2, 7, 7, 7, 7, 7, 9, 11, 13, 1, 4, 100]  # 18 tokens: several chunks
OTHERS = [[42], [9, 8, 7, 6, 5], [100, 3, 4, 5, 6, 7, 8]]
NUM_TOP = 3


def options_for(decoder: Decoder, blocks: int, max_batch_tokens: int = 6) -> EngineOptions:
    per_block = KVPool.bytes_per_block(decoder.config, 4, decoder.side.dtype)
    return EngineOptions(
        kv_cache_bytes=blocks * per_block, block_size=4, max_batch_tokens=max_batch_tokens, max_seqs=4
    )


def reference_logprobs(decoder: Decoder, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V]: the log-softmax at positions 0 .. P-2 (each predicts the next prompt token), from
    one monolithic forward pass over the whole prompt."""
    tokens = torch.tensor([prompt], dtype=torch.int64)
    logits = decoder.forward(
        tokens, torch.tensor([len(prompt)]), decoder.new_cache(1, len(prompt)), all_logits=True
    )
    return torch.log_softmax(logits[0, :-1].to(torch.float32), dim=-1)


def check_scored(seq: Sequence, want: torch.Tensor, num_top: int = NUM_TOP) -> None:
    prompt = seq.prompt
    assert len(seq.prompt_logprobs) == len(prompt) - 1
    for position, entry in enumerate(seq.prompt_logprobs):
        row = want[position]
        token = prompt[position + 1]
        assert entry.token == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4), position
        # rank: 1 + the tokens more likely (within float tolerance: near-ties may order either way)
        assert (
            int((row > entry.logprob + 1e-4).sum()) < entry.rank <= int((row >= entry.logprob - 1e-4).sum())
        )
        values, _ = torch.topk(row, num_top)
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), values, rtol=0, atol=1e-4)
        for alternative, logprob in entry.top:  # each is that token's own log-probability
            assert logprob == pytest.approx(float(row[alternative]), abs=1e-4)


def run(engine: Engine, params: SamplingParams, others: SamplingParams, arrival: int = 1) -> Sequence:
    """``SCORED`` joins at step ``arrival`` while ``OTHERS`` (not scored) decode around it."""
    seqs = [engine.add(prompt, others) for prompt in OTHERS]
    scored: Sequence | None = None
    for step in range(300):
        if step == arrival:
            scored = engine.add(SCORED, params)
        if step > arrival and not engine.has_work():
            break
        engine.step()
    assert scored is not None and scored.status == "finished"
    assert all(seq.status == "finished" and seq.prompt_logprobs == [] for seq in seqs)
    return scored


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_equal_the_references_log_softmax(
    family: str, tiny_checkpoints: dict[str, Path]
) -> None:
    decoder = load_reference(tiny_checkpoints[family])
    want = reference_logprobs(decoder, SCORED)
    engine = Engine(decoder, options_for(decoder, 64))  # chunks of at most 6 tokens, with decodes
    seq = run(engine, SamplingParams(max_tokens=3, prompt_logprobs=NUM_TOP), SamplingParams(max_tokens=8))
    check_scored(seq, want)
    alone, _ = decoder.generate([SCORED], 3)
    assert seq.output == alone[0]  # the last prompt position still samples the first new token
    assert engine.allocator.used_fraction == 0


def test_max_tokens_0_scores_the_prompt_and_samples_nothing(tiny_checkpoints: dict[str, Path]) -> None:
    decoder = load_reference(tiny_checkpoints["mixtral"])
    engine = Engine(decoder, options_for(decoder, 64, max_batch_tokens=64))
    seq = run(engine, SamplingParams(max_tokens=0, prompt_logprobs=0), SamplingParams(max_tokens=4))
    assert seq.output == [] and seq.finish_reason == "length"
    check_scored(seq, reference_logprobs(decoder, SCORED), num_top=0)
    assert all(entry.top == [] for entry in seq.prompt_logprobs)
    single = engine.add([7], SamplingParams(max_tokens=0, prompt_logprobs=1))  # nothing to score
    while engine.has_work():
        engine.step()
    assert single.prompt_logprobs == [] and single.finish_reason == "length"


def test_a_preempted_prompt_is_scored_once_and_right(tiny_checkpoints: dict[str, Path]) -> None:
    decoder = load_reference(tiny_checkpoints["deepseek_v3"])
    engine = Engine(decoder, options_for(decoder, 8))  # 32 positions for 4 sequences: preemption
    seq = run(engine, SamplingParams(max_tokens=6, prompt_logprobs=NUM_TOP), SamplingParams(max_tokens=12), 0)
    assert engine.scheduler.preemptions > 0
    check_scored(seq, reference_logprobs(decoder, SCORED))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])  # GQA blocks and latent (MLA) blocks
def test_a_cached_prefix_is_computed_again_for_a_scored_prompt(
    family: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """The prefix cache holds ``SCORED``'s blocks: a request that wants them scored computes every
    position anyway (vLLM skips the cache for it), while one that does not still hits."""
    decoder = load_reference(tiny_checkpoints[family])
    engine = Engine(decoder, options_for(decoder, 64))
    warm = engine.add(SCORED, SamplingParams(max_tokens=2))
    while engine.has_work():
        engine.step()
    hits = engine.allocator.hits
    assert engine.allocator.cached_blocks >= 4 and warm.output
    seq = run(engine, SamplingParams(max_tokens=2, prompt_logprobs=NUM_TOP), SamplingParams(max_tokens=4))
    assert engine.allocator.hits == hits  # the scored prompt took nothing from the cache
    check_scored(seq, reference_logprobs(decoder, SCORED))
    again = engine.add(SCORED, SamplingParams(max_tokens=2))
    while engine.has_work():
        engine.step()
    assert engine.allocator.hits > hits and again.output == warm.output
