"""NIXL's own round trip between two processes on one GPU: GPU memory against host memory, against
the ``cuda_ipc`` transport and the device copy floor, in the same run.

The question this answers before a GPU-memory arena is written for the ``nixl`` transport (issue
35): does NIXL's UCX backend, as the ``nixl-cu13`` wheel ships it, carry a WRITE from one process's
GPU memory into another's (UCX ``cuda_ipc`` on one host), and what does a round trip cost there?

Two bare NIXL agents (UCX backend, no progress thread), one per process: ``transport_rtt.py``'s raw
round trip (``RawNixl`` and its echo process), with both buffers in the row's memory. A round
trip of T tokens x 7168 (bf16, the request's x only) is: the client WRITEs the bytes from its send
area into the echo's buffer with the notification ``<n>``; the echo process (busy-polling for 1 ms
after a message) WRITEs them back into the client's answer area with ``a``; the client polls
until it has the notification and its own WRITE completed. Rows, each where both processes'
buffers are:

- ``vram``: GPU memory, UCX's default transports (on one host: ``cuda_ipc`` for the bytes);
- ``vram-staged``: GPU memory with ``UCX_TLS=tcp,cuda_copy`` (bytes staged through host memory
  over TCP: what a GPU node without GPUDirect RDMA gets across nodes; the stand-in here);
- ``dram``: host memory, UCX's default transports (shared memory / CMA on one host).

And the ``nixl`` transport itself, its server's slots in GPU memory (split frames: the payload
WRITEd, the header in the notification), served by ``transport_rtt.py``'s nixl echo process on
the GPU (y = x, no compute; it still waits for its stream before each answer, as the expert
server does), the client's x staged in its send area as the attention client does:

- ``transport``: the client's areas in GPU memory, and so the server's slot (x on the GPU; UCX
  ``cuda_ipc`` both ways);
- ``transport-host-client``: the client's areas in host memory, and so the server's slot (x on the
  CPU, whole frames as on a CPU server; the echo answers from host memory: the copies to and from
  the GPU an expert server adds are not in it).

For the ``transport`` row at 128 tokens the script also prints the median of ``send`` and of
``receive`` alone (where the round trip's time goes).

In the same run, from ``gpu_rtt.py``: the ``cuda_ipc`` transport's eager round trip (its CPU polls
the flag, as the NIXL client here does) and captured round trip, and the device copy floor (the
same bytes copied there and back inside one process, one CUDA graph). Every row is checked: the
answer area is poisoned before the first trip and must hold the request's bytes after it.

Usage: python benchmarks/nixl_gpu_rtt.py [--quick] [--json-out PATH]
Needs CUDA and the NIXL library (``pip install 'eaas[nixl]'``); without either it says so.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import transport_rtt as rtt
from _common import emit, parser

HIDDEN = 7168
TOKENS = (1, 8, 32, 128, 512)
MAX_BYTES = max(TOKENS) * HIDDEN * 2
TRANSPORT_ROWS = {  # row -> the client's device (cuda: its areas in GPU memory)
    "transport": "cuda",
    "transport-host-client": "cpu",
}
VARIANTS = {  # row -> (memory, UCX_TLS or None for UCX's default)
    "vram": ("VRAM", None),
    "vram-staged": ("VRAM", "tcp,cuda_copy"),
    "dram": ("DRAM", None),
}


def compute_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def median_round_trip_us(raw: rtt.RawNixl, num_tokens: int, reps: int) -> float:
    """Median µs of one round trip of T x HIDDEN bf16, after checking the echo is exact."""
    x = torch.randn(num_tokens, HIDDEN, dtype=torch.bfloat16, device=compute_device())
    expected = x.view(torch.uint8).reshape(-1)
    trip = raw.prepare(x)
    answer = raw.answer(expected.numel())
    answer.fill_(0xA5)  # poison: every byte must be written by the echo
    if answer.is_cuda:
        torch.cuda.synchronize()
    trip()
    if not torch.equal(answer.to(expected.device), expected):
        raise AssertionError(f"{num_tokens} tokens: the echo came back wrong")
    for _ in range(5):
        trip()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        trip()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def measure_nixl(quick: bool, rows: list[str]) -> dict[str, dict[int, float] | str]:
    """Each row's medians by T, or why it failed (a row that fails does not stop the others)."""
    reps = 50 if quick else 300
    results: dict[str, dict[int, float] | str] = {}
    with tempfile.TemporaryDirectory() as tmp, rtt.echoes(Path(tmp)) as started:
        for row in rows:
            memory, ucx_tls = VARIANTS[row]
            try:
                pending = rtt.start_raw_echo(started, row, MAX_BYTES, ucx_tls, memory)
                raw = rtt.connect_raw(pending, MAX_BYTES, memory)
                results[row] = {t: round(median_round_trip_us(raw, t, reps), 1) for t in TOKENS}
                print(row, results[row], flush=True)
            except (Exception, SystemExit) as exc:  # transport_rtt's handshake exits on a dead echo
                traceback.print_exc()
                results[row] = f"failed: {type(exc).__name__}: {exc}"
    return results


