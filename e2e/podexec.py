"""The last step before a pod's container process: runs as root inside the pod's network namespace
(``ip netns exec``, which also gives it a mount namespace of its own) and UTS namespace, sets the
hostname, mounts the volumes at their mount paths, makes the root filesystem read-only if asked,
drops to the pod's user and execs the container command.

Usage (by :mod:`e2e.podrunner` only): ``python podexec.py SPEC.json`` where the spec holds
``hostname``, ``mounts`` ([{source, target, readOnly}]), ``readOnlyRoot``, ``uid``, ``gid``,
``groups``, ``workingDir``, ``argv`` and ``env``. Standard library only: it runs before the pod's
environment exists.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, flags: int) -> None:
    if _libc.mount(source.encode() if source else None, target.encode(), None, flags, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {source} -> {target}: {os.strerror(error)}")


def _mount_point(target: str, is_dir: bool) -> None:
    if os.path.lexists(target):
        return
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()


def main(spec_path: str) -> None:
    with open(spec_path) as file:
        spec = json.load(file)
    if spec.get("hostname"):
        socket.sethostname(spec["hostname"])
    mounts = spec["mounts"]
    # Open every source first: a mount over a parent (an emptyDir at /tmp) must not hide the source
    # of a later one; /proc/self/fd/N reaches it anyway.
    sources = [os.open(m["source"], os.O_PATH | os.O_CLOEXEC) for m in mounts]
    # Parents first (as the kubelet sorts them); a mount point is made just before its mount, so
    # one inside another volume is made in that volume.
    for fd, mount in sorted(zip(sources, mounts, strict=True), key=lambda pair: pair[1]["target"].count("/")):
        _mount_point(mount["target"], os.path.isdir(f"/proc/self/fd/{fd}"))
        _mount(f"/proc/self/fd/{fd}", mount["target"], MS_BIND | MS_REC)
        if mount.get("readOnly"):
            _mount(None, mount["target"], MS_REMOUNT | MS_BIND | MS_RDONLY)
        os.close(fd)
    if spec.get("readOnlyRoot"):  # the root mount only: the volumes are mounts of their own
        _mount(None, "/", MS_REMOUNT | MS_BIND | MS_RDONLY)
    if spec.get("uid") is not None:
        os.setgroups(spec.get("groups") or [])
        os.setgid(spec["gid"] if spec.get("gid") is not None else spec["uid"])
        os.setuid(spec["uid"])
    if spec.get("noNewPrivs"):
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.chdir(spec.get("workingDir") or "/")
    argv = spec["argv"]
    env = spec["env"]
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception as error:  # reported in the container log; the runner sees the exit code
        print(f"podexec: cannot start the container: {error}", file=sys.stderr, flush=True)
        sys.exit(128)
