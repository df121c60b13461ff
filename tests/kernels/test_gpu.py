"""GPU-only checks: bf16 at decode-like sizes, no host synchronisation, CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_matches, make_case, reference_fp32

from eaas.kernels import experts_forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize(("num_tokens", "num_active"), [(1, 8), (128, 8), (512, 64)])
def test_bf16_decode_sizes(backend: str, num_tokens: int, num_active: int) -> None:
    if backend == "grouped_mm" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch._grouped_mm needs SM80+")
    case = make_case(num_tokens, 8, 256, hidden=1024, inter=512, num_active=num_active, dtype=torch.bfloat16)
    y = experts_forward(*case.args(), backend=backend)
    assert y.dtype == torch.bfloat16
    assert_matches(y, reference_fp32(case), torch.bfloat16)


def test_shrink_off_equals_on_with_256_groups() -> None:
    from eaas.kernels.triton_backend import experts_forward_triton

    case = make_case(64, 8, 256, hidden=512, inter=256, num_active=8, dtype=torch.bfloat16, seed=2)
    on = experts_forward_triton(*case.args(), shrink=True)
    off = experts_forward_triton(*case.args(), shrink=False)
    assert_matches(on, reference_fp32(case), torch.bfloat16)
    assert_matches(off, reference_fp32(case), torch.bfloat16)


def test_no_host_synchronisation() -> None:
    case = make_case(32, 8, 64, hidden=256, inter=128, num_active=8, dtype=torch.bfloat16, seed=3)
    experts_forward(*case.args(), backend="triton")  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        experts_forward(*case.args(), backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replay_follows_new_routing() -> None:
    case = make_case(48, 8, 128, hidden=256, inter=128, num_active=6, dtype=torch.bfloat16, seed=4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            experts_forward(*case.args(), backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = experts_forward(*case.args(), backend="triton")
    new = make_case(48, 8, 128, hidden=256, inter=128, num_active=30, dtype=torch.bfloat16, seed=5)
    case.x.copy_(new.x)
    case.group_of.copy_(new.group_of)
    case.weight_of.copy_(new.weight_of)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(y, reference_fp32(case), torch.bfloat16)
