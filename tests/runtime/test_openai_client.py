"""The official ``openai`` client against ``eaas attention-client``'s API: a checkpoint with its own
tokenizer (``tokenizer.json``) and chat template, over real expert-server processes.

Covers completions and chat, streamed and not, seeded sampling, stop strings, structured outputs
(``response_format``, ``parse()`` with a pydantic model, vLLM's ``structured_outputs``), a client
that hangs up, the template sandbox, and a fuzz test: no JSON body gets a 500 or a hang.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaas.runtime.client import ClientOptions
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import CheckpointReader, Decoder, load_reference, load_tokenizer
from eaas.runtime.placement import round_robin
from eaas.runtime.serving import harmony, responses
from eaas.runtime.serving.chat import ChatTemplate
from eaas.runtime.serving.http_api import ApiError
from eaas.runtime.serving.serve import AttentionService, ServeOptions, static_discovery

MODEL = "tiny-chat"
TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CORPUS = ["experts as a service on kubernetes", "mixture of experts serve tokens", "hello world"] * 40


@pytest.fixture(scope="module")
def checkpoint(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, train_tokenizer: Any
) -> Path:
    """The tiny mixtral checkpoint plus a byte-level BPE tokenizer of 300 ids and a chat template."""
    directory = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(tiny_checkpoints["mixtral"], directory)
    train_tokenizer(CORPUS).save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = CheckpointReader(checkpoint).config
    placement = round_robin(config.moe_layers, config.num_experts, 2, replication=1)
    workdir = tmp_path_factory.mktemp("cluster")
    with LocalCluster(checkpoint, placement, workdir, transports=("tcp",)) as running:
        yield running


def serve_options(**overrides: Any) -> ServeOptions:
    client = ClientOptions(transport="tcp", request_timeout_s=10.0)
    settings: dict[str, Any] = {"max_tokens": 64, **overrides}
    return ServeOptions(host="127.0.0.1", port=0, model_name=MODEL, client=client, **settings)


@contextmanager
def served(checkpoint: Path, cluster: LocalCluster, **overrides: Any) -> Iterator[Any]:
    """The official client of an attention service over the cluster, with ``serve_options(**overrides)``."""
    options = serve_options(**overrides)
    with AttentionService(checkpoint, cluster.placement_path, static_discovery(cluster.urls), options) as svc:
        yield openai.OpenAI(base_url=f"{svc.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def service(checkpoint: Path, cluster: LocalCluster) -> Iterator[AttentionService]:
    discovery = static_discovery(cluster.urls)
    with AttentionService(checkpoint, cluster.placement_path, discovery, serve_options()) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service: AttentionService) -> Any:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Decoder:
    return load_reference(checkpoint)


def test_the_checkpoint_tokenizer_is_used(checkpoint: Path) -> None:
    tokenizer = load_tokenizer(checkpoint, 320)
    ids = tokenizer.encode("experts as a service — ünïcode")
    assert max(ids) < 300 and len(ids) < len("experts as a service — ünïcode".encode())  # merges apply
    assert tokenizer.decode(ids) == "experts as a service — ünïcode"
    assert tokenizer.eos_token_ids == (2,)


def test_the_harmony_call_parser_needs_the_harmony_reasoning_parser(checkpoint: Path, tmp_path: Path) -> None:
    """The harmony tool-call parser reads the calls the harmony reasoning parser takes out of the
    channels: alone it would find none, so the server refuses to start."""
    options = serve_options(tool_call_parser="harmony", reasoning_parser="none")
    with pytest.raises(ValueError, match="reasoning-parser harmony"):
        AttentionService(checkpoint, tmp_path / "placement.json", static_discovery([]), options)


def test_a_tokenizer_of_another_kind_is_refused_not_replaced(tmp_path: Path) -> None:
    """A checkpoint whose tokenizer this server cannot read (Kimi-K2's tiktoken.model, a
    SentencePiece tokenizer.model) is refused by name; only a checkpoint without any tokenizer
    (a random one) gets the byte tokenizer."""
    assert load_tokenizer(tmp_path, 320).decode([104, 105]) == "hi"
    (tmp_path / "tiktoken.model").write_text("")
    with pytest.raises(ValueError, match=r"tiktoken\.model.*tokenizer\.json"):
        load_tokenizer(tmp_path, 320)


def test_completions_equal_the_reference(client: Any, checkpoint: Path, reference: Decoder) -> None:
    tokenizer = load_tokenizer(checkpoint, 320)
    answer = client.completions.create(model=MODEL, prompt="experts as", max_tokens=8, temperature=0)
    want, _ = reference.generate([tokenizer.encode("experts as")], 8)
    eos = want[0].index(2) if 2 in want[0] else len(want[0])
    assert answer.choices[0].text == tokenizer.decode(want[0][:eos])
    streamed = client.completions.create(
        model=MODEL, prompt="experts as", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == answer.choices[0].text


def test_chat_streamed_and_whole_agree(client: Any, checkpoint: Path, reference: Decoder) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    [choice] = whole.choices
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    tokenizer = load_tokenizer(checkpoint, 320)
    prompt = tokenizer.encode(ChatTemplate(TEMPLATE, {"bos_token": "<s>"}).render(messages))
    want, _ = reference.generate([prompt], 10)
    eos = want[0].index(2) if 2 in want[0] else len(want[0])
    assert choice.message.content == tokenizer.decode(want[0][:eos])
    pieces = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        else:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert "".join(pieces) == choice.message.content


def test_every_answer_names_the_model_revision(client: Any, checkpoint: Path, cluster: LocalCluster) -> None:
    """With a revision (blue/green: the operator sets it), every answer and every stream chunk
    says which revision served it, in OpenAI's ``system_fingerprint``; without one, none."""
    messages = [{"role": "user", "content": "hello"}]
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=2).system_fingerprint is None
    with served(checkpoint, cluster, model_revision="r7") as revised:
        answers = [
            revised.completions.create(model=MODEL, prompt="experts", max_tokens=4),
            revised.chat.completions.create(model=MODEL, messages=messages, max_tokens=4),
            *revised.completions.create(model=MODEL, prompt="experts", max_tokens=4, stream=True),
            *revised.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True),
        ]
    assert len(answers) > 4 and {a.system_fingerprint for a in answers} == {"r7"}