def median_transport_us(channel: Any, num_tokens: int, reps: int, device: str) -> float:
    """Median µs of one ``nixl`` transport round trip of T x HIDDEN bf16 (x staged in place, the
    answer used where it landed), after checking that the echo came back exact."""
    x, ids, weights = rtt.inputs(num_tokens, HIDDEN)
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)
    staged = rtt.staged_input(channel, x)
    channel.answer_payload.fill_(0xA5)  # poison: the echo's WRITE must cover every byte of y
    channel.send(rtt.LAYER, staged, ids, weights)
    y = channel.receive(time.monotonic() + 10)
    if not torch.equal(y.cpu(), x.cpu()):
        raise AssertionError(f"{num_tokens} tokens: the nixl echo came back wrong")
    for _ in range(5):
        rtt.in_place_round_trip(channel, staged, ids, weights)
    times, sends = [], []
    for _ in range(reps):
        started = time.perf_counter()
        channel.send(rtt.LAYER, staged, ids, weights)
        sent = time.perf_counter()
        channel.receive(time.monotonic() + 10)
        times.append((time.perf_counter() - started) * 1e6)
        sends.append((sent - started) * 1e6)
    if num_tokens == 128:
        send_us = statistics.median(sends)
        rest_us = statistics.median(times) - send_us
        print(f"  {device} client, 128 tokens: send {send_us:.1f} µs, receive {rest_us:.1f} µs (medians)")
    return statistics.median(times)


