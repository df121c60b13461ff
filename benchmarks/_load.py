"""The load generator the serving benchmarks share: seeded Poisson requests sent over HTTP to an
attention-client process (``eaas attention-client``, as a pod runs it) in front of a
``LocalCluster``, and the model they serve.

Requests are ``(arrival offset s, prompt ids, max_tokens)`` with prompt and output lengths drawn
uniformly from ``PROMPT_LEN`` and ``OUTPUT_LEN``; every run with the same seed gets the same
requests at the same times.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import MoEConfig, preset

PROMPT_LEN = (8, 48)
OUTPUT_LEN = (8, 64)


def workload(
    count: int,
    rate: float,
    seed: int,
    vocab: int,
    system_len: int = 0,
    prompt_len: tuple[int, int] = PROMPT_LEN,
    output_len: tuple[int, int] = OUTPUT_LEN,
) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt ids, max_tokens) per request. With ``system_len``, every prompt
    starts with the same ``system_len`` tokens (a shared system prompt), then its own."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(system_len)]
    arrival = 0.0
    requests = []
    for _ in range(count):
        arrival += rng.expovariate(rate)
        prompt = system + [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))]
        requests.append((arrival, prompt, rng.randint(*output_len)))
    return requests


def send(url: str, prompt: list[int], max_tokens: int, streaming: bool) -> dict[str, Any]:
    """One request; returns its timings and tokens."""
    host, port = url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": streaming}
    start = time.monotonic()
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    first: float | None = None
    tokens: list[int] = []
    text = ""
    if streaming:
        chunks = 0
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            item = json.loads(line[6:])
            if "error" in item:
                raise RuntimeError(item["error"])
            first = first or time.monotonic()
            chunks += len(item["choices"])
            text += "".join(choice["text"] for choice in item["choices"])
        count = chunks - 1  # the last chunk of a choice carries its finish reason, no token
    else:
        answer = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(answer)
        tokens = answer["choices"][0]["token_ids"]
        text = answer["choices"][0]["text"]
        count = len(tokens)
        first = time.monotonic()
    end = time.monotonic()
    connection.close()
    return {"start": start, "first": first, "end": end, "tokens": tokens, "text": text, "count": count}


def start_client(
    mode: str,
    checkpoint: Path,
    cluster: LocalCluster,
    workdir: Path,
    extra: tuple[str, ...] = (),
    label: str = "",
) -> tuple[subprocess.Popen[bytes], str]:
    """The attention client as its own process (as a pod runs it), so the load generator here does
    not share its interpreter. It runs one torch thread: OpenMP threads spinning against other work
    on a loaded 2-core machine made its p50 TPOT 10x worse (0.42 s against 0.04 s at 1.1 req/s)."""
    label = label or mode
    ready = workdir / f"client-{label}.ready.json"
    ready.unlink(missing_ok=True)  # a run before this one left its own
    command = [
        sys.executable, "-m", "eaas.runtime.cli", "attention-client", "--checkpoint", str(checkpoint),
        "--placement", str(cluster.placement_path), "--port", "0", "--host", "127.0.0.1",
        "--ready-file", str(ready), "--batching", mode, "--max-batch-size", "32", "--max-queue", "4096",
        "--max-tokens", "256", "--transport", "tcp", "--log-level", "WARNING", *extra,
        *(arg for ordinal, url in cluster.urls.items() for arg in ("--server", f"{ordinal}={url}")),
    ]  # fmt: skip
    log = (workdir / f"client-{label}.log").open("wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {mode} attention client did not start; see {log.name}")
        time.sleep(0.1)
    url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"
    while True:  # ready once the placement is read and every expert server connected
        try:
            connection = HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=5)
            connection.request("GET", "/readyz")
            if connection.getresponse().status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {mode} attention client never became ready")
        time.sleep(0.1)
    return process, url


def run_mode(
    mode: str, streaming: bool, url: str, load: list[tuple[float, list[int], int]]
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in load]
    origin = time.monotonic() + 0.2

    def worker(index: int) -> None:
        arrival, prompt, max_tokens = load[index]
        time.sleep(max(0.0, origin + arrival - time.monotonic()))
        try:
            results[index] = send(url, prompt, max_tokens, streaming)
        except Exception as exc:  # counted as failed
            results[index] = {"error": str(exc)}
        results[index]["arrival"] = origin + arrival

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(load))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def serving_config() -> MoEConfig:
    """The random mixtral-family model the serving benchmarks use."""
    # Large enough that a step's compute grows with its tokens (so static batching's finished rows
    # cost something), small enough for two CPU cores.
    return preset(
        "mixtral",
        "tiny",
        hidden_size=256,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        num_layers=4,
        expert_intermediate_size=512,
        max_position_embeddings=512,
    )
