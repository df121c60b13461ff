"""Tuned tile configurations: the packaged file is valid and lookups pick what they should."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaas.kernels.configs import (
    TileConfig,
    load_tuned_configs,
    nearest_bucket,
    select_configs,
    token_buckets,
    validate_tuned_configs,
)


def test_packaged_file_is_valid() -> None:
    data = load_tuned_configs()
    assert data["format"] == 1
    gate_up, down = select_configs("no such device", 7168, 2048, 128)
    assert isinstance(gate_up, TileConfig) and isinstance(down, TileConfig)


@pytest.mark.parametrize(("num_tokens", "bucket"), [(0, 1), (1, 1), (5, 8), (20, 16), (24, 32), (3000, 2048)])
def test_nearest_bucket_in_log2(num_tokens: int, bucket: int) -> None:
    assert nearest_bucket(num_tokens, [1, 8, 16, 32, 2048]) == bucket


def test_device_entry_overrides_default(tmp_path: Path) -> None:
    tuned = TileConfig(block_m=64, block_n=128, block_k=32, num_warps=8, num_stages=4, programs_per_sm=1)
    data = load_tuned_configs()
    data = {
        **data,
        "devices": {
            "Test GPU": {
                "source": "test",
                "shapes": {
                    "H=256,I=128": {"gate_up": {"64": tuned.as_dict()}, "down": {"64": tuned.as_dict()}}
                },
            }
        },
    }
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(data))
    assert select_configs("Test GPU", 256, 128, 64, path=str(path)) == (tuned, tuned)
    assert select_configs("Test GPU", 256, 128, 70, path=str(path)) == (tuned, tuned)
    # Buckets the tuning did not measure keep the defaults (a partial tuning shadows nothing else).
    default = data["default"]
    want = (TileConfig.from_dict(default["gate_up"]["1"]), TileConfig.from_dict(default["down"]["1"]))
    assert select_configs("Test GPU", 256, 128, 1, path=str(path)) == want
    assert select_configs("Test GPU", 512, 128, 64, path=str(path)) != (tuned, tuned)
    assert select_configs("Other GPU", 256, 128, 64, path=str(path)) != (tuned, tuned)
    # The buckets a server's warm-up compiles one batch for: the defaults' and the device's own.
    defaults = {int(k) for stage in ("gate_up", "down") for k in default[stage]}
    assert token_buckets("Other GPU", 256, 128, path=str(path)) == sorted(defaults)
    assert token_buckets("Test GPU", 256, 128, path=str(path)) == sorted(defaults | {64})


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format=2), "'format' must be 1"),
        (lambda d: d["default"].pop("down"), "non-empty 'down' table"),
        (lambda d: d["default"]["gate_up"].update({"x": {}}), "key 'x' is not a token count"),
        (lambda d: d["default"]["gate_up"]["1"].update(block_n=48), "block_n must be a power of two"),
        (lambda d: d["default"]["gate_up"]["1"].update(warps=4), "unknown TileConfig fields"),
    ],
)
def test_malformed_files_are_named(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(json.dumps(load_tuned_configs()))
    mutate(data)
    with pytest.raises(ValueError, match=message):
        validate_tuned_configs(data)
