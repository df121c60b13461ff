"""NIXL's own round trip between two processes on one GPU: GPU memory against host memory, against
the ``cuda_ipc`` transport and the device copy floor, in the same run.

The question this answers before a GPU-memory arena is written for the ``nixl`` transport (issue
35): does NIXL's UCX backend, as the ``nixl-cu13`` wheel ships it, carry a WRITE from one process's
GPU memory into another's (UCX ``cuda_ipc`` on one host), and what does a round trip cost there?

Two bare NIXL agents (UCX backend, no progress thread), one per process. A round trip of T tokens
x 7168 (bf16, the request's x only) is: the client WRITEs the bytes from its send area into the
echo's buffer with the notification ``<n>``; the echo process, busy-polling its notifications,
WRITEs them back into the client's answer area with ``a``; the client polls until it has the
notification and its own WRITE completed. Rows, each where both processes' buffers are:

- ``vram``: GPU memory, UCX's default transports (on one host: ``cuda_ipc`` for the bytes);
- ``vram-staged``: GPU memory with ``UCX_TLS=tcp,cuda_copy`` (bytes staged through host memory
  over TCP: what a GPU node without GPUDirect RDMA gets across nodes; the stand-in here);
- ``dram``: host memory, UCX's default transports (shared memory / CMA on one host).

In the same run, from ``gpu_rtt.py``: the ``cuda_ipc`` transport's eager round trip (its CPU polls
the flag, as the NIXL client here does) and captured round trip, and the device copy floor (the
same bytes copied there and back inside one process, one CUDA graph). Every row is checked: the
answer area is poisoned before the first trip and must hold the request's bytes after it.

Usage: python benchmarks/nixl_gpu_rtt.py [--quick] [--json-out PATH]
Needs CUDA and the NIXL library (``pip install 'eaas[nixl]'``); without either it says so.
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from _common import emit, parser

HIDDEN = 7168
TOKENS = (1, 8, 32, 128, 512)
MAX_BYTES = max(TOKENS) * HIDDEN * 2
VARIANTS = {  # row -> (memory, UCX_TLS or None for UCX's default)
    "vram": ("VRAM", None),
    "vram-staged": ("VRAM", "tcp,cuda_copy"),
    "dram": ("DRAM", None),
}


def agent(role: str) -> Any:
    from eaas.runtime.transport.nixl_endpoint import load_library

    lib = load_library()
    config = lib.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    return lib.nixl_agent(f"gpu-raw-{role}-{os.getpid()}-{time.monotonic_ns()}", config)


def compute_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def buffer(memory: str, num_bytes: int) -> torch.Tensor:
    return torch.empty(num_bytes, dtype=torch.uint8, device="cuda" if memory == "VRAM" else "cpu")


def echo(memory: str, handle_path: Path) -> None:
    """Child: reads the client's offer (a JSON line on stdin), writes its own to ``handle_path``
    (UCX may print on standard output), echoes until stdin closes."""
    nixl = agent("echo")
    area = buffer(memory, MAX_BYTES)
    base = area.data_ptr()
    nixl.register_memory([(base, MAX_BYTES, 0, "")], memory)
    offer = json.loads(sys.stdin.readline())
    peer = nixl.add_remote_agent(base64.b64decode(offer["agent_metadata"]))
    nixl.make_connection(peer)
    handle = {"agent_metadata": base64.b64encode(nixl.get_agent_metadata()).decode(), "address": base}
    handle_path.with_suffix(".tmp").write_text(json.dumps(handle))
    handle_path.with_suffix(".tmp").rename(handle_path)
    writes: dict[int, Any] = {}
    in_flight = None
    os.set_blocking(sys.stdin.fileno(), False)
    idle = 0
    while True:
        if in_flight is not None and nixl.check_xfer_state(in_flight) != "PROC":
            in_flight = None
        notes = nixl.get_new_notifs()
        for messages in notes.values():
            for message in messages:
                size = int(message)
                write = writes.get(size)
                if write is None:
                    here = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", [(base, size, 0)], memory)
                    there = nixl.prep_xfer_dlist(peer, [(offer["address"], size, 0)], memory)
                    write = writes[size] = nixl.make_prepped_xfer("WRITE", here, [0], there, [0])
                while in_flight is not None and nixl.check_xfer_state(in_flight) == "PROC":
                    pass
                state = nixl.transfer(write, b"a")
                if state == "ERR":
                    raise ConnectionError("echo WRITE failed")
                in_flight = None if state == "DONE" else write
        idle = 0 if notes else idle + 1
        if idle > 100_000:
            idle = 0
            try:
                if sys.stdin.read() == "":  # the client closed our stdin: it is done
                    return
            except (BlockingIOError, TypeError):
                pass


class Client:
    """The near side: a send area and an answer area, both in ``memory``, registered."""

    def __init__(self, row: str, memory: str, ucx_tls: str | None) -> None:
        env = dict(os.environ)
        saved = os.environ.get("UCX_TLS")
        if ucx_tls:
            env["UCX_TLS"] = ucx_tls
            os.environ["UCX_TLS"] = ucx_tls  # UCX reads it when the agent's context is made
        try:
            self.agent = agent(f"client-{row}")
        finally:
            if saved is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = saved
        self.memory = memory
        self.area = buffer(memory, 2 * MAX_BYTES)  # [send | answer]
        self.send, self.answer = self.area[:MAX_BYTES], self.area[MAX_BYTES:]
        self.agent.register_memory([(self.area.data_ptr(), 2 * MAX_BYTES, 0, "")], memory)
        self.tmp = tempfile.TemporaryDirectory()
        handle_path = Path(self.tmp.name) / "handle.json"
        self.process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                "echo",
                "--memory",
                memory,
                "--handle-path",
                str(handle_path),
            ],
            stdin=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.process.stdin is not None
        offer = {
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "address": self.answer.data_ptr(),
        }
        self.process.stdin.write(json.dumps(offer) + "\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + 60.0
        while not handle_path.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"the {row} echo process exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the {row} echo process gave no handle within 60 s")
            time.sleep(0.01)
        handle = json.loads(handle_path.read_text())
        self.peer = self.agent.add_remote_agent(base64.b64decode(handle["agent_metadata"]))
        self.agent.make_connection(self.peer)
        self.remote = int(handle["address"])
        self._writes: dict[int, Any] = {}

    def write(self, size: int) -> Any:
        write = self._writes.get(size)
        if write is None:
            base = self.send.data_ptr()
            here = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base, size, 0)], self.memory)
            there = self.agent.prep_xfer_dlist(self.peer, [(self.remote, size, 0)], self.memory)
            write = self._writes[size] = self.agent.make_prepped_xfer("WRITE", here, [0], there, [0])
        return write

    def round_trip(self, write: Any, message: bytes) -> None:
        state = self.agent.transfer(write, message)
        answered = False
        deadline = time.monotonic() + 10.0
        while True:
            if state == "PROC":
                state = self.agent.check_xfer_state(write)
            if not answered:
                answered = bool(self.agent.get_new_notifs())
            if answered and state != "PROC":
                break
            if time.monotonic() > deadline:
                raise TimeoutError("no answer within 10 s")
        if state != "DONE":
            raise ConnectionError(f"NIXL WRITE ended in state {state}")

    def measure(self, num_tokens: int, reps: int) -> float:
        """Median µs of one round trip of T x HIDDEN bf16, after checking the echo is exact."""
        x = torch.randn(num_tokens, HIDDEN, dtype=torch.bfloat16, device=compute_device())
        data = x.view(torch.uint8).reshape(-1)
        size = data.numel()
        self.send[:size].copy_(data)
        self.answer.fill_(0xA5)  # poison: every byte must be written by the echo
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        write = self.write(size)
        message = str(size).encode()
        self.round_trip(write, message)
        back = self.answer[:size].to(compute_device())
        if not torch.equal(back, data):
            raise AssertionError(f"{num_tokens} tokens: the echo came back wrong")
        for _ in range(5):
            self.round_trip(write, message)
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            self.round_trip(write, message)
            times.append((time.perf_counter() - started) * 1e6)
        return statistics.median(times)

    def close(self) -> None:
        assert self.process.stdin is not None
        if not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def measure_nixl(quick: bool, rows: list[str]) -> dict[str, dict[int, float] | str]:
    reps = 50 if quick else 300
    results: dict[str, dict[int, float] | str] = {}
    for row in rows:
        memory, ucx_tls = VARIANTS[row]
        try:
            client = Client(row, memory, ucx_tls)
        except Exception as exc:
            traceback.print_exc()
            results[row] = f"failed to start: {type(exc).__name__}: {exc}"
            continue
        try:
            results[row] = {t: round(client.measure(t, reps), 1) for t in TOKENS}
            print(row, results[row], flush=True)
        except Exception as exc:
            traceback.print_exc()
            results[row] = f"failed: {type(exc).__name__}: {exc}"
        finally:
            client.close()
    return results


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--role", default="main")
    p.add_argument("--memory", default="VRAM")
    p.add_argument("--handle-path", type=Path)
    p.add_argument("--rows", default=",".join(VARIANTS), help="which NIXL rows (comma-separated)")
    p.add_argument(
        "--host-check", action="store_true", help="NIXL rows only (dram: on a machine without CUDA)"
    )
    args = p.parse_args()
    if args.role == "echo":
        echo(args.memory, args.handle_path)
        return
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

    nixl = measure_nixl(args.quick, rows)
    cuda_ipc = {row["tokens"]: row for row in gpu_rtt.measure(args.quick)}
    rows = []
    header = f"{'tokens':>6} {'bytes':>9}" + "".join(f" {name:>12}" for name in VARIANTS)
    print(header + f" {'ipc eager':>10} {'ipc graph':>10} {'floor':>7}  (µs, medians)")
    for t in TOKENS:
        row: dict[str, Any] = {"tokens": t, "bytes": t * HIDDEN * 2}
        line = f"{t:>6} {t * HIDDEN * 2:>9}"
        for name in VARIANTS:
            value = nixl.get(name, "not asked for")
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
    at_128 = next(row for row in rows if row["tokens"] == 128)
    ratio = None
    if at_128.get("nixl_vram_us") and at_128.get("cuda_ipc_eager_us"):
        ratio = round(at_128["nixl_vram_us"] / at_128["cuda_ipc_eager_us"], 2)
    print(f"nixl vram raw / cuda_ipc eager at 128 tokens: {ratio}")
    emit(
        "nixl_gpu_rtt",
        rows,
        {
            "vram_over_cuda_ipc_eager_at_128": {
                "value": ratio,
                "target": None,
                "met": None,
                "note": "no target stated",
            }
        },
        args.json_out,
    )


if __name__ == "__main__":
    main()