def test_seeded_chat_sampling_reproduces(client: Any) -> None:
    messages = [{"role": "user", "content": "tokens"}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2}
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    lp = client.chat.completions.create(**{**kwargs, "n": 1, "logprobs": True, "top_logprobs": 2})
    entries = lp.choices[0].logprobs.content
    assert entries and all(e.logprob <= 0 and len(e.top_logprobs) <= 2 for e in entries)


def test_a_stream_closed_early_frees_its_kv_cache(client: Any, service: AttentionService) -> None:
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=60, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    assert service.worker is not None
    deadline = time.monotonic() + 20
    while service.worker.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.worker.running == 0 and service.worker.kv_usage == 0.0


def test_errors_reach_the_client_as_openai_errors(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert "messages[0].role must be one of" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found" and "'gpt-5' does not exist" in str(missing.value)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as refused:  # mixtral has no tool-call format: refused
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[tool])
    assert refused.value.param == "tools" and "--tool-call-parser" in str(refused.value)
    shown = client.chat.completions.create(  # tools shown but never called: no format needed
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        tools=[tool],
        tool_choice="none",
        max_tokens=2,
    )
    assert shown.choices[0].message.tool_calls is None and shown.choices[0].finish_reason in (
        "stop",
        "length",
    )


ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}


class Answer(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    n: int = pydantic.Field(ge=0, le=9)


def test_structured_outputs_through_the_openai_client(client: Any) -> None:
    """The random model's sampled output always parses and validates; one choice per matcher."""
    messages = [{"role": "user", "content": "answer in JSON"}]
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    answers = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=1.0, seed=3, n=4, max_tokens=64, response_format=schema
    )
    for choice in answers.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
    parsed = client.chat.completions.parse(
        model=MODEL, messages=messages, temperature=1.0, seed=4, max_tokens=64, response_format=Answer
    )
    assert isinstance(parsed.choices[0].message.parsed, Answer)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=1.0,
        seed=5,
        max_tokens=64,
        response_format=schema,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), ANSWER)
    picked = client.completions.create(
        model=MODEL,
        prompt="pick one:",
        max_tokens=16,
        temperature=1.0,
        seed=1,
        n=6,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta gamma"]}},
    )
    assert {c.text for c in picked.choices} <= {"alpha", "beta gamma"}
    assert all(c.finish_reason == "stop" for c in picked.choices)


