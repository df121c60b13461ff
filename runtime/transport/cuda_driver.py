"""The few CUDA driver calls the GPU transports need, through ``cuda.bindings`` (cuda-python).

- ``DeviceArena``: device memory of our own (``cuMemCreate``, never a sub-block of PyTorch's
  caching allocator), shareable with other processes on the node as a file descriptor.
- ``ImportedArena``: another process's ``DeviceArena`` mapped from that descriptor; it keeps the
  memory alive on its own, so the exporter may die without the importer noticing in its copies.
- ``HostMapping``: a host buffer (an ``mmap`` of a shared-memory file) page-locked and mapped
  for the GPU with ``cuMemHostRegister``, so GPU streams can write and wait on flags that a CPU
  in another process reads and writes directly.
- ``MemOps``: stream memory operations (write a 32-bit word, wait until a word equals a value)
  on a stream, batched in order; captured into a CUDA graph they become memop nodes with their
  values fixed at capture.

Every call's result is checked; failures raise ``CudaError`` naming the call. Importing this
module needs no GPU; using it needs CUDA and the ``cuda-python`` package (extra ``eaas[gpu]``).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from typing import Any

import numpy as np
import torch


class CudaError(RuntimeError):
    """A CUDA driver call failed (the message names the call and the driver's error)."""


def driver() -> Any:
    """``cuda.bindings.driver``, or an error that says how to install it."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CudaError(
            "the GPU transports need the cuda-python bindings: pip install 'eaas[gpu]' "
            "(or cuda-python matching your CUDA major version)"
        ) from exc
    return cu


def check(result: Any, what: str) -> Any:
    """Unwraps a ``cuda.bindings`` result tuple ``(CUresult, *values)``; raises ``CudaError``."""
    cu = driver()
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(status)
        text = name.decode() if isinstance(name, bytes) else str(status)
        raise CudaError(f"{what} failed: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_context_lock = threading.Lock()
_contexts: dict[int, Any] = {}


def use_device(device: torch.device | int) -> int:
    """Makes the device's primary context (the one PyTorch uses) current in this thread."""
    index = device if isinstance(device, int) else (device.index or 0)
    torch.cuda.set_device(index)
    torch.empty(0, device=f"cuda:{index}")  # PyTorch's runtime creates the primary context
    cu = driver()
    with _context_lock:
        context = _contexts.get(index)
        if context is None:
            check(cu.cuInit(0), "cuInit")
            dev = check(cu.cuDeviceGet(index), "cuDeviceGet")
            context = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _contexts[index] = context
    check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return index


def device_attribute(name: str, index: int = 0) -> int:
    cu = driver()
    attribute = getattr(cu.CUdevice_attribute, name)
    dev = check(cu.cuDeviceGet(index), "cuDeviceGet")
    return int(check(cu.cuDeviceGetAttribute(attribute, dev), f"cuDeviceGetAttribute({name})"))


class _ArrayInterface:
    """Lends a raw device pointer to ``torch.as_tensor`` (kept alive by the tensor)."""

    def __init__(self, pointer: int, num_bytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
        }


def tensor_at(pointer: int, num_bytes: int, device: int, owner: object) -> torch.Tensor:
    """A uint8 CUDA tensor [num_bytes] over memory at ``pointer`` (no copy)."""
    with torch.cuda.device(device):
        return torch.as_tensor(_ArrayInterface(pointer, num_bytes, owner), device=f"cuda:{device}")


def _allocation_prop(device: int) -> Any:
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


class _Mapping:
    """A physical allocation mapped at a reserved address, readable and writable by ``device``."""

    def __init__(self, handle: Any, num_bytes: int, device: int) -> None:
        cu = driver()
        self.handle = handle
        self.num_bytes = num_bytes
        self.pointer = int(check(cu.cuMemAddressReserve(num_bytes, 0, 0, 0), "cuMemAddressReserve"))
        try:
            check(cu.cuMemMap(self.pointer, num_bytes, 0, handle, 0), "cuMemMap")
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            check(cu.cuMemSetAccess(self.pointer, num_bytes, [access], 1), "cuMemSetAccess")
        except BaseException:
            with contextlib.suppress(CudaError):
                check(cu.cuMemUnmap(self.pointer, num_bytes), "cuMemUnmap")
            check(cu.cuMemAddressFree(self.pointer, num_bytes), "cuMemAddressFree")
            raise

    def release(self) -> None:
        cu = driver()
        with contextlib.suppress(CudaError):
            check(cu.cuMemUnmap(self.pointer, self.num_bytes), "cuMemUnmap")
        with contextlib.suppress(CudaError):
            check(cu.cuMemAddressFree(self.pointer, self.num_bytes), "cuMemAddressFree")
        with contextlib.suppress(CudaError):
            check(cu.cuMemRelease(self.handle), "cuMemRelease")


class DeviceArena:
    """``num_bytes`` (rounded up to the allocation granularity) of device memory of our own.

    Allocated with the virtual memory API (``cuMemCreate``) and shareable as a POSIX file
    descriptor: a process that imports it holds its own reference to the physical memory, so
    the memory stays valid for an importer even after this process dies (a dead expert server
    never turns a client's copy into an access to freed memory).
    """

    def __init__(self, num_bytes: int, device: int = 0) -> None:
        cu = driver()
        self.device = use_device(device)
        prop = _allocation_prop(self.device)
        granularity = int(
            check(
                cu.cuMemGetAllocationGranularity(
                    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        self.num_bytes = -(-max(num_bytes, 1) // granularity) * granularity
        handle = check(cu.cuMemCreate(self.num_bytes, prop, 0), f"cuMemCreate({self.num_bytes})")
        try:
            self._mapping = _Mapping(handle, self.num_bytes, self.device)
        except BaseException:
            check(cu.cuMemRelease(handle), "cuMemRelease")
            raise
        self.pointer = self._mapping.pointer
        try:
            check(cu.cuMemsetD8(self.pointer, 0, self.num_bytes), "cuMemsetD8")
            self.tensor = tensor_at(self.pointer, self.num_bytes, self.device, self)
        except BaseException:
            self._mapping.release()
            raise
        self._closed = False

    def export_fd(self) -> int:
        """A new file descriptor for the allocation (send it with SCM_RIGHTS; the receiver closes it)."""
        cu = driver()
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(
            check(
                cu.cuMemExportToShareableHandle(self._mapping.handle, kind, 0), "cuMemExportToShareableHandle"
            )
        )

    def close(self) -> None:
        """Unmaps and releases our reference: views handed out before must not be used after this."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(self.device)
        del self.tensor
        self._mapping.release()


class ImportedArena:
    """A ``DeviceArena`` of another process on this node, imported from its file descriptor."""

    def __init__(self, fd: int, num_bytes: int, device: int = 0) -> None:
        cu = driver()
        self.device = use_device(device)
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handle = check(cu.cuMemImportFromShareableHandle(fd, kind), "cuMemImportFromShareableHandle")
        try:
            self._mapping = _Mapping(handle, num_bytes, self.device)
        except BaseException:
            check(cu.cuMemRelease(handle), "cuMemRelease")
            raise
        self.pointer = self._mapping.pointer
        self.num_bytes = num_bytes
        self.tensor = tensor_at(self.pointer, num_bytes, self.device, self)
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self.tensor
        self._mapping.release()


class HostMapping:
    """A page-aligned host buffer (an ``mmap``) page-locked and mapped into the GPU's address space.

    ``device_pointer(offset)`` is the address GPU streams use for byte ``offset`` of the buffer;
    the CPU keeps using the buffer itself. Two processes that map the same shared-memory file
    and register it each get their own device pointers to the same physical pages.
    """

    def __init__(self, buffer: mmap.mmap, device: int = 0) -> None:
        cu = driver()
        self.device = use_device(device)
        self._array = np.frombuffer(buffer, dtype=np.uint8)  # holds the mapping while registered
        self.host_pointer = int(self._array.ctypes.data)
        self.num_bytes = len(buffer)
        flags = cu.CU_MEMHOSTREGISTER_DEVICEMAP | cu.CU_MEMHOSTREGISTER_PORTABLE
        check(cu.cuMemHostRegister(self.host_pointer, self.num_bytes, flags), "cuMemHostRegister")
        try:
            self.base = int(
                check(cu.cuMemHostGetDevicePointer(self.host_pointer, 0), "cuMemHostGetDevicePointer")
            )
        except BaseException:
            check(cu.cuMemHostUnregister(self.host_pointer), "cuMemHostUnregister")
            raise
        self._closed = False

    def device_pointer(self, offset: int) -> int:
        return self.base + offset

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(self.device)
        with contextlib.suppress(CudaError):
            check(driver().cuMemHostUnregister(self.host_pointer), "cuMemHostUnregister")
        del self._array


class MemOps:
    """Stream memory operations, collected and enqueued in order as one ``cuStreamBatchMemOp``.

    ``write(address, value)`` stores a 32-bit word after every earlier operation of the stream
    (with a memory barrier: what the stream wrote before is visible first); ``wait_equal``
    holds the stream until the word at ``address`` equals ``value``. Addresses are device
    pointers (``HostMapping.device_pointer``, or device memory).
    """

    MAX_BATCH = 256  # the driver's limit on operations per batch

    def __init__(self) -> None:
        self._ops: list[Any] = []

    def _add(self, wait: bool, address: int, value: int) -> MemOps:
        cu = driver()
        kinds = cu.CUstreamBatchMemOpType
        kind = kinds.CU_STREAM_MEM_OP_WAIT_VALUE_32 if wait else kinds.CU_STREAM_MEM_OP_WRITE_VALUE_32
        op = cu.CUstreamBatchMemOpParams()
        op.operation = kind
        params = op.waitValue if wait else op.writeValue
        params.operation = kind
        params.address = address
        params.value = value & 0xFFFFFFFF
        params.flags = int(
            cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
            if wait
            else cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        )
        self._ops.append(op)
        return self

    def write(self, address: int, value: int) -> MemOps:
        return self._add(False, address, value)

    def write_bytes(self, address: int, data: bytes) -> MemOps:
        """``data`` (a multiple of 4 bytes) as little-endian 32-bit writes, in address order."""
        if len(data) % 4 or address % 4:
            raise ValueError("write_bytes: address and length must be multiples of 4")
        for i, word in enumerate(np.frombuffer(data, dtype="<u4").tolist()):
            self.write(address + 4 * i, int(word))
        return self

    def wait_equal(self, address: int, value: int) -> MemOps:
        return self._add(True, address, value)

    def enqueue(self, stream: torch.cuda.Stream | None = None, keep: bool = False) -> None:
        """Puts the operations on ``stream`` (default: the current one); clears the list unless ``keep``
        (a kept list is enqueued again by the next call without being rebuilt)."""
        cu = driver()
        handle = cu.CUstream((stream or torch.cuda.current_stream()).cuda_stream)
        ops = self._ops
        if not keep:
            self._ops = []
        for start in range(0, len(ops), self.MAX_BATCH):
            chunk = ops[start : start + self.MAX_BATCH]
            check(cu.cuStreamBatchMemOp(handle, len(chunk), chunk, 0), "cuStreamBatchMemOp")
