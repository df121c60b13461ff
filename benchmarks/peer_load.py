"""Time to ready of a new expert server whose share live peers hold: fetched from a peer against
read from the checkpoint, in the same run.

A random checkpoint of a real expert shape (DeepSeek-V3's: hidden 7168, expert intermediate 2048,
bf16, 84 MiB an expert; 12 experts, 1.0 GiB; ``--quick``: hidden 2048, intermediate 1024, 144 MiB)
is written and read once, so the checkpoint side reads from the page cache: storage at its best,
which no cluster's shared filesystem or object store is. ``--donors`` (2) ``eaas expert-server``
processes host every expert (the placement has donors + 1 servers, each holding all). Then,
``--repeats`` times each, a new server process that must host the same share starts (the last
ordinal) with ``--peer`` naming the donors (its experts fetched from their control ports behind
the data token, spread over them and fetched in parallel, SHA-256 checked) or without (read from
the checkpoint), and the time from its spawn to its ready file is measured. Both sides pay the
same process start and warm-up; the load itself is taken from the server's log (``fetched ...``
/ ``loaded ...``, with GB/s). Medians are printed with the ratio ``from the checkpoint / from
peers``. Target: peers add at most 25% to the time to ready against the checkpoint read from the
page cache (the best storage can do; on a cluster's shared storage the comparison only improves).

What it says about a cluster is in docs/benchmarks.md ("Weights from peers"): the peer path here
is loopback TCP with SHA-256 on both ends; across nodes it is bound by the NICs, where
the checkpoint side is bound by the storage all loading servers share.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import _common

TOKEN = "peer-load-benchmark-token"
LOAD_LINE = re.compile(r"(fetched|loaded) (\d+) experts.*?: ([\d.]+) MiB in ([\d.]+) s \(([\d.]+) GB/s\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    checkpoint: Path, placement: Path, ordinal: int, work: Path, tag: str, peers: list[str]
) -> tuple[subprocess.Popen[bytes], Path, Path, float]:
    ready = work / f"{tag}.ready"
    log = work / f"{tag}.log"
    argv = [
        sys.executable, "-m", "eaas.runtime.cli", "expert-server",
        "--checkpoint", str(checkpoint), "--placement", str(placement), "--ordinal", str(ordinal),
        "--transports", "tcp", "--data-token", TOKEN, "--ready-file", str(ready), "--threads", "1",
        "--control-port", str(free_port()),
        *[arg for peer in peers for arg in ("--peer", peer)],
    ]  # fmt: skip
    started = time.perf_counter()
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    return process, ready, log, started


def wait_ready(process: subprocess.Popen[bytes], ready: Path, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if process.poll() is not None:
            raise RuntimeError(f"expert server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"expert server not ready after {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def measure(
    checkpoint: Path, placement: Path, ordinal: int, work: Path, tag: str, peers: list[str]
) -> dict[str, Any]:
    process, ready, log, started = start_server(checkpoint, placement, ordinal, work, tag, peers)
    try:
        wait_ready(process, ready, log)
        seconds = time.perf_counter() - started
    finally:
        stop(process)
    text = log.read_text()
    loads = LOAD_LINE.findall(text)
    if not loads:
        raise RuntimeError(f"{tag}: no load line in the server's log:\n{text[-3000:]}")
    how, experts, mib, load_s, rate = loads[0]
    if peers and how != "fetched":
        raise RuntimeError(f"{tag}: the server did not fetch from its peer:\n{text[-3000:]}")
    return {
        "to_ready_s": seconds,
        "load_s": float(load_s),
        "gb_per_s": float(rate),
        "mib": float(mib),
        "experts": int(experts),
        "how": how,
    }


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--donors", type=int, default=2)
    args = p.parse_args()

    from eaas.runtime.model import preset, write_random_checkpoint
    from eaas.runtime.placement import round_robin

    hidden, inter = (2048, 1024) if args.quick else (7168, 2048)
    experts = 12
    config = preset(
        "qwen3_moe",
        "tiny",
        hidden_size=hidden,
        expert_intermediate_size=inter,
        num_layers=1,
        num_experts=experts,
        top_k=2,
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checkpoint = write_random_checkpoint(
            config, work / "ckpt", dtype="bfloat16", max_shard_bytes=512 << 20
        )
        for shard in sorted(checkpoint.glob("*.safetensors")):
            shard.read_bytes()  # the page cache: storage at its best
        placement = work / "placement.json"
        servers = args.donors + 1
        placement.write_text(round_robin(config.moe_layers, experts, servers, replication=servers).to_json())
        donors = [start_server(checkpoint, placement, n, work, f"donor-{n}", []) for n in range(args.donors)]
        try:
            urls = []
            for n, (donor, ready, log, _) in enumerate(donors):
                wait_ready(donor, ready, log)
                urls.append(f"{n}=http://127.0.0.1:{json.loads(ready.read_text())['control_port']}")
            runs: dict[str, list[dict[str, Any]]] = {"checkpoint": [], "peer": []}
            for repeat in range(args.repeats):
                for mode in ("checkpoint", "peer"):
                    peers = urls if mode == "peer" else []
                    runs[mode].append(
                        measure(checkpoint, placement, args.donors, work, f"{mode}-{repeat}", peers)
                    )
        finally:
            for donor, *_ in donors:
                stop(donor)
    rows = []
    for mode, samples in runs.items():
        row = {
            "mode": mode,
            "share_mib": samples[0]["mib"],
            "experts": samples[0]["experts"],
            "to_ready_s": statistics.median(s["to_ready_s"] for s in samples),
            "load_s": statistics.median(s["load_s"] for s in samples),
            "load_gb_per_s": statistics.median(s["gb_per_s"] for s in samples),
            "to_ready_all_s": [round(s["to_ready_s"], 3) for s in samples],
        }
        rows.append(row)
        print(
            f"{mode:10s} {row['share_mib']:8.1f} MiB  to ready {row['to_ready_s']:6.2f} s "
            f"(runs {row['to_ready_all_s']})  load {row['load_s']:6.2f} s  {row['load_gb_per_s']:5.2f} GB/s"
        )
    checkpoint_row, peer_row = rows
    ratio = checkpoint_row["to_ready_s"] / peer_row["to_ready_s"]
    load_ratio = checkpoint_row["load_s"] / peer_row["load_s"]
    print(
        f"to ready: from the checkpoint / from a peer = {ratio:.2f}x; the load alone {load_ratio:.2f}x "
        f"(the checkpoint from the page cache, {args.donors} peer(s) over loopback TCP with SHA-256; "
        f"{os.cpu_count()} CPUs)"
    )
    _common.emit(
        "peer_load",
        rows,
        # Against storage at its best (the page cache), peers may cost a little: at most 25% more.
        {"to_ready_peer_over_checkpoint": _common.target(1 / ratio, 1.25, higher_is_better=False)},
        args.json_out,
    )


if __name__ == "__main__":
    main()