def test_malformed_structured_outputs_are_400s_naming_the_field(client: Any) -> None:
    messages = [{"role": "user", "content": "x"}]
    cases = [
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frob"}}},
            "response_format",
        ),
        ({"type": "yaml"}, "response_format.type"),
    ]
    for response_format, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=messages, response_format=response_format)
        assert refused.value.param == param, refused.value
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "(a"}})
    assert refused.value.param == "structured_outputs.regex"
    with pytest.raises(openai.BadRequestError) as refused:  # a language no token can start
        client.completions.create(
            model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}
        )
    assert refused.value.param == "structured_outputs.regex"


def test_api_keys_are_required_when_configured(checkpoint: Path, cluster: LocalCluster) -> None:
    """Two keys accepted (a rotation); a missing or wrong key is 401; probes and metrics stay open."""
    options = serve_options(api_keys=("old-key", "new-key"))
    with AttentionService(checkpoint, cluster.placement_path, static_discovery(cluster.urls), options) as svc:
        for key in ("old-key", "new-key"):
            api = openai.OpenAI(base_url=f"{svc.url}/v1", api_key=key, max_retries=0, timeout=30)
            assert api.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        for key in ("wrong", "old-key-and-more", ""):
            api = openai.OpenAI(base_url=f"{svc.url}/v1", api_key=key or "x", max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError, match="a valid API key is required"):
                api.models.list()
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        assert opener.open(f"{svc.url}/healthz", timeout=10).status == 200
        assert opener.open(f"{svc.url}/metrics", timeout=10).status == 200
    with pytest.raises(ValueError, match="api_keys: keys must not be empty"):
        AttentionService(
            checkpoint, cluster.placement_path, static_discovery(cluster.urls), serve_options(api_keys=(" ",))
        )


def test_a_request_larger_than_the_kv_cache_is_a_400(checkpoint: Path, cluster: LocalCluster) -> None:
    options = serve_options(kv_cache_bytes=2 * 16 * 768, block_size=16)  # 2 blocks: 32 positions
    with AttentionService(checkpoint, cluster.placement_path, static_discovery(cluster.urls), options) as svc:
        api = openai.OpenAI(base_url=f"{svc.url}/v1", api_key="x", max_retries=0, timeout=30)
        # The context a request may fill is the cache's 32 positions, not the model's context.
        with pytest.raises(openai.BadRequestError, match=r"max_tokens: must be an integer in \[1, 31\]"):
            api.completions.create(model=MODEL, prompt="hi", max_tokens=40)
        with pytest.raises(
            openai.BadRequestError, match="exceeds the context of 32 tokens this server gives"
        ):
            api.completions.create(model=MODEL, prompt="experts as a service", max_tokens=31)
        assert api.completions.create(model=MODEL, prompt="hi", max_tokens=8).usage.completion_tokens == 8


