"""Loading one expert server's share of a sharded checkpoint, against plain file reads of the
same bytes, in the same run.

The checkpoint (bf16, sharded) is written first and read once so that both sides read from the
page cache; each measurement runs in a fresh process so peak RSS is its own. ``eaas`` is
``ExpertStack.load`` (index, header checks, shape checks, stacking into the served layout);
``plain`` preads the same tensors' byte ranges into one preallocated buffer.

Targets: eaas GB/s >= 0.8x plain; eaas peak RSS growth < 1.5x the share's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import _common


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _share(config: Any, servers: int) -> list[tuple[int, int]]:
    """Server 0's experts when experts are dealt round-robin to ``servers`` servers (R=1)."""
    return [(layer, e) for layer in config.moe_layers for e in range(config.num_experts) if e % servers == 0]


def measure(mode: str, directory: str, servers: int) -> dict[str, Any]:
    """Runs in a child process: loads the share one way and reports seconds, bytes, RSS growth."""
    import torch

    from eaas.runtime.model import CheckpointReader, ExpertStack
    from eaas.runtime.model.naming import expert_tensor_names

    reader = CheckpointReader(directory)
    pairs = _share(reader.config, servers)
    names = [n for pair in pairs for n in expert_tensor_names(reader.config, *pair)]
    ranges = _byte_ranges(Path(directory), reader.weight_map, names)
    share_bytes = sum(end - start for _, start, end in ranges)
    torch.zeros(1)  # allocator warm
    before = _rss_kib("VmRSS")
    start = time.perf_counter()
    if mode == "eaas":
        stack = ExpertStack.load(reader, pairs)
        assert stack.nbytes == share_bytes
    else:
        buffer = torch.empty(share_bytes, dtype=torch.uint8)  # allocated like the stack: not zero-filled
        view = memoryview(buffer.numpy())
        offset = 0
        handles: dict[str, int] = {}
        for path, begin, end in ranges:
            fd = handles.setdefault(path, os.open(path, os.O_RDONLY))
            size = end - begin
            done = os.preadv(fd, [view[offset : offset + size]], begin)
            assert done == size
            offset += size
        for fd in handles.values():
            os.close(fd)
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM")
    return {"mode": mode, "seconds": seconds, "bytes": share_bytes, "rss_growth": (peak - before) * 1024}


def _byte_ranges(directory: Path, weight_map: dict[str, str], names: list[str]) -> list[tuple[str, int, int]]:
    """(file, first byte, end byte) of each tensor, from the safetensors headers."""
    headers: dict[str, tuple[int, dict[str, Any]]] = {}
    ranges = []
    for name in names:
        path = str(directory / weight_map[name])
        if path not in headers:
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                headers[path] = (8 + length, json.loads(f.read(length)))
        base, header = headers[path]
        begin, end = header[name]["data_offsets"]
        ranges.append((path, base + begin, base + end))
    return ranges


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.servers)))
        return

    from eaas.runtime.model import preset, write_random_checkpoint

    layers, experts = (3, 32) if args.quick else (5, 64)
    config = preset(
        "qwen3_moe",
        "tiny",
        hidden_size=1024,
        expert_intermediate_size=512,
        num_layers=layers,
        num_experts=experts,
        top_k=4,
    )
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_random_checkpoint(config, tmp, dtype="bfloat16", max_shard_bytes=64 << 20)
        for shard in sorted(directory.glob("*.safetensors")):
            shard.read_bytes()  # page cache: both sides read warm
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "eaas": []}
        for _ in range(args.repeats):
            for mode in ("plain", "eaas"):
                child = [
                    sys.executable,
                    __file__,
                    "--servers",
                    str(args.servers),
                    "--child",
                    mode,
                    str(directory),
                ]
                out = subprocess.run(child, capture_output=True, text=True, check=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    share = runs["eaas"][0]["bytes"]
    rows = []
    for mode, samples in runs.items():
        seconds = statistics.median(s["seconds"] for s in samples)
        rss = statistics.median(s["rss_growth"] for s in samples)
        rate = share / seconds / 1e9
        rows.append(
            {
                "mode": mode,
                "share_bytes": share,
                "seconds": seconds,
                "gb_per_s": rate,
                "peak_rss_growth_bytes": rss,
            }
        )
        print(
            f"{mode:6s} {share / 2**20:8.1f} MiB  {seconds * 1e3:8.1f} ms  {rate:6.2f} GB/s  "
            f"+{rss / 2**20:.1f} MiB RSS"
        )
    plain, ours = rows
    ratio = ours["gb_per_s"] / plain["gb_per_s"]
    rss_ratio = ours["peak_rss_growth_bytes"] / share
    print(f"eaas / plain throughput {ratio:.2f}x; eaas peak RSS growth {rss_ratio:.2f}x the share")
    _common.emit(
        "load_checkpoint",
        rows,
        {
            "throughput_vs_plain_read": _common.target(ratio, 0.8),
            "peak_rss_vs_share_bytes": _common.target(rss_ratio, 1.5, higher_is_better=False),
        },
        args.json_out,
    )


if __name__ == "__main__":
    main()
