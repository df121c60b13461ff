"""One shared-memory segment per expert server: a page of segment header, then ``num_slots`` slots.

The segment is a file in ``/dev/shm`` mapped by the server and by each client. Byte 0 of the file
is the server's liveness lock; byte 0 of slot ``i`` is the liveness lock of the client that holds
slot ``i`` (``transport.liveness``). The segment header records the layout, so a client only
needs the name:

| offset | field | type |
|---|---|---|
| 8 | magic ``EAASSHM1`` | 8 bytes |
| 16 | num_slots | u32 |
| 20 | (pad) | u32 |
| 24 | slot capacity (payload bytes) | u64 |
| 32 | slot stride | u64 |
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import struct
import time
from pathlib import Path

import numpy as np

from eaas.runtime.protocol import FLAG_OFFSET, SlotState, slot_stride
from eaas.runtime.transport import liveness

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "eaas-"
SEGMENT_MAGIC = b"EAASSHM1"
SERVER_LOCK_OFFSET = 0
_HEADER = struct.Struct("<8sIIQQ")
_HEADER_OFFSET = 8
SLOTS_OFFSET = 4096
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class SegmentError(RuntimeError):
    """A segment is missing or is not an EaaS slot segment."""


def check_name(name: str) -> str:
    """A file name in ``SHM_DIR`` (no paths): letters, digits, '.', '_' and '-'."""
    if not _NAME.match(name) or name.startswith("."):
        raise SegmentError(f"shared-memory name: letters, digits, '.', '_' and '-' only, got {name!r}")
    return name


def new_segment_name(tag: str) -> str:
    return f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}"


class Segment:
    """A mapped segment. ``flags`` is a strided uint32 view of every slot's flag."""

    def __init__(self, name: str, fd: int, buffer: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.fd = fd
        self.buffer = buffer
        self.owner = owner
        magic, self.num_slots, _pad, self.capacity_bytes, self.stride = _HEADER.unpack_from(
            buffer, _HEADER_OFFSET
        )
        if magic != SEGMENT_MAGIC:
            raise SegmentError(f"shared-memory segment {name!r} is not an EaaS slot segment")
        if len(buffer) < SLOTS_OFFSET + self.num_slots * self.stride:
            raise SegmentError(f"shared-memory segment {name!r} is truncated")
        self.view = memoryview(buffer)
        self.flags = np.ndarray(
            (self.num_slots,),
            dtype="<u4",
            buffer=buffer,
            offset=SLOTS_OFFSET + FLAG_OFFSET,
            strides=(self.stride,),
        )

    @staticmethod
    def _path(name: str) -> Path:
        return SHM_DIR / check_name(name)

    @classmethod
    def create(cls, name: str, num_slots: int, capacity_bytes: int) -> Segment:
        """Creates the segment (every slot ``OFFLINE``) and takes the server's liveness lock."""
        if num_slots < 1:
            raise ValueError(f"num_slots: must be >= 1, got {num_slots}")
        stride = slot_stride(capacity_bytes)
        size = SLOTS_OFFSET + num_slots * stride
        fd = os.open(cls._path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            liveness.hold(fd, SERVER_LOCK_OFFSET)
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            cls._path(name).unlink(missing_ok=True)
            raise
        _HEADER.pack_into(buffer, _HEADER_OFFSET, SEGMENT_MAGIC, num_slots, 0, capacity_bytes, stride)
        segment = cls(name, fd, buffer, owner=True)
        segment.flags[:] = SlotState.OFFLINE
        return segment

    @classmethod
    def attach(cls, name: str) -> Segment:
        try:
            fd = os.open(cls._path(name), os.O_RDWR)
        except FileNotFoundError:
            raise SegmentError(
                f"shared-memory segment {name!r} does not exist (is the server on this host?)"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < SLOTS_OFFSET:
                raise SegmentError(f"shared-memory segment {name!r} is truncated")
            return cls(name, fd, mmap.mmap(fd, size), owner=False)
        except BaseException:
            os.close(fd)
            raise

    def slot_offset(self, slot: int) -> int:
        return SLOTS_OFFSET + slot * self.stride

    def slot(self, slot: int) -> memoryview:
        """The bytes of slot ``slot``: ``[flag | header | payload]``."""
        start = self.slot_offset(slot)
        return self.view[start : start + self.stride]

    def server_alive(self) -> bool:
        return liveness.is_held(self.fd, SERVER_LOCK_OFFSET)

    def close(self) -> None:
        """Unmaps (and, for the owner, unlinks). Views handed out earlier must be dropped first."""
        if self.owner:
            self._path(self.name).unlink(missing_ok=True)
        del self.flags
        self.view.release()
        with contextlib.suppress(BufferError):  # a tensor still aliases the mapping: unmapped when it goes
            self.buffer.close()
        os.close(self.fd)


def request_bell_name(segment: str) -> str:
    """The doorbell clients ring after setting ``REQUEST_READY``."""
    return f"{segment}.bell"


def response_bell_name(segment: str, slot: int) -> str:
    """The doorbell the server rings after setting slot ``slot`` to ``RESPONSE_READY`` (or ``OFFLINE``)."""
    return f"{segment}.r{slot}"


def sweep_stale_segments(min_age_s: float = 10.0) -> list[str]:
    """Unlinks EaaS segments whose server died without cleaning up (no liveness lock held)."""
    removed = []
    for path in SHM_DIR.glob(f"{NAME_PREFIX}*"):
        if "." in path.name:
            continue  # a doorbell: removed with its segment
        try:
            if time.time() - path.stat().st_mtime < min_age_s:
                continue
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            if not liveness.is_held(fd, SERVER_LOCK_OFFSET):
                for companion in [path, *SHM_DIR.glob(f"{path.name}.*")]:
                    companion.unlink(missing_ok=True)
                    removed.append(companion.name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def remove_segments_of(pid: int) -> list[str]:
    """Unlinks the segments created by process ``pid`` (call once it has exited)."""
    removed = []
    for path in SHM_DIR.glob(f"{NAME_PREFIX}*-{pid}-*"):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed
