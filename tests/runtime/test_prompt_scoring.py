"""Scoring prompts over the disaggregated path, as lm-evaluation-harness's ``local-completions``
loglikelihood tasks ask for it (``echo``, ``logprobs``, ``max_tokens`` 0 or 1): the official
``openai`` client against ``AttentionService`` over real expert-server processes, equal to the
monolithic reference's ``log_softmax`` at every prompt position, also when an expert server is
SIGKILLed in the middle of the scoring requests (failover to its replicas: no request fails)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from eaas.runtime.client import ClientOptions
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.local.session import StepHook
from eaas.runtime.model import CheckpointReader, Decoder, load_reference, load_tokenizer
from eaas.runtime.placement import round_robin
from eaas.runtime.serving.serve import AttentionService, ServeOptions, static_discovery

MODEL = "tiny-scorer"
FAMILY = "deepseek_v3"  # dense layer + shared expert + grouped routing: the most moving parts
CORPUS = ["experts as a service on kubernetes", "mixture of experts serve tokens", "hello world"] * 40
CONTEXTS = ["experts as a", "mixture of", "hello", "serve tokens on kubernetes and"]
CONTINUATIONS = [" service", " experts serve", " world", " hello world experts"]


@pytest.fixture(scope="module")
def checkpoint(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, train_tokenizer: Any
) -> Path:
    directory = tmp_path_factory.mktemp("scoring") / "ckpt"
    shutil.copytree(tiny_checkpoints[FAMILY], directory)
    train_tokenizer(CORPUS).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 3, replication=2)
    with LocalCluster(
        checkpoint, placement, tmp_path_factory.mktemp("cluster"), transports=("tcp",)
    ) as running:
        yield running


@pytest.fixture(scope="module")
def service(checkpoint: Path, cluster: LocalCluster) -> Iterator[AttentionService]:
    # Chunks of 8 tokens: a prompt is scored over several steps, mixed with the others'.
    client = ClientOptions(transport="tcp", request_timeout_s=5.0, rejoin_min_s=0.1, rejoin_max_s=0.5)
    options = ServeOptions(
        host="127.0.0.1", port=0, model_name=MODEL, client=client, max_tokens=16, max_batch_tokens=8
    )
    with AttentionService(checkpoint, cluster.placement_path, static_discovery(cluster.urls), options) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service: AttentionService) -> Any:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Decoder:
    return load_reference(checkpoint)


def reference_logprobs(reference: Decoder, ids: list[int]) -> list[float]:
    """The log-probability of each token of ``ids`` after the first, from one monolithic pass."""
    tokens = torch.tensor([ids])
    logits = reference.forward(
        tokens, torch.tensor([len(ids)]), reference.new_cache(1, len(ids)), all_logits=True
    )
    logprobs = torch.log_softmax(logits[0, :-1].to(torch.float32), dim=-1)  # [P - 1, V]
    return logprobs.gather(1, tokens[0, 1:, None])[:, 0].tolist()


def assert_scored(choice: Any, ids: list[int], reference: Decoder) -> None:
    got = choice.logprobs.token_logprobs[: len(ids)]
    assert got[0] is None and choice.logprobs.top_logprobs[0] is None
    assert got[1:] == pytest.approx(reference_logprobs(reference, ids), abs=1e-4)


def test_the_openai_client_scores_a_prompt(client: Any, checkpoint: Path, reference: Decoder) -> None:
    tokenizer = load_tokenizer(checkpoint, 320)
    text = CONTEXTS[0] + CONTINUATIONS[0]
    ids = tokenizer.encode(text)
    answer = client.completions.create(
        model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    [choice] = answer.choices
    assert choice.text == text and choice.finish_reason == "length"
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]
    assert_scored(choice, ids, reference)
    for token, logprob, top in zip(
        logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
    ):
        assert top[token] == logprob and 1 <= len(top) <= 2  # the token itself, and the likeliest
    scored = choice.model_extra["prompt_logprobs"]  # vLLM's: token id (a JSON key) -> its entry
    assert scored[0] is None
    assert [
        entry[str(t)]["logprob"] for entry, t in zip(scored[1:], ids[1:], strict=True)
    ] == logprobs.token_logprobs[1:]

    # The same prompt as token ids, and vLLM's prompt_logprobs without echo (the OpenAI client
    # passes it through extra_body).
    by_ids = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    again = by_ids.choices[0].logprobs
    assert again.tokens == logprobs.tokens and again.text_offset == logprobs.text_offset
    assert again.token_logprobs[0] is None and again.token_logprobs[1:] == pytest.approx(
        logprobs.token_logprobs[1:], abs=1e-4
    )
    plain = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    assert plain.choices[0].logprobs is None
    entries = plain.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(entry) == 1 for entry in entries[1:])  # the token's own alone
    got = [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:], strict=True)]
    assert got == pytest.approx(reference_logprobs(reference, ids), abs=1e-4)


def harness_loglikelihood(client: Any, tokenizer: Any, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-evaluation-harness's ``local-completions`` does for one loglikelihood request: the
    tokens of context + continuation, ``max_tokens`` 1, and the continuation's part of the echoed
    ``token_logprobs`` (the last entry is the generated token's), greedy if each token was the
    likeliest."""
    context_ids = tokenizer.encode(context)
    ids = context_ids + tokenizer.encode(continuation)
    answer = client.completions.create(
        model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    logprobs = answer.choices[0].logprobs
    tokens_logprobs = logprobs.token_logprobs[len(context_ids) : -1]
    tops = logprobs.top_logprobs[len(context_ids) : -1]
    assert len(tokens_logprobs) == len(ids) - len(context_ids)
    return sum(tokens_logprobs), all(
        lp == max(top.values()) for lp, top in zip(tokens_logprobs, tops, strict=True)
    )


@pytest.mark.slow
def test_scoring_survives_an_expert_server_killed_mid_run(
    client: Any, checkpoint: Path, reference: Decoder, service: AttentionService, cluster: LocalCluster
) -> None:
    """Server 1 is SIGKILLed when the engine's 6th step reaches the first MoE layer (the scoring
    requests run concurrently, their prompts in chunks of 8): every request is answered, with the
    reference's log-probabilities."""
    tokenizer = load_tokenizer(checkpoint, 320)
    pairs = [(c, x) for c in CONTEXTS for x in CONTINUATIONS]  # 16 requests
    want, want_greedy = [], []
    for context, continuation in pairs:
        context_ids = tokenizer.encode(context)
        ids = context_ids + tokenizer.encode(continuation)
        want.append(sum(reference_logprobs(reference, ids)[len(context_ids) - 1 :]))
        logits = reference.forward(
            torch.tensor([ids]), torch.tensor([len(ids)]), reference.new_cache(1, len(ids)), True
        )
        want_greedy.append(
            logits[0, len(context_ids) - 1 : -1].argmax(-1).tolist() == ids[len(context_ids) :]
        )
    assert service.decoder is not None and service.experts is not None
    failovers = service.experts.counters.failovers
    first_moe = service.config.moe_layers[0]
    service.decoder.experts = StepHook(
        service.decoder.experts, first_moe, lambda step: cluster.kill(1) if step == 5 else None
    )
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda pair: harness_loglikelihood(client, tokenizer, *pair), pairs))
    assert not cluster.is_alive(1)
    assert service.experts.counters.failovers > failovers  # the kill was found and failed over
    assert [total for total, _ in got] == pytest.approx(want, abs=1e-3)
    assert [greedy for _, greedy in got] == want_greedy
