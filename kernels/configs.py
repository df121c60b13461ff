"""Tile configurations of the Triton grouped GEMMs, kept as data in ``tuned_configs.json``.

Lookup order for (device name, H, I, T): the device's entry for shape ``"H=<H>,I=<I>"``, then the
file's ``default`` table; within a table the token bucket nearest to T (in log2) wins.
``benchmarks/autotune_moe.py`` regenerates a device's entries on a GPU.

File layout::

    {"format": 1,
     "default": {"gate_up": {"<T bucket>": CONFIG, ...}, "down": {...}},
     "devices": {"<torch.cuda.get_device_name()>": {
         "source": "...", "shapes": {"H=7168,I=2048": {"gate_up": {...}, "down": {...}}}}}}

where CONFIG is ``{"block_m", "block_n", "block_k", "num_warps", "num_stages", "programs_per_sm"}``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

STAGES = ("gate_up", "down")
TUNED_CONFIGS_FILE = "tuned_configs.json"


@dataclass(frozen=True)
class TileConfig:
    """One GEMM launch: tile sizes (powers of two, ≥ 16), warps, pipeline stages, persistent occupancy."""

    block_m: int = 16  # entries (token rows) per tile
    block_n: int = 64  # output columns per tile (I for gate_up, H for down)
    block_k: int = 64  # reduction step (H for gate_up, I for down)
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2  # persistent programs launched per streaming multiprocessor

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if self.num_stages < 1 or self.programs_per_sm < 1:
            raise ValueError("TileConfig.num_stages and TileConfig.programs_per_sm must be >= 1")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TileConfig:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown TileConfig fields {sorted(unknown)}; allowed: {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**{key: int(value) for key, value in data.items()})


# Small tiles for Triton's CPU interpreter: tests use tiny shapes, and the interpreter ignores
# warps and stages.
INTERPRETER_CONFIG = TileConfig(
    block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1, programs_per_sm=1
)


def shape_key(hidden: int, inter: int) -> str:
    return f"H={hidden},I={inter}"


def nearest_bucket(num_tokens: int, buckets: list[int]) -> int:
    """The bucket nearest to ``num_tokens`` in log2 (ties go to the smaller bucket)."""
    if not buckets:
        raise ValueError("no token buckets to choose from")
    target = math.log2(max(num_tokens, 1))
    return min(sorted(buckets), key=lambda bucket: abs(math.log2(bucket) - target))


def _pick(table: dict[str, Any], num_tokens: int) -> TileConfig:
    bucket = nearest_bucket(num_tokens, [int(key) for key in table])
    return TileConfig.from_dict(table[str(bucket)])


@functools.lru_cache(maxsize=4)
def load_tuned_configs(path: str | None = None) -> dict[str, Any]:
    """The parsed configuration file (the packaged one when ``path`` is None), validated."""
    if path is None:
        text = resources.files("eaas.kernels").joinpath(TUNED_CONFIGS_FILE).read_text()
    else:
        text = Path(path).read_text()
    data = json.loads(text)
    validate_tuned_configs(data)
    return data


def validate_tuned_configs(data: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first malformed part of a configuration file."""
    if data.get("format") != 1:
        raise ValueError(f"tuned configs: 'format' must be 1, got {data.get('format')!r}")

    def check_stage_tables(tables: dict[str, Any], where: str) -> None:
        for stage in STAGES:
            if stage not in tables or not tables[stage]:
                raise ValueError(f"tuned configs: {where} needs a non-empty {stage!r} table")
            for bucket, config in tables[stage].items():
                if not bucket.isdigit() or int(bucket) < 1:
                    raise ValueError(
                        f"tuned configs: {where}.{stage} key {bucket!r} is not a token count >= 1"
                    )
                TileConfig.from_dict(config)

    check_stage_tables(data.get("default", {}), "default")
    for device, entry in data.get("devices", {}).items():
        for key, tables in entry.get("shapes", {}).items():
            check_stage_tables(tables, f"devices[{device!r}].shapes[{key!r}]")


def select_configs(
    device_name: str, hidden: int, inter: int, num_tokens: int, path: str | None = None
) -> tuple[TileConfig, TileConfig]:
    """(gate_up, down) tile configurations for ``num_tokens`` tokens of shape (H, I) on a device.

    A device's tuned buckets override the defaults' buckets of the same size; the defaults fill
    the buckets a (partial, e.g. ``--quick``) tuning did not measure.
    """
    data = load_tuned_configs(path)
    shapes = data.get("devices", {}).get(device_name, {}).get("shapes", {})
    tuned = shapes.get(shape_key(hidden, inter), {})
    default = data["default"]
    picked = [_pick({**default[stage], **tuned.get(stage, {})}, num_tokens) for stage in ("gate_up", "down")]
    return picked[0], picked[1]


def token_buckets(device_name: str, hidden: int, inter: int, path: str | None = None) -> list[int]:
    """Every token bucket ``select_configs`` may pick from for shape (H, I) on a device, ascending."""
    data = load_tuned_configs(path)
    tuned = data.get("devices", {}).get(device_name, {}).get("shapes", {}).get(shape_key(hidden, inter), {})
    buckets = {int(key) for stage in STAGES for key in (*data["default"][stage], *tuned.get(stage, {}))}
    return sorted(buckets)