def test_templates_run_sandboxed() -> None:
    hostile = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ApiError, match="messages: the chat template refused them"):
        hostile.render([{"role": "user", "content": "x"}])
    strict = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(ApiError, match="user first"):
        strict.render([{"role": "system", "content": "x"}])


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = st.sampled_from(
    ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop", "seed",
     "logprobs", "top_logprobs", "echo", "presence_penalty", "stream_options", "stop_token_ids", "model",
     "max_completion_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
     "guided_choice", "guided_grammar", "tools", "tool_choice"]
)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(_FIELDS, _JSON, max_size=6), chat=st.booleans())
def test_no_body_gets_a_500_or_a_hang(service: AttentionService, body: dict[str, Any], chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if "stream" in body:
        body["stream"] = False  # the fuzz reads whole answers; streams are covered above
    body["max_tokens"] = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) else 4
    request = urllib.request.Request(
        f"{service.url}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=30) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    unknown_model = isinstance(body.get("model"), str) and body["model"] != MODEL
    assert status in ((404, 400) if unknown_model else (200, 400)), (status, body)


def test_eaas_serve_serves_a_preset_until_interrupted(tmp_path: Path) -> None:
    """The README's first command, as a process: expert servers + API, then Ctrl-C stops all."""
    import os
    import signal
    import subprocess
    import sys

    ready = tmp_path / "ready.json"
    command = [
        sys.executable, "-m", "eaas.runtime.cli", "serve", "--preset", "qwen3_moe/tiny", "--port", "0",
        "--servers", "2", "--replication", "2", "--transport", "tcp", "--ready-file", str(ready),
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ)
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            assert time.monotonic() < deadline, "eaas serve did not start"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}/v1"
        api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        [model] = api.models.list().data
        assert model.id == "qwen3_moe/tiny"
        answer = api.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
        )
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5
        response = api.responses.create(model=model.id, input="hi", max_output_tokens=5, temperature=0)
        assert response.status == "incomplete" and response.usage.output_tokens == 5
        root = url.removesuffix("/v1")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{root}/health", timeout=10) as health:  # what GuideLLM probes
            assert health.status == 200 and json.loads(health.read())["ready"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        output = process.stdout.read().decode() if process.stdout else ""
        assert "serving qwen3_moe/tiny" in output and "expert server 1" in output and "stopped" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Oslo", "Rome"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "boolean"},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tool_client(checkpoint: Path, cluster: LocalCluster) -> Iterator[Any]:
    """The same model served with ``--tool-call-parser hermes --reasoning-parser qwen3
    --structured-outputs-in-reasoning``: the grammars below hold from the first token, so that the
    random model, which would not close a free thinking, writes what they allow (one of them
    writes a short thinking itself)."""
    with served(
        checkpoint,
        cluster,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        structured_outputs_in_reasoning=True,
        max_tokens=256,
    ) as client:
        yield client


def required_calls_validate(client: Any, messages: list[dict[str, Any]], seed: int) -> Any:
    """Four sampled answers with ``tool_choice: required`` and one call each: every call names a
    tool and its arguments validate. Returns the answer."""
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=seed, n=4, max_tokens=256,
    )  # fmt: skip
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return answer


def streamed_tool_calls(stream: Any) -> list[Any]:
    """The tool-call deltas of a streamed answer that finished with ``tool_calls``."""
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and deltas
    return deltas


def test_required_and_named_tool_calls_always_parse(tool_client: Any) -> None:
    """The random model, sampled, makes calls that name a tool and whose arguments validate."""
    messages = [{"role": "user", "content": "what is the weather?"}]
    answer = required_calls_validate(tool_client, messages, seed=11)
    named = tool_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=1.0, seed=12, max_tokens=256,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    calls = named.choices[0].message.tool_calls
    assert calls and all(c.function.name == "add" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS["add"])
    stream = tool_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", temperature=1.0, seed=13,
        max_tokens=256, stream=True,
    )  # fmt: skip
    for delta in streamed_tool_calls(stream):
        jsonschema.validate(json.loads(delta.function.arguments), SCHEMAS[delta.function.name])
    # the call and its result go back into the conversation
    followed = tool_client.chat.completions.create(
        model=MODEL,
        messages=[
            *messages,
            answer.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": answer.choices[0].message.tool_calls[0].id, "content": "sunny"},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=4,
    )
    assert followed.choices[0].message.tool_calls is None


def test_tool_requests_that_cannot_be_kept_are_400s(tool_client: Any) -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as refused:
        tool_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert refused.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as refused:
        tool_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert refused.value.param == "tool_choice"
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]
    with pytest.raises(openai.BadRequestError) as refused:  # its schema cannot constrain a call
        tool_client.chat.completions.create(
            model=MODEL, messages=messages, tools=broken, tool_choice="required"
        )
    assert refused.value.param == "tools" and "frob" in str(refused.value)


