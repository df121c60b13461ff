"""What an expert server's warm-up takes off its first requests: the first run of its experts in a
fresh process against the same run again, per kernel backend.

An expert server runs each hosted expert once before it serves (``runtime/server/batch.warm_up``:
one token per expert, then one decode-shaped token of top-k entries). Without it, a server that
joins a pool pays its first-use costs (kernels compiled or autotuned, the allocator's first
blocks, weights first touched) on its clients' first requests, and every client's step waits for
the slowest server. Here, for each backend, a fresh process (an empty Triton cache, so a compile
is a compile) builds a stack of random experts of DeepSeek-V3's shape (hidden 7168, expert
intermediate 2048, top-k 8; 32 experts: a server's share of a layer at 8 servers) in bf16 on the
GPU and times ``warm_up`` twice: the first is what the warm-up moves out of the first requests,
the second what the same work costs once warm. Then each of several request sizes (1 to 512
tokens, top-k 8) runs once: what a request still pays on first use after the warm-up (a compile
would show as seconds). ``--quick`` (or no GPU): the tiny mixtral shape on the CPU, torch and
grouped_mm only.

Usage: python benchmarks/warm_up.py [--quick] [--json-out PATH]
No target: a measurement of what the warm-up absorbs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from _common import emit, parser

EXPERTS = 32
MAX_TOKENS = 512  # the server's slot size in tokens (the warm-up covers the tiles up to it)
AFTER_SIZES = (1, 3, 8, 24, 64, 200, 512)


def one(backend: str, quick: bool, max_tokens: int | None) -> dict[str, Any]:
    """Child: a fresh process's first and second warm-up of one backend."""
    from eaas.runtime.model import ExpertStack, preset
    from eaas.runtime.server.batch import warm_up

    gpu = torch.cuda.is_available() and not quick
    device = torch.device("cuda" if gpu else "cpu")
    config = preset("deepseek_v3", "deepseek-v3") if gpu else preset("mixtral", "tiny")
    experts = min(EXPERTS, config.num_experts)
    layer = config.moe_layers[0]
    pairs = [(layer, e) for e in range(experts)]
    h, i = config.hidden_size, config.expert_intermediate_size
    dtype = torch.bfloat16 if gpu else torch.float32
    w13 = (torch.randn(experts, 2 * i, h, device=device, dtype=dtype) * h**-0.5).contiguous()
    w2 = (torch.randn(experts, h, i, device=device, dtype=dtype) * i**-0.5).contiguous()
    stack = ExpertStack(config, pairs, w13, w2).to(device)
    if gpu:
        torch.cuda.synchronize()
    started = time.perf_counter()
    first = warm_up(stack, backend, max_tokens)
    second = warm_up(stack, backend, max_tokens)
    after = {}  # then each request size's first call in this process, decode-shaped (top-k entries)
    for tokens in AFTER_SIZES:
        x = torch.randn(tokens, h, device=device, dtype=dtype)
        group_of = torch.randint(0, experts, (tokens, config.top_k), device=device)
        weights = torch.full((tokens, config.top_k), 1.0 / config.top_k, device=device)
        if gpu:
            torch.cuda.synchronize()
        begun = time.perf_counter()
        stack.forward(x, group_of, weights, backend)
        if gpu:
            torch.cuda.synchronize()
        after[tokens] = round((time.perf_counter() - begun) * 1e3, 2)
    return {
        "backend": backend if max_tokens else f"{backend}, no tile sweep",
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "shape": f"{experts} experts x H {h} x I {i} ({dtype})".replace("torch.", ""),
        "first_s": round(first, 4),
        "second_s": round(second, 4),
        "first_over_second": round(first / second, 1) if second > 0 else None,
        "both_s": round(time.perf_counter() - started, 4),
        "first_call_ms_after": after,
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--role", default="main")
    p.add_argument("--backend", default="torch")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="0: the warm-up without the tile sweep")
    args = p.parse_args()
    if args.role == "child":
        print(json.dumps(one(args.backend, args.quick, args.max_tokens or None)), flush=True)
        return
    gpu = torch.cuda.is_available() and not args.quick
    runs = [("torch", MAX_TOKENS), ("grouped_mm", MAX_TOKENS)]
    if gpu:  # the Triton backend compiles: with the warm-up's sweep over its tiles, and without
        runs += [("triton", MAX_TOKENS), ("triton", 0)]
    rows = []
    for backend, max_tokens in runs:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            command = [sys.executable, __file__, "--role", "child", "--backend", backend]
            command += ["--max-tokens", str(max_tokens)]
            if args.quick:
                command.append("--quick")
            result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if result.returncode != 0:
            rows.append({"backend": backend, "error": result.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    print(f"{'backend':>10} {'first warm-up s':>15} {'second s':>9} {'ratio':>6}  shape")
    for row in rows:
        if "error" in row:
            print(f"{row['backend']:>10} failed: {row['error']}")
            continue
        print(
            f"{row['backend']:>10} {row['first_s']:>15} {row['second_s']:>9} "
            f"{row['first_over_second']!s:>6}  {row['shape']} on {row['device']}"
        )
        print(f"{'':>10} then the first call at T tokens, ms: {row['first_call_ms_after']}")
    emit("warm_up", rows, {}, args.json_out)


if __name__ == "__main__":
    main()
