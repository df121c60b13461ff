"""Round trip of one expert request over ``cuda_ipc`` on one GPU, against the device copy floor.

For T tokens x 7168 hidden (bf16, top-k 8), a round trip is: the client's stream copies the
request (x [T, H], ids and weights [T, K]) into the server's slot (GPU memory, CUDA IPC), sets the
flag; the server process (the real ``CudaIpcServerTransport``, its loop polling the flags in
page-locked host memory) answers y = x (an echo: no expert compute) by setting the flag from its
stream; the client copies y out. Measured in the same run:

- ``eager``: ``CudaIpcChannel.send``/``receive`` (the client's CPU polls the flag);
- ``captured``: ``send_async``/``wait_async`` captured in one CUDA graph, timed by CUDA events
  around each replay (the client's stream waits on the flag; no CPU on the client's path);
- ``floor``: the same bytes copied there and back inside one process, captured in one graph.

Target: captured round trip within 2x of the floor at 128 tokens.
Needs CUDA and cuda-python; without CUDA it prints that and reports nothing measured.

Usage: python benchmarks/gpu_rtt.py [--quick] [--json-out PATH]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from _common import emit, parser, target

HIDDEN = 7168
TOP_K = 8
TOKENS = (1, 8, 32, 128, 512)
NOT_MEASURED = "not measured: no CUDA device in this run"


def echo_server() -> None:
    """Child: one cuda_ipc slot; answers every request with y = x (x is at payload offset 0)."""
    from eaas.runtime.protocol import FrameKind, SlotHeader, response_bytes, slot_capacity_bytes
    from eaas.runtime.transport import TransportOptions, get_transport

    capacity = slot_capacity_bytes(max(TOKENS), TOP_K, HIDDEN)
    transport = get_transport("cuda_ipc").server(
        TransportOptions(max_clients=1, capacity_bytes=capacity, device="cuda", tag="rtt")
    )
    print(json.dumps(transport.attach("bench")), flush=True)
    next_reap = 0.0
    with torch.cuda.stream(torch.cuda.Stream()):
        while True:
            transport.wait(0.05)
            for request in transport.poll():
                h = request.header
                size = response_bytes(h.num_tokens, h.hidden, h.dtype)
                response = SlotHeader(
                    FrameKind.RESPONSE, h.dtype, h.layer, h.num_tokens, h.top_k, h.hidden, h.seq, size
                )
                transport.respond(request, lambda response=response: response)
            if time.monotonic() > next_reap:
                next_reap = time.monotonic() + 0.25
                if transport.reap():
                    break
    transport.close()


def time_events(fn: Any, reps: int) -> float:
    """Median µs of ``fn()`` between CUDA events on the current stream."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_wall(fn: Any, reps: int) -> float:
    """Median µs of ``fn()`` followed by a stream synchronisation, by the host clock."""
    for _ in range(3):
        fn()
        torch.cuda.current_stream().synchronize()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        torch.cuda.current_stream().synchronize()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def capture(fn: Any) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def measure_size(channel: Any, num_tokens: int, reps: int) -> dict[str, Any]:
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (num_tokens, TOP_K), device="cuda", dtype=torch.int32)
    weights = torch.rand(num_tokens, TOP_K, device="cuda")
    out = torch.empty_like(x)

    def eager() -> None:
        channel.send(0, x, ids, weights)
        out.copy_(channel.receive(time.monotonic() + 10.0))

    eager()
    torch.cuda.synchronize()
    assert torch.equal(out, x), "the echo came back wrong"
    eager_us = time_wall(eager, reps)

    def exchange() -> None:
        channel.send_async(0, x, ids, weights)
        out.copy_(channel.wait_async())

    graph = capture(exchange)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x), "the captured echo came back wrong"
    captured_us = time_events(graph.replay, reps)
    channel.finish_async()

    x_bytes, ids_bytes = x.numel() * 2, ids.numel() * 4
    request_bytes = x_bytes + ids_bytes + weights.numel() * 4
    there = torch.empty(request_bytes, dtype=torch.uint8, device="cuda")

    def copies() -> None:
        there[:x_bytes].copy_(x.view(torch.uint8).reshape(-1))
        there[x_bytes : x_bytes + ids_bytes].copy_(ids.view(torch.uint8).reshape(-1))
        there[x_bytes + ids_bytes :].copy_(weights.view(torch.uint8).reshape(-1))
        out.view(torch.uint8).reshape(-1).copy_(there[:x_bytes])

    floor_us = time_events(capture(copies).replay, reps)
    return {
        "tokens": num_tokens,
        "request_bytes": request_bytes,
        "eager_us": round(eager_us, 1),
        "captured_us": round(captured_us, 1),
        "floor_us": round(floor_us, 1),
        "captured_over_floor": round(captured_us / floor_us, 2),
    }


def measure(quick: bool) -> list[dict[str, Any]]:
    from eaas.runtime.transport.cuda_ipc_client import CudaIpcChannel

    server = subprocess.Popen([sys.executable, __file__, "--role", "echo"], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    try:
        handle = json.loads(server.stdout.readline())
        channel = CudaIpcChannel.connect(handle, "127.0.0.1", 10.0)
        rows = []
        with torch.cuda.stream(torch.cuda.Stream()):
            for num_tokens in TOKENS[:4] if quick else TOKENS:
                rows.append(measure_size(channel, num_tokens, 30 if quick else 300))
                print(rows[-1], flush=True)
        channel.close()
        return rows
    finally:
        server.kill()
        server.wait()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--role", default="main")
    args = p.parse_args()
    if args.role == "echo":
        echo_server()
        return
    if not torch.cuda.is_available():
        print(NOT_MEASURED)
        unmeasured = {"value": None, "target": 2.0, "met": None, "note": NOT_MEASURED}
        emit("gpu_rtt", [], {"captured_over_floor_at_128": unmeasured}, args.json_out)
        return
    rows = measure(args.quick)
    print(f"{'tokens':>6} {'bytes':>9} {'eager us':>9} {'captured us':>11} {'floor us':>9} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['tokens']:>6} {row['request_bytes']:>9} {row['eager_us']:>9.1f} "
            f"{row['captured_us']:>11.1f} {row['floor_us']:>9.1f} {row['captured_over_floor']:>6.2f}"
        )
    at_128 = next(row["captured_over_floor"] for row in rows if row["tokens"] == 128)
    emit(
        "gpu_rtt",
        rows,
        {"captured_over_floor_at_128": target(at_128, 2.0, higher_is_better=False)},
        args.json_out,
    )


if __name__ == "__main__":
    main()
