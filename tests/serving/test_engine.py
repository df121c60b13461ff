"""Continuous batching equals one-by-one generation: staggered arrivals, chunked prefill mixed
with decodes, a paged KV cache small enough to preempt, every attention variant."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from eaas.runtime.model import load_reference
from eaas.runtime.model.decoder import Decoder, MicroBatch
from eaas.runtime.serving import engine as engine_module
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.micro_batches import row_work, split_rows
from eaas.runtime.serving.paged_cache import KVPool
from eaas.runtime.serving.sampling import SamplingParams
from eaas.runtime.serving.scheduler import Sequence

PROMPTS = [[5, 17, 200, 3, 9, 11, 2], [42], [7, 7, 7, 7, 7, 7, 7, 9, 11, 13, 1, 4], [100, 3], [9, 8, 7, 6, 5]]
ARRIVAL_STEP = [0, 0, 2, 3, 7]  # requests join while others run
NEW_TOKENS = [6, 9, 5, 8, 4]


def run_staggered(engine: Engine, params: list[SamplingParams]) -> list[Sequence]:
    seqs: list[Sequence | None] = [None] * len(PROMPTS)
    step = 0
    while step < 200:
        for i, arrival in enumerate(ARRIVAL_STEP):
            if arrival == step:
                seqs[i] = engine.add(PROMPTS[i], params[i])
        if step > max(ARRIVAL_STEP) and not engine.has_work():
            break
        engine.step()
        step += 1
    assert all(s is not None and s.status == "finished" for s in seqs)
    return [s for s in seqs if s is not None]


def options_for(decoder: Decoder, blocks: int) -> EngineOptions:
    per_block = KVPool.bytes_per_block(decoder.config, 4, decoder.side.dtype)
    return EngineOptions(kv_cache_bytes=blocks * per_block, block_size=4, max_batch_tokens=6, max_seqs=4)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss", "glm4_moe"])
@pytest.mark.parametrize("blocks", [64, 6], ids=["roomy", "preempting"])
def test_greedy_outputs_equal_generating_each_prompt_alone(
    family: str, blocks: int, tiny_checkpoints: dict[str, Path]
) -> None:
    decoder = load_reference(tiny_checkpoints[family])
    engine = Engine(decoder, options_for(decoder, blocks))
    seqs = run_staggered(engine, [SamplingParams(max_tokens=n) for n in NEW_TOKENS])
    for seq, prompt, n in zip(seqs, PROMPTS, NEW_TOKENS, strict=True):
        alone, _ = decoder.generate([prompt], n)
        assert seq.output == alone[0], (family, prompt)
        assert seq.finish_reason == "length"
    assert engine.allocator.used_fraction == 0  # every block came back
    if blocks == 6:
        assert engine.scheduler.preemptions > 0


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_checkpoints: dict[str, Path]) -> None:
    decoder = load_reference(tiny_checkpoints["qwen3_moe"])
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = Engine(decoder, options_for(decoder, 64))
    seq = alone.add(PROMPTS[0], params)
    while alone.has_work():
        alone.step()
    crowded = Engine(decoder, options_for(decoder, 6))  # preemption and other requests around it
    mixed = [SamplingParams(max_tokens=n, temperature=1.0) for n in NEW_TOKENS]
    mixed[0] = params
    seqs = run_staggered(crowded, mixed)
    assert seqs[0].output == seq.output
    assert len(set(seq.output)) > 1


def test_stop_tokens_abort_and_logprobs(tiny_checkpoints: dict[str, Path]) -> None:
    decoder = load_reference(tiny_checkpoints["mixtral"])
    alone, logits = decoder.generate([PROMPTS[0]], 6)
    engine = Engine(decoder, options_for(decoder, 64))
    stopped = engine.add(PROMPTS[0], SamplingParams(max_tokens=6, stop_token_ids=(alone[0][2],), logprobs=3))
    aborted = engine.add(PROMPTS[1], SamplingParams(max_tokens=50))
    logprobs = []
    for _ in range(4):
        logprobs += [e.sampled.logprob for e in engine.step() if e.seq is stopped and e.sampled]
    engine.abort(aborted)
    while engine.has_work():
        engine.step()
    assert stopped.output == alone[0][:3] and stopped.finish_reason == "stop"
    assert aborted.finish_reason == "abort" and engine.allocator.used_fraction == 0
    expected = torch.log_softmax(logits[:3, 0], -1).gather(1, torch.tensor(alone[0][:3])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=1e-4, atol=1e-4)


def test_requests_that_can_never_fit_are_refused(tiny_checkpoints: dict[str, Path]) -> None:
    decoder = load_reference(tiny_checkpoints["mixtral"])
    engine = Engine(decoder, options_for(decoder, 4))  # 16 positions in all
    with pytest.raises(
        ValueError, match=r"max_tokens: prompt \(7 tokens\) \+ max_tokens \(10\) exceeds the 16"
    ):
        engine.add(PROMPTS[0], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=r"prompt: token ids must be in \[0, 320\)"):
        engine.add([400], SamplingParams())


NAN_TOKEN = 301  # a row whose new tokens end with it gets NaN logits (``NanOnMarker``)


class NanOnMarker:
    """The decoder, except that a row whose last new token is ``NAN_TOKEN`` comes out NaN (a
    model's numeric failure on one sequence)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.config, self.side = decoder.config, decoder.side

    def hidden_micro_batches(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        hiddens = self.decoder.hidden_micro_batches(batches)  # [B, S, H] each
        for batch, hidden in zip(batches, hiddens, strict=True):
            last = batch.tokens.gather(1, (batch.num_new - 1)[:, None])[:, 0]  # [B]
            with torch.inference_mode():
                hidden.masked_fill_((last == NAN_TOKEN)[:, None, None], float("nan"))
        return hiddens


class BrokenMatcher:
    """A grammar matcher on which the grammar engine fails (``allowed_tokens`` raises, as a bug or
    a limit of llguidance would)."""


def test_a_row_that_cannot_be_sampled_fails_its_sequence_alone(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN logits in one row, a grammar matcher that raises in another: those two sequences finish
    with ``error`` (the server's fault); the rows sampled in the same steps, greedy and seeded,
    come out as they do alone."""

    def allowed_tokens(matchers: list[Any], vocab_size: int) -> torch.Tensor:
        if any(isinstance(m, BrokenMatcher) for m in matchers):
            raise RuntimeError("the grammar engine failed")
        raise AssertionError("no other row has a grammar")

    monkeypatch.setattr(engine_module, "allowed_tokens", allowed_tokens)
    decoder = load_reference(tiny_checkpoints["mixtral"])
    good = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=3)]
    alone = []
    for params in good:
        engine = Engine(decoder, options_for(decoder, 64))
        alone.append(engine.add(PROMPTS[0], params))
        while engine.has_work():
            engine.step()
    engine = Engine(NanOnMarker(decoder), options_for(decoder, 64))  # type: ignore[arg-type]
    together = [engine.add(PROMPTS[0], params) for params in good]
    nan = engine.add([5, 6, NAN_TOKEN], SamplingParams(max_tokens=8))
    broken = engine.add([5, 6, 7], SamplingParams(max_tokens=8), matcher=BrokenMatcher())
    failed_beside: dict[int, set[int]] = {}  # failed sequence -> those given a token in its step
    for _ in range(100):
        if not engine.has_work():
            break
        events = engine.step()
        sampled = {event.seq.id for event in events if event.sampled is not None}
        for event in events:
            if event.finished and event.seq.finish_reason == "error":
                failed_beside[event.seq.id] = sampled
    assert [seq.output for seq in together] == [seq.output for seq in alone]
    assert all(seq.finish_reason == "length" for seq in together)
    both = {seq.id for seq in together}
    assert failed_beside == {nan.id: both, broken.id: both}  # failed in a step that sampled the others
    for seq, why in ((nan, "NaN"), (broken, "the grammar engine failed")):
        assert seq.finish_reason == "error" and seq.server_fault and seq.output == []
        assert seq.error is not None and "sampling failed" in seq.error and why in seq.error
    assert engine.allocator.used_fraction == 0


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_moe"])
def test_micro_batches_give_the_tokens_of_one_batch(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    """The same staggered run (chunked prefill mixed with decodes, greedy and seeded rows) with a
    step cut into 1, 2 and 3 pipelined micro-batches, and "auto" (trying each): the same tokens."""
    decoder = load_reference(tiny_checkpoints[family])
    params = [
        SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=7 + i)
        if i % 2
        else SamplingParams(max_tokens=n)
        for i, n in enumerate(NEW_TOKENS)
    ]
    outputs: dict[int | str, list[list[int]]] = {}
    for micro_batches in (1, 2, 3, "auto"):
        options = replace(options_for(decoder, 64), micro_batches=micro_batches)
        outputs[micro_batches] = [seq.output for seq in run_staggered(Engine(decoder, options), params)]
    assert outputs[2] == outputs[1] and outputs[3] == outputs[1] and outputs["auto"] == outputs[1]


def test_micro_batches_are_balanced_in_work_not_rows(tiny_checkpoints: dict[str, Path]) -> None:
    decodes = [row_work(1, 500, 64)] * 6
    prefill = row_work(40, 40, 64)
    groups = split_rows([prefill, *decodes], 2)
    assert groups == [[0], [1, 2, 3, 4, 5, 6]]  # a long chunk alone, the decodes together
    assert split_rows(decodes, 3) == [[0, 3], [1, 4], [2, 5]]
    assert split_rows(decodes[:2], 3) == [[0], [1]]  # never an empty micro-batch
    with pytest.raises(ValueError, match="micro_batches"):
        Engine(load_reference(tiny_checkpoints["mixtral"]), EngineOptions(micro_batches=4))
