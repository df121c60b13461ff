"""Checks, on this node's GPU, the mechanisms the ``cuda_ipc`` transport relies on.

Run it on a GPU node before deploying ``transport: cuda_ipc`` (it needs CUDA and cuda-python):

1. ``host_flags``: a shared-memory file registered for the GPU (``cuMemHostRegister``): a GPU
   stream writes a flag the CPU reads, and waits on a flag the CPU writes (latencies reported).
2. ``exporter_death``: device memory imported from a process that is then SIGKILLed, for CUDA
   virtual-memory descriptors (what the transport uses) and legacy IPC handles: does the
   importer's next access work, hang or fail, and does a third process's GPU work still run?
3. ``release``: a stream blocked on a flag nobody will set is released by the CPU writing it
   (how a client stops waiting on a dead server).

Usage: python benchmarks/gpu_mechanisms.py [--json-out PATH]
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import emit, parser, target

HIDDEN = 7168
TOKEN_COUNTS = (1, 8, 32, 128, 512)
FLAG_IDLE, FLAG_REQUEST, FLAG_RESPONSE, FLAG_SERVING = 0, 1, 2, 4
PAGE = 4096


def _shm_file(name: str, size: int, create: bool) -> tuple[int, mmap.mmap]:
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    if create:
        os.ftruncate(fd, size)
    return fd, mmap.mmap(fd, size)


def _spawn(role: str, *args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", role, *args], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{role} child exited with {proc.wait()}")
    return proc, json.loads(line)


def _wait_event(event: torch.cuda.Event, timeout_s: float) -> float | None:
    """Seconds until ``event`` completed, or None if it did not within ``timeout_s``."""
    started = time.perf_counter()
    while not event.query():
        if time.perf_counter() - started > timeout_s:
            return None
    return time.perf_counter() - started


def _wait_flag(flags: np.ndarray, index: int, value: int, timeout_s: float) -> float | None:
    started = time.perf_counter()
    while int(flags[index]) != value:
        if time.perf_counter() - started > timeout_s:
            return None
    return time.perf_counter() - started


def check_host_flags(results: dict[str, Any]) -> None:
    """GPU writes a host flag the CPU reads; GPU waits on a host flag the CPU writes."""
    from eaas.runtime.transport.cuda_driver import HostMapping, MemOps

    name = f"eaas-probe-{os.getpid()}"
    fd, buffer = _shm_file(name, PAGE, create=True)
    out: dict[str, Any] = {}
    results["host_flags"] = out
    try:
        mapping = HostMapping(buffer)
        out["device_pointer_equals_host_pointer"] = mapping.base == mapping.host_pointer
        flags = np.frombuffer(buffer, dtype="<u4", count=16)
        flags[:] = 0
        stream = torch.cuda.Stream()
        MemOps().write(mapping.device_pointer(4), 123).enqueue(stream)
        seen = _wait_flag(flags, 1, 123, 2.0)
        out["gpu_write_seen_by_cpu_s"] = seen
        print("host_flags: gpu write seen by cpu after", seen, flush=True)
        for variant, index in (("eq", 2), ("eq_after_kernel", 6)):
            with torch.cuda.stream(stream):
                if variant == "eq_after_kernel":
                    torch.ones(4, device="cuda").sum()
                MemOps().wait_equal(mapping.device_pointer(4 * index), 5).write(
                    mapping.device_pointer(4 * index + 4), 6
                ).enqueue(stream)
            done = torch.cuda.Event()
            done.record(stream)
            time.sleep(0.02)
            out[f"{variant}_blocked_before_cpu_write"] = not done.query()
            flags[index] = 5
            released = _wait_event(done, 2.0)
            out[f"{variant}_released_after_cpu_write_s"] = released
            out[f"{variant}_write_after_wait"] = int(flags[index + 1]) == 6
            print("host_flags:", variant, out, flush=True)
            if released is None:
                out["stuck"] = True
                flags[index] = 5
                return
        mapping.close()
    finally:
        os.close(fd)
        (Path("/dev/shm") / name).unlink(missing_ok=True)


def check_release(results: dict[str, Any]) -> None:
    """A stream waiting on a flag that never comes is released by the CPU (the dead-server path)."""
    from eaas.runtime.transport.cuda_driver import HostMapping, MemOps

    name = f"eaas-probe-r{os.getpid()}"
    fd, buffer = _shm_file(name, PAGE, create=True)
    try:
        mapping = HostMapping(buffer)
        flags = np.frombuffer(buffer, dtype="<u4", count=16)
        flags[:] = 0
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            MemOps().wait_equal(mapping.device_pointer(0), FLAG_RESPONSE).enqueue(stream)
            y = torch.ones(1024, device="cuda") * 3
        done = torch.cuda.Event()
        done.record(stream)
        time.sleep(0.1)
        still_blocked = not done.query()
        flags[0] = FLAG_RESPONSE
        if _wait_event(done, 2.0) is None:
            results["release"] = {"stuck": True}
            return
        results["release"] = {
            "blocked_while_waiting": still_blocked,
            "released": bool((y == 3).all().item()),
        }
        mapping.close()
    finally:
        os.close(fd)
        (Path("/dev/shm") / name).unlink(missing_ok=True)


LEGACY_BYTES = 2 << 20  # one allocation granule of the VMM API on Hopper


def exporter(kind: str) -> None:
    """Child: device memory filled with 7s, exported (legacy IPC handle, or VMM fd socket); sleeps."""
    from eaas.runtime.transport.cuda_driver import DeviceArena, check, driver, tensor_at, use_device
    from eaas.runtime.transport.cuda_ipc_server import ArenaFdServer

    device = use_device(0)
    if kind == "legacy":
        import ctypes

        cu = driver()
        pointer = int(check(cu.cuMemAlloc(LEGACY_BYTES), "cuMemAlloc"))
        tensor_at(pointer, LEGACY_BYTES, device, None).fill_(7)
        handle = check(cu.cuIpcGetMemHandle(pointer), "cuIpcGetMemHandle")
        exported = ctypes.string_at(handle.getPtr(), 64).hex()
    else:
        arena = DeviceArena(LEGACY_BYTES, device)
        arena.tensor.fill_(7)
        server = ArenaFdServer(f"eaas-probe-{os.getpid()}", arena)
        exported = server.name
    torch.cuda.synchronize()
    print(json.dumps({"handle": exported, "pid": os.getpid()}), flush=True)
    time.sleep(600)


def importer(kind: str, exported: str) -> None:
    """Child: maps the exporter's memory, reads it, then (after a line on stdin) writes and syncs."""
    from eaas.runtime.transport.cuda_driver import ImportedArena, check, driver, tensor_at, use_device
    from eaas.runtime.transport.cuda_ipc_server import receive_arena_fd

    device = use_device(0)
    if kind == "legacy":
        import ctypes

        cu = driver()
        handle = cu.CUipcMemHandle()
        ctypes.memmove(handle.getPtr(), bytes.fromhex(exported), 64)
        flags = int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        pointer = int(check(cu.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle"))
        tensor = tensor_at(pointer, LEGACY_BYTES, device, None)
    else:
        fd = receive_arena_fd(exported, 5.0)
        arena = ImportedArena(fd, LEGACY_BYTES, device)
        os.close(fd)
        tensor = arena.tensor
    before = int(tensor[:16].sum().item())
    print(json.dumps({"read_before_kill": before == 16 * 7}), flush=True)
    sys.stdin.readline()  # the exporter is dead now
    outcome: dict[str, Any] = {}
    try:
        tensor[:1024].fill_(3)
        outcome["access_after_kill"] = "ok" if int(tensor[:1024].sum().item()) == 3 * 1024 else "wrong values"
    except Exception as exc:
        outcome["access_after_kill"] = f"error: {exc}"
    try:
        outcome["context_usable_after"] = float((torch.ones(8, device="cuda") * 2).sum().item()) == 16.0
    except Exception as exc:
        outcome["context_usable_after"] = f"error: {exc}"
    print(json.dumps(outcome), flush=True)


def _exporter_death(kind: str) -> dict[str, Any]:
    exporter_proc, hello = _spawn("exporter", "--kind", kind)
    importer_proc = subprocess.Popen(
        [sys.executable, __file__, "--role", "importer", "--kind", kind, "--handle", hello["handle"]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert importer_proc.stdout is not None and importer_proc.stdin is not None
    try:
        outcome: dict[str, Any] = json.loads(importer_proc.stdout.readline() or "{}")
        exporter_proc.kill()
        exporter_proc.wait()
        time.sleep(1.0)
        if importer_proc.poll() is not None:
            return {**outcome, "importer": f"exited with {importer_proc.returncode} before the kill"}
        importer_proc.stdin.write("go\n")
        importer_proc.stdin.flush()
        try:
            out, _ = importer_proc.communicate(timeout=20)
            outcome.update(
                json.loads(out.strip().splitlines()[-1]) if out.strip() else {"importer": "no output"}
            )
        except subprocess.TimeoutExpired:
            outcome["access_after_kill"] = "hung (no answer in 20 s)"
        # Does this (third) process's GPU work still run?
        done = torch.cuda.Event()
        (torch.ones(16, device="cuda") * 2).sum()
        done.record()
        outcome["bystander_seconds"] = _wait_event(done, 10.0)
        return outcome
    finally:
        for proc in (exporter_proc, importer_proc):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_exporter_death(results: dict[str, Any]) -> None:
    """Memory imported from a process that is then SIGKILLed: legacy IPC handles vs VMM descriptors."""
    results["exporter_death"] = {}
    for kind in ("vmm", "legacy"):
        try:
            results["exporter_death"][kind] = _exporter_death(kind)
        except Exception:
            results["exporter_death"][kind] = traceback.format_exc()
        print("exporter_death", kind, results["exporter_death"][kind], flush=True)


def environment() -> dict[str, Any]:
    from eaas.runtime.transport.cuda_driver import device_attribute, use_device

    use_device(0)
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        from importlib.metadata import version

        env["cuda_bindings"] = version("cuda-bindings")
    except Exception:
        env["cuda_bindings"] = None
    for name in (
        "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
        "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
        "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES",
        "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING",
    ):
        try:
            env[name.removeprefix("CU_DEVICE_ATTRIBUTE_").lower()] = device_attribute(name)
        except Exception as exc:
            env[name] = f"error: {exc}"
    env["mps_control"] = bool(
        subprocess.run(["which", "nvidia-cuda-mps-control"], capture_output=True).stdout
    )
    try:
        import nvshmem.core  # noqa: F401

        env["nvshmem4py"] = True
    except Exception as exc:
        env["nvshmem4py"] = f"no: {type(exc).__name__}"
    return env


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--role", default="main")
    p.add_argument("--kind", default="vmm")
    p.add_argument("--handle", default="")
    args = p.parse_args()
    if args.role == "exporter":
        return exporter(args.kind)
    if args.role == "importer":
        return importer(args.kind, args.handle)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        emit("gpu_mechanisms", [], {}, args.json_out)
        return None
    results: dict[str, Any] = {"environment": environment()}
    print(json.dumps(results["environment"]), flush=True)
    for check_fn in (check_host_flags, check_exporter_death, check_release):
        name = check_fn.__name__.removeprefix("check_")
        try:
            check_fn(results)
        except Exception:
            results[name] = traceback.format_exc()
        print(name, json.dumps(results.get(name), default=str), flush=True)
    death = results.get("exporter_death", {})
    vmm = death.get("vmm") if isinstance(death, dict) else None
    safe = isinstance(vmm, dict) and vmm.get("access_after_kill") == "ok"
    emit(
        "gpu_mechanisms",
        [results],
        {"vmm_import_survives_exporter_death": target(float(safe), 1.0)},
        args.json_out,
    )
    return None


if __name__ == "__main__":
    main()
