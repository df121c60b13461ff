"""Decode throughput of a local EaaS cluster vs the monolithic reference, and through a server kill.

Same model, same batch, same run: a random ``mixtral``-family model large enough that expert
compute matters (see ``MODELS``), batch 32, greedy decode. Three measurements:

- ``monolithic``: the reference model (every expert in this process, all cores);
- ``eaas``: 4 expert-server processes (shm, replication 2, one thread each) + one attention client;
- ``eaas, server killed``: the same, with one server SIGKILLed halfway through the decode.

Decode tokens/s = batch x decode steps / decode time (prefill excluded), median over repetitions.
Every run's tokens are compared with the monolithic run: a "failed request" is a step that raised
or a token that differs.

Targets (issue 4): eaas >= 0.7x monolithic at batch 32; zero failed requests under the kill.

Usage: python benchmarks/e2e_decode.py [--quick] [--json-out PATH] [--steps N] [--reps N]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import emit, parser, target

from eaas.runtime.client import AttentionClient, ClientOptions
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.local.session import StepHook
from eaas.runtime.model import Decoder, load_reference, preset, write_random_checkpoint
from eaas.runtime.placement import round_robin

BATCH = 32
PROMPT_LEN = 8
SERVERS = 4
REPLICATION = 2
KILL_ORDINAL = 1
MODELS = {  # overrides of the mixtral "tiny" preset
    "full": {"hidden_size": 1024, "expert_intermediate_size": 2816, "num_layers": 4, "num_heads": 8,
             "num_kv_heads": 4, "head_dim": 128, "vocab_size": 1024},
    "quick": {"hidden_size": 512, "expert_intermediate_size": 1536, "num_layers": 4, "num_heads": 8,
              "num_kv_heads": 4, "head_dim": 64, "vocab_size": 512},
}  # fmt: skip


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (BATCH, PROMPT_LEN), generator=generator).tolist()


def decode(decoder: Decoder, batch: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """(decode seconds, generated tokens) for greedy decoding of ``steps`` tokens after the prefill."""
    cache = decoder.new_cache(len(batch), PROMPT_LEN + steps + 1)
    with torch.inference_mode():
        tokens = torch.tensor(batch)
        logits = decoder.forward(tokens, torch.full((len(batch),), PROMPT_LEN), cache)
        generated = [logits.argmax(-1)]
        start = time.perf_counter()
        for _ in range(steps):
            logits = decoder.forward(generated[-1][:, None], torch.ones(len(batch), dtype=torch.int64), cache)
            generated.append(logits.argmax(-1))
        seconds = time.perf_counter() - start
    return seconds, torch.stack(generated, dim=1).tolist()


def main() -> None:
    cli = parser(__doc__.splitlines()[0])
    cli.add_argument("--steps", type=int, default=None, help="decode steps per run (default 24, quick 6)")
    cli.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    args = cli.parse_args()
    quick = args.quick
    steps, reps = (6, 1) if quick else (24, 3)
    steps, reps = args.steps or steps, args.reps or reps
    overrides = MODELS["quick" if quick else "full"]
    config = preset("mixtral", "tiny", **overrides)
    batch = prompts(config.vocab_size)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="eaas-e2e-") as tmp:
        checkpoint = write_random_checkpoint(config, Path(tmp) / "checkpoint", seed=0)
        # Monolithic: every expert here; the better of 1 and 2 threads (2 threads suffer badly when
        # other processes share the cores, 1 thread leaves a core idle when they do not).
        reference = load_reference(checkpoint)
        mono_by_threads = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            decode(reference, batch, 2)  # warm-up
            mono_by_threads[threads] = [decode(reference, batch, steps) for _ in range(reps)]
        mono_threads = min(mono_by_threads, key=lambda t: statistics.median(s for s, _ in mono_by_threads[t]))
        mono = mono_by_threads[mono_threads]
        want = mono[0][1]
        assert all(tokens == want for runs in mono_by_threads.values() for _, tokens in runs)
        del reference
        # EaaS: servers get one thread each, the client one.
        torch.set_num_threads(1)
        placement = round_robin(config.moe_layers, config.num_experts, SERVERS, replication=REPLICATION)
        failed = 0
        with LocalCluster(checkpoint, placement, Path(tmp) / "cluster") as cluster:
            options = ClientOptions(transport="shm", request_timeout_s=10.0)
            with AttentionClient(checkpoint, placement, cluster.urls, options) as client:
                decode(client.decoder, batch, 2)  # warm-up
                eaas = [decode(client.decoder, batch, steps) for _ in range(reps)]
                failed += sum(tokens != want for _, tokens in eaas)
            with AttentionClient(checkpoint, placement, cluster.urls, options) as client:
                first_moe = config.moe_layers[0]
                kill_step = 1 + steps // 2  # forward passes: prefill is 0

                def on_step(step: int) -> None:
                    if step == kill_step:
                        cluster.kill(KILL_ORDINAL)

                client.decoder.experts = StepHook(client.experts, first_moe, on_step)
                try:
                    killed_seconds, killed_tokens = decode(client.decoder, batch, steps)
                    failed += killed_tokens != want
                except Exception as exc:  # counted, reported, never hidden
                    print(f"decode under the kill failed: {exc!r}")
                    killed_seconds, failed = float("nan"), failed + 1
                failovers = client.experts.counters.failovers
                resent = client.experts.counters.resent_entries
    report(config, steps, reps, mono, mono_threads, eaas, killed_seconds, failed, failovers, resent, args)


def report(
    config: Any, steps: int, reps: int, mono: list, mono_threads: int, eaas: list, killed_seconds: float,
    failed: int, failovers: int, resent: int, args: Any,
) -> None:  # fmt: skip
    tokens = BATCH * steps
    mono_tps = tokens / statistics.median(s for s, _ in mono)
    eaas_tps = tokens / statistics.median(s for s, _ in eaas)
    killed_tps = tokens / killed_seconds
    shape = (
        f"mixtral-family random model: hidden {config.hidden_size}, {config.num_layers} MoE layers x "
        f"{config.num_experts} experts (intermediate {config.expert_intermediate_size}), top-{config.top_k}"
    )
    print(shape)
    print(f"batch {BATCH}, prompt {PROMPT_LEN}, {steps} decode steps, median of {reps}")
    print(f"{'run':<34} {'tokens/s':>10} {'vs monolithic':>14}")
    print(f"{f'monolithic (1 process, {mono_threads} thread(s))':<34} {mono_tps:>10.1f} {1.0:>14.2f}")
    eaas_name = f"eaas ({SERVERS} servers, shm, R={REPLICATION})"
    print(f"{eaas_name:<34} {eaas_tps:>10.1f} {eaas_tps / mono_tps:>14.2f}")
    print(f"{'eaas, 1 server SIGKILLed mid-run':<34} {killed_tps:>10.1f} {killed_tps / mono_tps:>14.2f}")
    print(f"failed requests: {failed}; failovers: {failovers}; (token, expert) entries re-sent: {resent}")
    results = [
        {"run": "monolithic", "threads": mono_threads, "tokens_per_s": mono_tps},
        {"run": "eaas", "servers": SERVERS, "transport": "shm", "replication": REPLICATION,
         "tokens_per_s": eaas_tps},
        {"run": "eaas_server_killed", "tokens_per_s": killed_tps, "failed_requests": failed,
         "failovers": failovers, "resent_entries": resent},
    ]  # fmt: skip
    for row in results:
        row.update(batch=BATCH, decode_steps=steps, hidden=config.hidden_size,
                   expert_intermediate=config.expert_intermediate_size)  # fmt: skip
    targets = {
        "eaas_vs_monolithic_batch32": target(eaas_tps / mono_tps, 0.7),
        "failed_requests_under_kill": target(failed, 0, higher_is_better=False),
    }
    emit("e2e_decode", results, targets, args.json_out)


if __name__ == "__main__":
    main()
