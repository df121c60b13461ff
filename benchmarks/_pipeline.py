"""``e2e_decode.py --micro-batches 1,2,3``: decode with a step cut into m pipelined micro-batches.

A ``mixtral``-family random model (hidden 512, 4 MoE layers x 8 experts, expert intermediate 128),
batch 128, prompt 8: a batch large enough that halving it does not double the client's time per
token (at batch 32 the client's projections are bound by reading their weights, and each
micro-batch reads them again). 2 expert servers (shm, R = 1) run the ``simulated:0:ENTRY_US``
backend, ENTRY_US set from the attention client's
own time per layer (measured first, with experts that answer zeros) so that one layer's expert
round trip is ``ratio`` x the client's time for that layer: ratio 1 (2BO's case) and ratio 2
(3BO's). For each m: decode tokens/s, p99 inter-token latency (a step gives every row its token),
CPU seconds per token (client + servers), and the overlap achieved: the share of the 1BO run's
expert wait that the client no longer spends blocked. The counts are timed in turns (1, 2, 3, 1,
...), medians over repetitions. Then the serving engine on the real ``torch`` backend, 64
sequences, with each count and with ``auto`` (target: auto >= 0.97x m = 1's tokens/s; its trials
are in the run, so a short run charges them more). Every run's tokens must equal m = 1's.
Numbers from a loaded 2-core machine: the ratios matter, not the absolute times.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import cpu_seconds, target

from eaas.runtime.client import AttentionClient, ClientOptions
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import CheckpointReader, Decoder, preset, write_random_checkpoint
from eaas.runtime.model.decoder import MicroBatch
from eaas.runtime.model.kv_cache import KVCache
from eaas.runtime.placement import round_robin
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.micro_batches import AUTO, split_rows
from eaas.runtime.serving.sampling import SamplingParams

BATCH, PROMPT_LEN, SERVERS = 128, 8, 2
MODEL = {"hidden_size": 512, "expert_intermediate_size": 128, "num_layers": 4, "num_heads": 8,
         "num_kv_heads": 4, "head_dim": 64, "vocab_size": 512}  # fmt: skip


class NoExperts:
    """Experts that answer zeros at once: the client's own time per layer."""

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def decode(
    decoder: Decoder, batch: list[list[int]], steps: int, micro_batches: int
) -> tuple[list[float], list]:
    """Per-step seconds of ``steps`` greedy decode steps (after the prefill) and the tokens."""
    groups = split_rows([1.0] * len(batch), micro_batches)
    caches = [
        KVCache(decoder.config, len(rows), PROMPT_LEN + steps + 1, dtype=decoder.side.dtype)
        for rows in groups
    ]
    tokens = torch.tensor(batch)  # [B, S]
    num_new = torch.full((len(batch),), PROMPT_LEN)
    seconds, generated = [], []
    for step in range(steps + 1):
        started = time.perf_counter()
        batches = [
            MicroBatch(tokens[rows], num_new[rows], cache) for rows, cache in zip(groups, caches, strict=True)
        ]
        hiddens = decoder.hidden_micro_batches(batches)
        with torch.inference_mode():
            next_tokens = torch.empty(len(batch), dtype=torch.int64)
            for rows, batch_, hidden in zip(groups, batches, hiddens, strict=True):
                last = hidden[torch.arange(len(rows)), batch_.num_new - 1]
                next_tokens[rows] = decoder.side.logits(last).argmax(-1)
        if step:  # the prefill is not a decode step
            seconds.append(time.perf_counter() - started)
        generated.append(next_tokens)
        tokens, num_new = next_tokens[:, None], torch.ones(len(batch), dtype=torch.int64)
    return seconds, torch.stack(generated, dim=1).tolist()


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def run(args: Any, choices: list[int], tmp: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    steps, reps = (6, 3) if args.quick else (24, 5)
    steps, reps = args.steps or steps, args.reps or reps
    config = preset("mixtral", "tiny", **MODEL)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (BATCH, PROMPT_LEN), generator=generator).tolist()
    checkpoint = write_random_checkpoint(config, tmp / "checkpoint", seed=0)
    torch.set_num_threads(1)
    placement = round_robin(config.moe_layers, config.num_experts, SERVERS, replication=1)
    results, targets, failed = [], {}, 0
    # The client's time per layer (attention, router, norms) with experts that cost nothing.
    bare = AttentionClient(checkpoint, placement, {o: "http://127.0.0.1:1" for o in placement.ordinals})
    free = Decoder(bare.decoder.side, NoExperts())
    decode(free, batch, 2, 1)
    layer_s = statistics.median(s for _ in range(reps) for s in decode(free, batch, steps, 1)[0])
    layer_s /= config.num_layers
    for ratio in (1.0, 2.0):
        entries = BATCH * config.top_k / SERVERS  # per server and layer, on average
        backend = f"simulated:0:{ratio * layer_s * 1e6 / entries:.1f}"
        by_m: dict[int, dict[str, Any]] = {}
        with LocalCluster(checkpoint, placement, tmp / f"cluster-{ratio}", kernel_backend=backend) as cluster:
            pids = tuple(server.pid for server in cluster.servers.values())
            options = ClientOptions(transport="shm", request_timeout_s=10.0)
            with AttentionClient(checkpoint, placement, cluster.urls, options) as client:
                want = decode(client.decoder, batch, 2, 1)[1]  # warm-up
                want = decode(client.decoder, batch, steps, 1)[1]
                step_s: dict[int, list[float]] = {m: [] for m in choices}
                rep_tps: dict[int, list[float]] = {m: [] for m in choices}
                cpu = {m: [0.0, 0.0] for m in choices}  # CPU seconds: this client, the servers
                waited = dict.fromkeys(choices, 0.0)
                for _ in range(reps):
                    for m in choices:  # in turns: the machine's load falls on every count alike
                        here, there = time.process_time(), sum(map(cpu_seconds, pids))
                        before = client.experts.counters.expert_seconds
                        seconds, tokens = decode(client.decoder, batch, steps, m)
                        cpu[m][0] += time.process_time() - here
                        cpu[m][1] += sum(map(cpu_seconds, pids)) - there
                        waited[m] += client.experts.counters.expert_seconds - before
                        step_s[m] += seconds
                        rep_tps[m].append(BATCH * len(seconds) / sum(seconds))
                        failed += tokens != want
                for m in choices:
                    by_m[m] = {
                        "run": f"{m}BO", "ratio_expert_to_attention": ratio, "micro_batches": m,
                        "tokens_per_s": statistics.median(rep_tps[m]),
                        "p99_inter_token_ms": 1e3 * p99(step_s[m]),
                        "cpu_s_per_token": sum(cpu[m]) / (BATCH * len(step_s[m])),
                        "client_cpu_s_per_token": cpu[m][0] / (BATCH * len(step_s[m])),
                        "expert_wait_s_per_forward": waited[m] / (reps * (steps + 1)),
                        "client_layer_ms": 1e3 * layer_s, "simulated_backend": backend,
                    }  # fmt: skip
        base_wait = by_m[min(choices)]["expert_wait_s_per_forward"]
        for row in by_m.values():
            row["overlap"] = 1 - row["expert_wait_s_per_forward"] / base_wait if base_wait else 0.0
            row["vs_1BO"] = row["tokens_per_s"] / by_m[min(choices)]["tokens_per_s"]
            results.append(row)
        if ratio == 1.0 and 1 in by_m and 2 in by_m:
            targets["2BO_vs_1BO_tokens_per_s_rt_eq_attention"] = target(by_m[2]["vs_1BO"], 1.6)
            targets["2BO_vs_1BO_p99_inter_token"] = target(
                by_m[2]["p99_inter_token_ms"] / by_m[1]["p99_inter_token_ms"], 1.1, higher_is_better=False
            )
        if ratio == 2.0 and 2 in by_m and 3 in by_m:
            targets["3BO_vs_2BO_tokens_per_s_rt_2x_attention"] = target(
                by_m[3]["tokens_per_s"] / by_m[2]["tokens_per_s"], 1.25
            )
    targets["failed_requests"] = target(failed, 0, higher_is_better=False)
    header = ("run", "RT/attn", "tok/s", "vs 1BO", "p99 ms", "overlap", "CPU s/tok")
    print("{:<5} {:>8} {:>10} {:>7} {:>8} {:>8} {:>10}".format(*header))
    for row in results:
        print(f"{row['run']:<5} {row['ratio_expert_to_attention']:>8.1f} {row['tokens_per_s']:>10.1f} "
              f"{row['vs_1BO']:>7.2f} {row['p99_inter_token_ms']:>8.1f} {row['overlap']:>8.2f} "
              f"{row['cpu_s_per_token']:>10.4f}")  # fmt: skip
    print(f"failed requests (tokens differing from m = {min(choices)}): {failed}")
    engine_rows, auto_vs_1, engine_failed = torch_backend(checkpoint, placement, choices, steps, reps, tmp)
    results += engine_rows
    targets["auto_vs_1BO_torch_backend"] = target(auto_vs_1, 0.97)
    targets["failed_requests"] = target(failed + engine_failed, 0, higher_is_better=False)
    return results, targets