def test_thinking_is_told_from_the_answer_and_calls_are_read_from_the_answer(tool_client: Any) -> None:
    """A regex makes the random model think, then answer (or call a tool): reasoning_content
    (and reasoning) carry the thinking, whole and streamed, and the call is found after it."""
    messages = [{"role": "user", "content": "think first"}]
    thinking = {"structured_outputs": {"regex": "<think>\\n[a-z]{2,6}\\n</think>\\n\\n(yes|no)"}}
    whole = (
        tool_client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, seed=2, max_tokens=64, extra_body=thinking
        )
        .choices[0]
        .message
    )
    assert whole.content in ("yes", "no") and whole.reasoning_content.isalpha()
    assert whole.reasoning == whole.reasoning_content
    stream = tool_client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=1.0,
        seed=2,
        max_tokens=64,
        extra_body=thinking,
        stream=True,
    )
    reasoning = content = ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning.strip(), content) == (whole.reasoning_content, whole.content)  # same seed
    call = '<tool_call>\\n\\{"name": "add", "arguments": \\{"a": 7, "b": true\\}\\}\\n</tool_call>'
    forced = {"structured_outputs": {"regex": f"<think>\\n[a-z]{{2,6}}\\n</think>\\n\\n{call}"}}
    answer = tool_client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        temperature=1.0,
        seed=3,
        max_tokens=128,
        extra_body=forced,
    ).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.reasoning_content.isalpha()
    assert [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls] == [
        ("add", {"a": 7, "b": True})
    ]


def test_a_reasoning_models_grammar_holds_after_its_thinking(checkpoint: Path, cluster: LocalCluster) -> None:
    """By default a reasoning model (here ``--reasoning-parser qwen3``) may think before its
    grammar starts. The random model, free to open a thinking or answer at once, does both over
    a few seeds: the answers keep the grammar; the thinkers never close it within max_tokens,
    their output all reasoning (what a real model would follow with a constrained answer)."""
    with served(checkpoint, cluster, reasoning_parser="qwen3", max_tokens=64) as client:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "yes or no?"}], temperature=1.0, seed=5,
            n=12, max_tokens=48, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )  # fmt: skip
        kinds = set()
        for choice in answer.choices:
            if choice.finish_reason == "stop":
                assert choice.message.content in ("yes", "no"), choice.message
                kinds.add("answered")
            else:
                assert choice.finish_reason == "length" and not choice.message.content
                assert choice.message.reasoning_content, choice.message
                kinds.add("thinking")
        assert kinds == {"answered", "thinking"}


def test_glm45_calls_through_the_openai_client(checkpoint: Path, cluster: LocalCluster) -> None:
    """``--tool-call-parser glm45`` (what a GLM-4.5 checkpoint gets by its family): required and
    named calls, whole and streamed, always parse and validate, though the random model writes
    the arguments; the city's enum is written as text, the days as JSON."""
    with served(checkpoint, cluster, tool_call_parser="glm45", max_tokens=256) as client:
        messages = [{"role": "user", "content": "what is the weather?"}]
        required_calls_validate(client, messages, seed=21)
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, temperature=1.0, seed=22, max_tokens=256,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
        )  # fmt: skip
        for delta in streamed_tool_calls(stream):
            assert delta.function.name == "get_weather"
            jsonschema.validate(json.loads(delta.function.arguments), SCHEMAS["get_weather"])


def test_a_chat_without_max_tokens_runs_to_the_context_or_the_servers_default() -> None:
    """OpenAI's and vLLM's default (the rest of the context), and ``--default-max-tokens``."""
    from eaas.runtime.serving.chat import parse_chat
    from eaas.runtime.serving.http_api import Limits

    template = ChatTemplate(TEMPLATE, {"bos_token": "<s>"})
    body = {"messages": [{"role": "user", "content": "hi"}]}

    def encode(text: str) -> list[int]:
        return list(text.encode())

    prompt = len(encode(template.render(body["messages"])))
    unbounded = parse_chat(body, Limits(256, 512, 1024), template, encode)[0]
    assert unbounded.params.max_tokens == 512 - prompt
    bounded = parse_chat(body, Limits(256, 512, 1024, default_max_tokens=32), template, encode)[0]
    assert bounded.params.max_tokens == 32
    asked = parse_chat({**body, "max_tokens": 100}, Limits(256, 512, 1024, 32), template, encode)[0]
    assert asked.params.max_tokens == 100  # the default is only a default