def measure_transport(quick: bool, rows: list[str]) -> dict[str, dict[int, float] | str]:
    """Each ``nixl`` transport row's medians by T, or why it failed."""
    from eaas.runtime.protocol import slot_capacity_bytes

    reps = 50 if quick else 300
    capacity = slot_capacity_bytes(max(TOKENS), rtt.TOP_K, HIDDEN)
    results: dict[str, dict[int, float] | str] = {}
    with tempfile.TemporaryDirectory() as tmp, rtt.echoes(Path(tmp)) as started:
        for row in rows:
            client_device = TRANSPORT_ROWS[row]
            try:
                pending = rtt.start_nixl_echo(started, row, max(TOKENS), HIDDEN, False, device="cuda")
                channel = rtt.connect_nixl(pending, capacity, server_device=client_device)
                want = "VRAM" if client_device == "cuda" else "DRAM"
                if channel.split is not (want == "VRAM") or channel.offer_made.memory.kind != want:
                    raise AssertionError(
                        f"expected {want} areas (split frames for VRAM only), got split={channel.split} "
                        f"{channel.offer_made.memory.kind}"
                    )
                try:
                    results[row] = {
                        t: round(median_transport_us(channel, t, reps, client_device), 1) for t in TOKENS
                    }
                finally:
                    channel.close()
                print(row, results[row], flush=True)
            except (Exception, SystemExit) as exc:
                traceback.print_exc()
                results[row] = f"failed: {type(exc).__name__}: {exc}"
    return results


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(VARIANTS), help="which NIXL rows (comma-separated)")
    p.add_argument(
        "--host-check", action="store_true", help="NIXL rows only (dram: on a machine without CUDA)"
    )
    args = p.parse_args()
    rows = args.rows.split(",")
    if args.host_check:  # checks this script's NIXL half, without the cuda_ipc baseline
        results = measure_nixl(args.quick, rows)
        print(results)
        raise SystemExit(0 if all(isinstance(v, dict) for v in results.values()) else 1)
    from eaas.runtime.transport.nixl_endpoint import TransportUnavailable, load_library

    def unmeasured(note: str) -> dict[str, Any]:
        print(note)
        return {"vram_over_cuda_ipc_eager_at_128": {"value": None, "target": None, "met": None, "note": note}}

    if not torch.cuda.is_available():
        emit("nixl_gpu_rtt", [], unmeasured("not measured: no CUDA device in this run"), args.json_out)
        return
    try:
        load_library()
    except TransportUnavailable as exc:
        emit("nixl_gpu_rtt", [], unmeasured(f"not measured: {exc}"), args.json_out)
        return
    import gpu_rtt

    nixl = measure_transport(args.quick, list(TRANSPORT_ROWS)) | measure_nixl(args.quick, rows)
    cuda_ipc = {row["tokens"]: row for row in gpu_rtt.measure(args.quick)}
    rows = []
    names = [*TRANSPORT_ROWS, *VARIANTS]
    header = f"{'tokens':>6} {'bytes':>9}" + "".join(f" {name[:12]:>12}" for name in names)
    print(header + f" {'ipc eager':>10} {'ipc graph':>10} {'floor':>7}  (µs, medians)")
    for t in TOKENS:
        row: dict[str, Any] = {"tokens": t, "bytes": t * HIDDEN * 2}
        line = f"{t:>6} {t * HIDDEN * 2:>9}"
        for name in names:
            value = nixl.get(name)
            row[f"nixl_{name}_us"] = value.get(t) if isinstance(value, dict) else None
            line += f" {row[f'nixl_{name}_us'] if row[f'nixl_{name}_us'] is not None else '-':>12}"
        ipc = cuda_ipc.get(t)
        if ipc is not None:
            row.update(
                cuda_ipc_eager_us=ipc["eager_us"],
                cuda_ipc_captured_us=ipc["captured_us"],
                floor_us=ipc["floor_us"],
            )
            line += f" {ipc['eager_us']:>10} {ipc['captured_us']:>10} {ipc['floor_us']:>7}"
        rows.append(row)
        print(line)
    for name, value in nixl.items():
        if isinstance(value, str):
            print(f"{name}: {value}")

    def ratio(row: dict[str, Any], over: str, under: str) -> float | None:
        top, bottom = row.get(over), row.get(under)
        return round(top / bottom, 2) if top and bottom else None

    by_tokens = {row["tokens"]: row for row in rows}
    raw_over_ipc = ratio(by_tokens[128], "nixl_vram_us", "cuda_ipc_eager_us")
    over_raw = [ratio(by_tokens[t], "nixl_transport_us", "nixl_vram_us") for t in (128, 512)]
    worst_over_raw = None if None in over_raw else max(v for v in over_raw if v is not None)
    over_ipc = ratio(by_tokens[128], "nixl_transport_us", "cuda_ipc_eager_us")
    print(f"nixl vram raw / cuda_ipc eager at 128 tokens: {raw_over_ipc}")
    print(f"nixl transport (GPU memory) / NIXL's raw vram round trip at 128, 512 tokens: {over_raw}")
    print(f"nixl transport (GPU memory) / cuda_ipc eager at 128 tokens: {over_ipc}")
    emit(
        "nixl_gpu_rtt",
        rows,
        {
            "vram_over_cuda_ipc_eager_at_128": {
                "value": raw_over_ipc,
                "target": None,
                "met": None,
                "note": "NIXL's own round trip; no target stated",
            },
            "transport_over_raw_vram_max_128_512": {
                "value": worst_over_raw,
                "target": 1.3,
                "met": None if worst_over_raw is None else worst_over_raw <= 1.3,
                "note": "the host-memory target nixl <= 1.3x raw, here with both ends in GPU memory",
            },
            "transport_over_cuda_ipc_eager_at_128": {
                "value": over_ipc,
                "target": None,
                "met": None,
                "note": "no target stated",
            },
        },
        args.json_out,
    )


if __name__ == "__main__":
    main()