def torch_backend(
    checkpoint: Path, placement: Any, choices: list[int], steps: int, reps: int, tmp: Path
) -> tuple[list[dict[str, Any]], float, int]:
    """The serving engine on the real ``torch`` expert backend: SEQUENCES sequences of 8 x steps
    new tokens each (continuous batching), with each count and with ``auto`` (its trials
    included), in turns. Returns the rows, auto's tokens/s over m = 1's, and runs whose tokens
    differ from m = 1's."""
    sequences, new_tokens = 64, 8 * steps
    generator = torch.Generator().manual_seed(1)
    config = CheckpointReader(checkpoint).config
    prompts = torch.randint(0, config.vocab_size, (sequences, PROMPT_LEN), generator=generator).tolist()
    counts: list[int | str] = [*choices, AUTO]
    tps: dict[int | str, list[float]] = {m: [] for m in counts}
    failed, want = 0, None
    cluster = LocalCluster(checkpoint, placement, tmp / "cluster-torch")
    options = ClientOptions(transport="shm")
    with cluster, AttentionClient(checkpoint, placement, cluster.urls, options) as client:
        for _ in range(reps):
            for m in counts:  # in turns
                engine = Engine(client.decoder, EngineOptions(max_seqs=sequences, micro_batches=m))
                seqs = [engine.add(prompt, SamplingParams(max_tokens=new_tokens)) for prompt in prompts]
                started = time.perf_counter()
                while engine.has_work():
                    engine.step()
                tps[m].append(sequences * new_tokens / (time.perf_counter() - started))
                outputs = [seq.output for seq in seqs]
                want = want or outputs
                failed += outputs != want
    base = statistics.median(tps[min(choices)])
    rows = [
        {"run": f"torch_engine_{m if m == AUTO else f'{m}BO'}", "micro_batches": m, "sequences": sequences,
         "new_tokens": new_tokens, "tokens_per_s": statistics.median(tps[m]),
         "vs_1BO": statistics.median(tps[m]) / base}
        for m in counts
    ]  # fmt: skip
    for row in rows:
        print(f"{row['run']:<22} {row['tokens_per_s']:>10.1f} tokens/s {row['vs_1BO']:>6.2f}x m = 1")
    return rows, statistics.median(tps[AUTO]) / base, failed