def test_chat_fields_sent_as_null_or_false_count_as_not_set() -> None:
    """Clients that serialise every field send nulls: a null max_completion_tokens leaves
    max_tokens in force, and null or false chat-inapplicable fields are not refused."""
    from eaas.runtime.serving.chat import parse_chat
    from eaas.runtime.serving.http_api import Limits

    template = ChatTemplate(TEMPLATE, {"bos_token": "<s>"})
    messages = [{"role": "user", "content": "hi"}]

    def encode(text: str) -> list[int]:
        return list(text.encode())

    body = {
        "messages": messages,
        "max_completion_tokens": None,
        "max_tokens": 5,
        "prompt": None,
        "echo": False,
    }
    assert parse_chat(body, Limits(256, 512, 64), template, encode)[0].params.max_tokens == 5
    with pytest.raises(ApiError, match="echo"):
        parse_chat({"messages": messages, "echo": True}, Limits(256, 512, 64), template, encode)
    with pytest.raises(ApiError, match="ignore_eos: must be true or false"):
        parse_chat({"messages": messages, "ignore_eos": "false"}, Limits(256, 512, 64), template, encode)


THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% if reasoning_effort %} (effort {{ reasoning_effort }}){% endif %}"
)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs.bos_token"),
        ({"chat_template_kwargs": {"range": "x"}}, "chat_template_kwargs.range"),
        ({"chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs.raise_exception"),
        ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
    ],
)
def test_bad_template_variables_are_400s_naming_them(fields: dict[str, Any], param: str) -> None:
    from eaas.runtime.serving.chat import parse_chat
    from eaas.runtime.serving.http_api import Limits

    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ApiError) as caught:
        parse_chat(
            body, Limits(256, 512, 64), ChatTemplate(THINKING_TEMPLATE), lambda text: list(text.encode())
        )
    assert caught.value.param == param


