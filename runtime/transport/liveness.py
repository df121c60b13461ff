"""Process liveness through open-file-description (OFD) byte-range locks on a shared file.

A process takes a write lock on one byte of a shared-memory segment and keeps the file open; the
kernel drops the lock when that process dies, however it dies (SIGKILL included). Anyone with the
file open can ask whether the byte is still locked without taking the lock. OFD locks belong to
the open file, not the process, so two clients in one process do not release each other's locks
(plain POSIX record locks would). Linux-only (``F_OFD_SETLK`` since 3.15).
"""

from __future__ import annotations

import fcntl
import struct

# struct flock on Linux: l_type, l_whence (short); l_start, l_len (off_t); l_pid (int, 0 for OFD locks)
_FLOCK = struct.Struct("hhqqi")


def _flock(lock_type: int, offset: int) -> bytes:
    # The kernel reads sizeof(struct flock) bytes; pad to be safe on every 64-bit ABI.
    return _FLOCK.pack(lock_type, 0, offset, 1, 0) + bytes(8)


def hold(fd: int, offset: int) -> None:
    """Takes the write lock on byte ``offset``; ``BlockingIOError`` if another open file holds it."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, offset))


def release(fd: int, offset: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, offset))


def is_held(fd: int, offset: int) -> bool:
    """True while some other open file description holds a lock on byte ``offset``."""
    result = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, offset))
    return _FLOCK.unpack_from(result)[0] != fcntl.F_UNLCK
