"""Device-side alignment and group shrink (align.py) against ``align_reference``."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE

from eaas.kernels.reference import align_reference


def _align(group_of: torch.Tensor, num_groups: int) -> dict[str, torch.Tensor]:
    from eaas.kernels.align import align_entries

    alignment = align_entries(group_of.to(DEVICE), num_groups)
    num_active = int(alignment.num_active.item())
    num_valid = int(alignment.group_counts.sum().item())
    return {
        "group_counts": alignment.group_counts,
        "group_starts": alignment.group_starts,
        "active_groups": alignment.active_groups[:num_active],
        "active_counts": alignment.active_counts[:num_active],
        "active_starts": alignment.active_starts[:num_active],
        "sorted_entries": alignment.sorted_entries[:num_valid],
    }


def _check(group_of: torch.Tensor, num_groups: int) -> dict[str, torch.Tensor]:
    got = {name: value.cpu().long() for name, value in _align(group_of, num_groups).items()}
    expected = align_reference(group_of, num_groups)
    for name in ("group_counts", "group_starts", "active_groups", "active_counts", "active_starts"):
        assert torch.equal(got[name], expected[name]), name
    # Inside one group the order of entries is not fixed: compare each group's run as a set.
    for start, count in zip(
        expected["active_starts"].tolist(), expected["active_counts"].tolist(), strict=True
    ):
        run = slice(start, start + count)
        assert torch.equal(got["sorted_entries"][run].sort().values, expected["sorted_entries"][run])
    assert len(got["sorted_entries"]) == len(expected["sorted_entries"])
    return got


@pytest.mark.parametrize("num_active", [1, 2, 8])
def test_shrink_compacts_active_groups_of_512(num_active: int) -> None:
    generator = torch.Generator().manual_seed(num_active)
    active = torch.randperm(512, generator=generator)[:num_active]
    group_of = active[torch.randint(0, num_active, (50, 8), generator=generator)]
    got = _check(group_of, 512)
    assert len(got["active_groups"]) == num_active
    assert got["active_groups"].tolist() == sorted(active.tolist())


def test_scan_carries_across_chunks() -> None:
    """G larger than one shrink step (1024 groups): starts and slots carry across chunks."""
    group_of = torch.tensor([[2999, 0], [1500, -1], [1023, 1024], [2999, 5]])
    got = _check(group_of, 3000)
    assert got["active_groups"].tolist() == [0, 5, 1023, 1024, 1500, 2999]


def test_all_skipped_and_empty() -> None:
    got = _check(torch.full((6, 4), -1), 16)
    assert len(got["active_groups"]) == 0
    got = _check(torch.zeros((0, 4), dtype=torch.long), 16)
    assert len(got["sorted_entries"]) == 0


def test_out_of_range_ids_are_skipped() -> None:
    got = _check(torch.tensor([[0, 7], [-5, 3]]), 4)
    assert got["active_groups"].tolist() == [0, 3]


def test_int32_ids() -> None:
    _check(torch.randint(-1, 10, (33, 3), dtype=torch.int32), 10)