def test_template_variables_reach_the_template_and_switch_thinking_off() -> None:
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking) and OpenAI's reasoning_effort
    (gpt-oss's template reads it) are variables of the template; thinking switched off there means
    the answer is not split into reasoning."""
    from eaas.runtime.serving.chat import parse_chat
    from eaas.runtime.serving.http_api import Limits

    template = ChatTemplate(THINKING_TEMPLATE)
    body = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}

    def prompt(**fields: Any) -> tuple[str, bool]:
        call = parse_chat(
            {**body, **fields}, Limits(256, 512, 64), template, lambda text: list(text.encode())
        )[0]
        return bytes(call.prompts[0]).decode(), call.thinking

    assert prompt() == ("user: hi\nassistant: (effort low)", True)
    off = prompt(chat_template_kwargs={"enable_thinking": False})
    assert off == ("user: hi\nassistant:<think></think> (effort low)", False)
    assert prompt(chat_template_kwargs={"enable_thinking": True})[1] is True


def test_thinking_switched_off_comes_back_as_content(tool_client: Any) -> None:
    """Served with ``--reasoning-parser qwen3``: an answer with thinking switched off by the
    request is all content, even where it reads like thinking."""
    forced = {"structured_outputs": {"regex": "<think>\n[a-z]{2,6}\n</think>\n\n(yes|no)"}}
    messages = [{"role": "user", "content": "no thinking"}]
    thinking = (
        tool_client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, seed=4, max_tokens=32, extra_body=forced
        )
        .choices[0]
        .message
    )
    assert thinking.reasoning_content and thinking.content in ("yes", "no")
    off = {**forced, "chat_template_kwargs": {"enable_thinking": False}}
    answer = (
        tool_client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, seed=4, max_tokens=32, extra_body=off
        )
        .choices[0]
        .message
    )
    assert answer.content.startswith("<think>") and not getattr(answer, "reasoning_content", None)


HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] or '' }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def harmony_client(
    checkpoint: Path, cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """The model with gpt-oss's markers as special tokens of its tokenizer (``<|call|>`` and
    ``<|return|>`` its end-of-sequence ids), served with ``--reasoning-parser harmony
    --tool-call-parser harmony`` (what a gpt-oss checkpoint gets by its family), grammars from the
    first token: a random model would not end a free analysis."""
    from tokenizers import Tokenizer

    directory = tmp_path_factory.mktemp("harmony") / "ckpt"
    shutil.copytree(checkpoint, directory)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tokenizer.add_special_tokens(list(harmony.MARKERS))
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|return|>", "chat_template": HARMONY_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ends = [tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    with served(
        directory,
        cluster,
        tool_call_parser="harmony",
        reasoning_parser="harmony",
        structured_outputs_in_reasoning=True,
        max_tokens=128,
    ) as client:
        yield client


def test_harmony_channels_and_calls_through_the_openai_client(harmony_client: Any) -> None:
    """gpt-oss's output, written by the random model under a grammar of harmony's special tokens:
    the analysis channel comes back as reasoning_content, a message to functions.add as a tool
    call whose arguments validate (whole and streamed), a final message as the content."""
    messages = [{"role": "user", "content": "add them"}]
    analysis = '<|channel|> "analysis" <|message|> /[a-z]{2,8}/ <|end|> <|start|> "assistant" '
    arguments = json.dumps(SCHEMAS["add"])
    call = f'<|channel|> "commentary to=functions.add " <|constrain|> "json" <|message|> %json {arguments}'
    call += " <|call|>"
    calling = {"structured_outputs": {"grammar": f"start: {analysis}{call}"}}
    answer = harmony_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=1.0, seed=31, n=3, extra_body=calling
    )
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.reasoning_content.isalpha() and not choice.message.content
        (made,) = choice.message.tool_calls
        assert made.function.name == "add"
        jsonschema.validate(json.loads(made.function.arguments), SCHEMAS["add"])
    stream = harmony_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=1.0, seed=31, extra_body=calling, stream=True
    )
    reasoning, deltas, finish = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    first = answer.choices[0].message
    assert (finish, reasoning) == ("tool_calls", first.reasoning_content)  # the same seed
    assert [d.function.arguments for d in deltas] == [first.tool_calls[0].function.arguments]
    final = {
        "structured_outputs": {"grammar": f'start: {analysis}<|channel|> "final" <|message|> ("yes" | "no")'}
    }
    answer = harmony_client.chat.completions.create(
        model=MODEL, messages=messages, temperature=1.0, seed=32, max_tokens=64, extra_body=final
    )
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "stop" and message.content in ("yes", "no"), message
    assert message.reasoning_content.isalpha() and "<|" not in message.content + message.reasoning_content


# --- the Responses API ----------------------------------------------------------------------------
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # Responses' flat shape


def test_responses_answer_as_the_chat_path(client: Any) -> None:
    """``instructions`` + ``input`` are the chat's system and user messages; the text, the usage
    and a cut-short answer's status are those of the chat answer."""
    response = client.responses.create(
        model=MODEL, instructions="be brief", input="experts", max_output_tokens=6, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=6,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "experts"}],
    )
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 6 and response.usage.total_tokens == chat.usage.total_tokens
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    as_list = client.responses.create(
        model=MODEL,
        max_output_tokens=6,
        temperature=0,
        input=[
            {"role": "system", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "experts"}]},
        ],
    )
    assert as_list.output_text == response.output_text


