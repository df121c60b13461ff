"""lm-evaluation-harness, unmodified, against ``eaas serve``: ``local-completions`` and
``local-chat-completions`` on a tiny local task (``lm_eval_tasks/``: multiple-choice items and
``generate_until`` items; nothing from a hub). The harness's numbers are checked against the
monolithic reference model of the same weights: every loglikelihood it got, every greedy answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from eaas.runtime.model import ByteTokenizer, Decoder
from tools.tool_helpers import Served, run_tool, tokenize_chat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

TASKS = Path(__file__).parent / "lm_eval_tasks"
MAX_GEN_TOKS = 8  # eaas_tiny_gen.yaml
UNTIL = "\n"
BYTES = ByteTokenizer(256)  # the preset's tokenizer (eaas model tokenizer writes the same)


def lm_eval(
    venv: Path, served: Served, model: str, endpoint: str, tasks: str, out: Path, *extra: str
) -> Path:
    model_args = (
        f"model={served.model},base_url={served.url}{endpoint},tokenizer={served.tokenizer},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    )
    command = [
        str(venv / "bin" / "lm-eval"), "run", "--model", model, "--model_args", model_args,
        "--tasks", tasks, "--include_path", str(TASKS), "--output_path", str(out), "--log_samples", *extra,
    ]  # fmt: skip
    run_tool(command, cwd=TASKS, home=out)  # cwd: the tasks' data_files are relative to it
    [results_dir] = [p for p in out.iterdir() if p.is_dir() and p.name != "hf"]
    return results_dir


def samples(results_dir: Path, task: str) -> list[dict[str, Any]]:
    [path] = results_dir.glob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def results(results_dir: Path) -> dict[str, Any]:
    [path] = results_dir.glob("results_*.json")
    return json.loads(path.read_text())["results"]


def reference_loglikelihood(reference: Decoder, context: str, continuation: str) -> tuple[float, bool]:
    """log P(continuation | context) and whether greedy decoding would produce it."""
    context_ids, ids = BYTES.encode(context), BYTES.encode(context + continuation)
    tokens = torch.tensor([ids])  # [1, S]
    cache = reference.new_cache(1, len(ids))
    logits = reference.forward(tokens, torch.tensor([len(ids)]), cache, all_logits=True)[0]  # [S, V]
    logprobs = torch.log_softmax(logits.double(), dim=-1)  # [S, V]
    positions = range(len(context_ids) - 1, len(ids) - 1)  # the logits that predict each continuation token
    total = sum(float(logprobs[p, ids[p + 1]]) for p in positions)
    greedy = all(int(logprobs[p].argmax()) == ids[p + 1] for p in positions)
    return total, greedy


def reference_answer(reference: Decoder, prompt_ids: list[int]) -> str:
    """The greedy answer the server must give: MAX_GEN_TOKS tokens, cut before the stop string."""
    [generated], _ = reference.generate([prompt_ids], MAX_GEN_TOKS)
    return BYTES.decode(generated).split(UNTIL)[0]


def test_local_completions_loglikelihoods_and_answers_match_the_reference(
    tool_venv: Path, served: Served, reference: Decoder, tmp_path: Path
) -> None:
    out = lm_eval(
        tool_venv, served, "local-completions", "/v1/completions", "eaas_tiny_mc,eaas_tiny_gen", tmp_path
    )
    mc = samples(out, "eaas_tiny_mc")
    assert len(mc) == 3
    correct = 0
    for sample in mc:
        requests = sample["arguments"]
        # Per choice: [loglikelihood, is_greedy], as the sample log writes them (strings).
        answers = [(float(resp[0][0]), resp[0][1] == "True") for resp in sample["resps"]]
        assert len(answers) == len(requests) == len(sample["doc"]["choices"])
        expected = []
        for request, (loglikelihood, is_greedy) in zip(requests.values(), answers, strict=True):
            context, continuation = request["arg_0"], request["arg_1"]
            want, want_greedy = reference_loglikelihood(reference, context, continuation)
            assert loglikelihood == pytest.approx(want, abs=1e-4), (context, continuation)
            assert is_greedy == want_greedy, (context, continuation)
            expected.append(want)
        right = max(range(len(expected)), key=expected.__getitem__) == int(sample["target"])
        assert sample["acc"] == float(right), sample
        correct += int(right)
    assert results(out)["eaas_tiny_mc"]["acc,none"] == pytest.approx(correct / len(mc))

    gen = samples(out, "eaas_tiny_gen")
    assert len(gen) == 2
    matches = 0
    for sample in gen:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        want = reference_answer(reference, BYTES.encode(prompt))
        assert sample["resps"][0][0] == want, prompt
        matches += int(want == sample["target"])
    assert results(out)["eaas_tiny_gen"]["exact_match,none"] == pytest.approx(matches / len(gen))


def test_local_chat_completions_answers_match_the_reference(
    tool_venv: Path, served: Served, reference: Decoder, tmp_path: Path
) -> None:
    out = lm_eval(
        tool_venv, served, "local-chat-completions", "/v1/chat/completions", "eaas_tiny_gen", tmp_path,
        "--apply_chat_template",
    )  # fmt: skip
    gen = samples(out, "eaas_tiny_gen")
    assert len(gen) == 2
    matches = 0
    for sample in gen:
        [rendered] = sample["arguments"]["gen_args_0"]["arg_0"]  # the sample log's JSON of the messages
        messages = json.loads(rendered)
        assert messages[-1]["role"] == "user" and messages[-1]["content"] == sample["doc"]["question"]
        prompt_ids = tokenize_chat(served, messages)  # as the server's chat template renders it
        want = reference_answer(reference, prompt_ids)
        assert sample["resps"][0][0] == want, messages
        matches += int(want == sample["target"])
    assert results(out)["eaas_tiny_gen"]["exact_match,none"] == pytest.approx(matches / len(gen))
