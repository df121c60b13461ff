"""Decode throughput of a local EaaS cluster vs the monolithic reference, and through a server kill.

Same model, same batch, same run: a random ``mixtral``-family model large enough that expert
compute matters (see ``MODELS``), batch 32, greedy decode. Measured:

- ``monolithic``: the reference model (every expert in this process, all cores);
- ``eaas``: 4 expert-server processes (shm, replication 2, one thread each) + one attention client;
- ``eaas`` over ``tcp`` and over ``nixl`` (``--compare``): the same, one attention client per
  transport. ``tcp`` is served by the same servers as ``shm`` (they offer both, the default);
  ``nixl`` by 4 more servers that offer ``nixl`` alone, as a pool with transport ``nixl`` runs them
  (their loop then polls the NIXL agent instead of blocking in the kernel). The transports'
  decodes are timed in turns (shm, tcp, nixl, shm, ...), so load falls on all of them alike;
- ``eaas, server killed``: the shm run, with one server SIGKILLed halfway through the decode.

Decode tokens/s = batch x decode steps / decode time (prefill excluded), median over repetitions.
For each transport's run, also the CPU milliseconds per decode step of this process (the attention
client: a ``nixl`` client polls its channels while it waits) and of the servers it uses.
Every run's tokens are compared with the monolithic run: a "failed request" is a step that raised
or a token that differs.

Targets: eaas >= 0.7x monolithic at batch 32; zero failed requests under the kill (and
in every other EaaS run). ``nixl`` against ``tcp`` is reported (``vs_tcp``), without a target.
``nixl`` needs the NIXL library (``pip install 'eaas[nixl]'``): without it the script stops and
says so (``--compare tcp`` runs without it).

``--micro-batches 1,2,3`` measures the micro-batch pipeline instead (``_pipeline.py``).

Usage: python benchmarks/e2e_decode.py [--quick] [--json-out PATH] [--steps N] [--reps N] [--compare tcp,nixl]
       [--micro-batches 1,2,3]
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _pipeline
import torch
from _common import cpu_seconds, emit, parser, target

from eaas.runtime.client import AttentionClient, ClientOptions
from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.local.session import StepHook
from eaas.runtime.model import Decoder, load_reference, preset, write_random_checkpoint
from eaas.runtime.placement import round_robin
from eaas.runtime.transport.nixl_endpoint import TransportUnavailable, load_library

BATCH = 32
PROMPT_LEN = 8
SERVERS = 4
REPLICATION = 2
KILL_ORDINAL = 1
SERVED_WITH_SHM = ("shm", "tcp")  # what the first servers offer (the expert server's default)
MODELS = {  # overrides of the mixtral "tiny" preset
    "full": {"hidden_size": 1024, "expert_intermediate_size": 2816, "num_layers": 4, "num_heads": 8,
             "num_kv_heads": 4, "head_dim": 128, "vocab_size": 1024},
    "quick": {"hidden_size": 512, "expert_intermediate_size": 1536, "num_layers": 4, "num_heads": 8,
              "num_kv_heads": 4, "head_dim": 64, "vocab_size": 512},
}  # fmt: skip


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (BATCH, PROMPT_LEN), generator=generator).tolist()


def decode(
    decoder: Decoder,
    batch: list[list[int]],
    steps: int,
    cpu: list[float] | None = None,
    pids: tuple[int, ...] = (),
) -> tuple[float, list[list[int]]]:
    """(decode seconds, generated tokens) for greedy decoding of ``steps`` tokens after the prefill.
    Adds the CPU seconds the decode steps took, here and in processes ``pids``, to ``cpu``."""
    cache = decoder.new_cache(len(batch), PROMPT_LEN + steps + 1)
    with torch.inference_mode():
        tokens = torch.tensor(batch)
        logits = decoder.forward(tokens, torch.full((len(batch),), PROMPT_LEN), cache)
        generated = [logits.argmax(-1)]
        here, there = time.process_time(), sum(map(cpu_seconds, pids))
        start = time.perf_counter()
        for _ in range(steps):
            logits = decoder.forward(generated[-1][:, None], torch.ones(len(batch), dtype=torch.int64), cache)
            generated.append(logits.argmax(-1))
        seconds = time.perf_counter() - start
        if cpu is not None:
            cpu[0] += time.process_time() - here
            cpu[1] += sum(map(cpu_seconds, pids)) - there
    return seconds, torch.stack(generated, dim=1).tolist()


def main() -> None:
    cli = parser(__doc__.splitlines()[0])
    cli.add_argument("--steps", type=int, default=None, help="decode steps per run (default 24, quick 6)")
    cli.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    cli.add_argument(
        "--compare", default="tcp,nixl", help="transports measured beside shm, in turns with it ('' for none)"
    )
    cli.add_argument(
        "--micro-batches",
        default="",
        help="instead: decode with steps cut into these micro-batch counts "
        "(of 1, 2, 3), expert servers on the simulated backend (see _pipeline.py)",
    )
    args = cli.parse_args()
    if args.micro_batches:
        choices = sorted({int(m) for m in args.micro_batches.split(",")})
        if not set(choices) <= {1, 2, 3}:
            raise SystemExit(f"e2e_decode: --micro-batches takes 1, 2, 3; got {args.micro_batches}")
        with tempfile.TemporaryDirectory(prefix="eaas-e2e-") as tmp:
            results, targets = _pipeline.run(args, choices, Path(tmp))
        emit("e2e_decode", results, targets, args.json_out)
        return
    compared = [name.strip() for name in args.compare.split(",") if name.strip() and name.strip() != "shm"]
    if "nixl" in compared:
        try:
            load_library()
        except TransportUnavailable as exc:
            raise SystemExit(f"e2e_decode: --compare nixl needs the NIXL library ({exc})") from None
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
            with contextlib.ExitStack() as stack:
                clusters = dict.fromkeys(SERVED_WITH_SHM, cluster)
                for name in compared:
                    if name not in clusters:  # servers that offer this transport alone
                        others = LocalCluster(
                            checkpoint, placement, Path(tmp) / f"cluster-{name}", transports=(name,)
                        )
                        clusters[name] = stack.enter_context(others)
                clients = {
                    name: stack.enter_context(
                        AttentionClient(
                            checkpoint, placement, clusters[name].urls,
                            ClientOptions(transport=name, request_timeout_s=10.0),
                        )
                    )
                    for name in ("shm", *compared)
                }  # fmt: skip
                for client in clients.values():
                    decode(client.decoder, batch, 2)  # warm-up
                runs: dict[str, list[tuple[float, list[list[int]]]]] = {name: [] for name in clients}
                cpu = {name: [0.0, 0.0] for name in clients}  # CPU seconds of decode steps: here, servers
                for _ in range(reps):  # in turns: load falls on every transport alike
                    for name, client in clients.items():
                        pids = tuple(server.pid for server in clusters[name].servers.values())
                        runs[name].append(decode(client.decoder, batch, steps, cpu[name], pids))
                failed += sum(tokens != want for measured in runs.values() for _, tokens in measured)
            eaas = runs.pop("shm")
            eaas_cpu = cpu.pop("shm")
            options = ClientOptions(transport="shm", request_timeout_s=10.0)
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
    per_step = {name: [seconds / (reps * steps) for seconds in used] for name, used in cpu.items()}
    per_step["shm"] = [seconds / (reps * steps) for seconds in eaas_cpu]
    report(
        config, steps, reps, mono, mono_threads, eaas, runs, per_step, killed_seconds, failed, failovers,
        resent, args,
    )  # fmt: skip


def report(
    config: Any, steps: int, reps: int, mono: list, mono_threads: int, eaas: list, compared: dict[str, list],
    cpu_per_step: dict[str, list[float]], killed_seconds: float, failed: int, failovers: int, resent: int,
    args: Any,
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
    print(
        f"{'run':<44} {'tokens/s':>10} {'vs monolithic':>14}   CPU ms per step: {'client':>7} {'servers':>8}"
    )
    print(f"{f'monolithic (1 process, {mono_threads} thread(s))':<44} {mono_tps:>10.1f} {1.0:>14.2f}")
    compared_tps = {name: tokens / statistics.median(s for s, _ in runs) for name, runs in compared.items()}
    for name, tps in {"shm": eaas_tps, **compared_tps}.items():
        served = (
            f"R={REPLICATION}"
            if name == "shm"
            else "same servers"
            if name in SERVED_WITH_SHM
            else f"{name}-only servers"
        )
        client_ms, servers_ms = (1e3 * seconds for seconds in cpu_per_step[name])
        print(f"{f'eaas ({SERVERS} servers, {name}, {served})':<44} {tps:>10.1f} {tps / mono_tps:>14.2f}   "
              f"{'':>16} {client_ms:>7.1f} {servers_ms:>8.1f}")  # fmt: skip
    print(f"{'eaas, 1 server SIGKILLed mid-run':<44} {killed_tps:>10.1f} {killed_tps / mono_tps:>14.2f}")
    print(f"failed requests: {failed}; failovers: {failovers}; (token, expert) entries re-sent: {resent}")
    cpu = {name: {"client_cpu_ms_per_step": 1e3 * used[0], "servers_cpu_ms_per_step": 1e3 * used[1]}
           for name, used in cpu_per_step.items()}  # fmt: skip
    results = [
        {"run": "monolithic", "threads": mono_threads, "tokens_per_s": mono_tps},
        {"run": "eaas", "servers": SERVERS, "transport": "shm", "replication": REPLICATION,
         "tokens_per_s": eaas_tps, **cpu["shm"]},
        *({"run": f"eaas_{name}", "servers": SERVERS, "transport": name, "replication": REPLICATION,
           "server_transports": list(SERVED_WITH_SHM) if name in SERVED_WITH_SHM else [name],
           "tokens_per_s": tps, "vs_monolithic": tps / mono_tps, "vs_shm": tps / eaas_tps, **cpu[name]}
          for name, tps in compared_tps.items()),
        {"run": "eaas_server_killed", "tokens_per_s": killed_tps, "failed_requests": failed,
         "failovers": failovers, "resent_entries": resent},
    ]  # fmt: skip
    if "nixl" in compared_tps and "tcp" in compared_tps:
        print(f"nixl vs tcp: {compared_tps['nixl'] / compared_tps['tcp']:.2f}x the tokens/s")
        next(r for r in results if r["run"] == "eaas_nixl")["vs_tcp"] = (
            compared_tps["nixl"] / compared_tps["tcp"]
        )
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