def test_responses_stream_the_events_the_openai_client_reads(client: Any) -> None:
    whole = client.responses.create(model=MODEL, input="experts", max_output_tokens=8, temperature=0)
    events = list(
        client.responses.create(model=MODEL, input="experts", max_output_tokens=8, temperature=0, stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.id == events[0].response.id
    assert events[-1].response.usage.output_tokens == 8
    # the client's stream helper accumulates the same answer (a grammar ends it: completed)
    schema = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    with client.responses.stream(
        model=MODEL,
        input="answer in JSON",
        max_output_tokens=64,
        temperature=1.0,
        text={"format": schema},
        extra_body={"seed": 3},
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), ANSWER)


def test_responses_structured_output_is_the_chat_paths(client: Any) -> None:
    """``text.format`` json_schema (and ``parse`` with a pydantic model) and json_object."""
    schema = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    for seed in (3, 4):
        response = client.responses.create(
            model=MODEL,
            input="answer in JSON",
            max_output_tokens=64,
            temperature=1.0,
            text={"format": schema},
            extra_body={"seed": seed},
        )
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "answer in JSON"}],
            max_tokens=64,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {k: v for k, v in schema.items() if k != "type"},
            },
        )
        assert response.status == "completed" and response.output_text == chat.choices[0].message.content
        jsonschema.validate(json.loads(response.output_text), ANSWER)
    parsed = client.responses.parse(
        model=MODEL,
        input="answer in JSON",
        max_output_tokens=64,
        temperature=1.0,
        text_format=Answer,
        extra_body={"seed": 5},
    )
    assert isinstance(parsed.output_parsed, Answer)
    loose = client.responses.create(
        model=MODEL,
        input="JSON",
        max_output_tokens=48,
        temperature=1.0,
        text={"format": {"type": "json_object"}},
        extra_body={"seed": 6},
    )
    if loose.status == "completed":  # a free JSON object may run past the bound; a finished one parses
        assert isinstance(json.loads(loose.output_text), dict)


def test_responses_call_function_tools(tool_client: Any) -> None:
    """Function tools become ``function_call`` items (whole and streamed) whose arguments validate;
    the calls and their outputs go back as input items."""
    question = [{"role": "user", "content": "what is the weather?"}]
    response = tool_client.responses.create(
        model=MODEL,
        input=question,
        tools=RESPONSE_TOOLS,
        tool_choice="required",
        temperature=1.0,
        max_output_tokens=256,
        extra_body={"seed": 11},
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    for call in calls:
        assert call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    named = tool_client.responses.create(
        model=MODEL,
        input=question,
        tools=RESPONSE_TOOLS,
        tool_choice={"type": "function", "name": "add"},
        temperature=1.0,
        max_output_tokens=256,
        extra_body={"seed": 12},
    )
    assert {item.name for item in named.output if item.type == "function_call"} == {"add"}
    with tool_client.responses.stream(
        model=MODEL,
        input=question,
        tools=RESPONSE_TOOLS,
        tool_choice="required",
        temperature=1.0,
        max_output_tokens=256,
        extra_body={"seed": 11},
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [(c.name, c.arguments) for c in streamed.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]  # the same seed: the same calls
    follow_up = [
        *question,
        *(
            {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
            for c in calls
        ),
        *({"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls),
    ]
    answer = tool_client.responses.create(
        model=MODEL,
        input=follow_up,
        tools=RESPONSE_TOOLS,
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    assert answer.usage.input_tokens > response.usage.input_tokens


def test_a_responses_stream_closed_early_frees_its_kv_cache(client: Any, service: AttentionService) -> None:
    stream = client.responses.create(
        model=MODEL, input="hello", max_output_tokens=60, temperature=0, stream=True
    )
    events = iter(stream)
    kinds = [next(events).type for _ in range(3)]  # the third follows the first text
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added"]
    stream.close()
    assert service.worker is not None
    deadline = time.monotonic() + 20
    while service.worker.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.worker.running == 0 and service.worker.kv_usage == 0.0


def test_reasoning_items_sent_back_reach_the_template_as_the_assistants_thinking() -> None:
    """An earlier answer's items as the next input (what agent loops send): the reasoning item
    becomes the reasoning_content of the assistant message its calls make."""
    calls = [
        {"type": "function_call", "call_id": f"call_{i}", "name": "add", "arguments": "{}"} for i in (1, 2)
    ]
    body = {
        "input": [
            {"role": "user", "content": "add"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            *calls,
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": [{"type": "input_text", "text": "3"}],
            },
        ]
    }
    messages = responses.chat_body(body)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["reasoning_content"] == "hm" and len(messages[1]["tool_calls"]) == 2
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "3"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_unsupported_responses_features_are_400s_naming_the_field(
    client: Any, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "x", "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/responses", body=body, cast_to=dict)
    assert refused.value.param == param, refused.value
