"""Backend registry: names, lazy imports, and the errors a caller sees."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from kernel_cases import make_case

from eaas.kernels import available_backends, experts_forward, get_backend, register_backend
from eaas.kernels.checks import check_expert_inputs
from eaas.kernels.reference import experts_forward_reference


def test_builtin_backends_are_listed() -> None:
    assert {"torch", "triton", "grouped_mm"} <= set(available_backends())


def test_unknown_backend_names_the_available_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown kernel backend 'cuda'; available: .*grouped_mm.*torch.*triton"
    ):
        get_backend("cuda")


def test_registered_backend_is_dispatched_to() -> None:
    calls: list[int] = []

    def doubled(x, group_of, weight_of, w13, w2, *, b13, b2, activation):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        assert b13 is None and b2 is None and activation.kind == "silu"
        return 2 * x

    register_backend("test-doubled", doubled)
    x = torch.ones(3, 4)
    y = experts_forward(
        x, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), x, x, backend="test-doubled"
    )
    assert calls == [3] and torch.equal(y, 2 * x)
    assert "test-doubled" in available_backends()


def test_simulated_device_computes_the_reference_and_takes_the_modelled_time() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 8)  # [T, H]
    w13, w2 = torch.randn(4, 2 * 16, 8), torch.randn(4, 8, 16)  # [G, 2I, H], [G, H, I]
    group_of = torch.tensor(
        [[0, 1], [1, -1], [2, 0], [0, 1], [1, 2], [-1, -1]]
    )  # [T, K]: 3 groups, 8 entries
    weight_of = torch.rand(6, 2)
    forward = get_backend("simulated:10000:5000")
    assert get_backend("simulated:10000:5000") is forward  # built once
    forward(x, group_of, weight_of, w13, w2)  # the first call also pays for torch's warm-up
    started = time.perf_counter()
    y = experts_forward(x, group_of, weight_of, w13, w2, backend="simulated:10000:5000")
    elapsed = time.perf_counter() - started
    assert torch.equal(y, experts_forward_reference(x, group_of, weight_of, w13, w2))
    assert 0.07 <= elapsed < 0.5  # 3 x 10 ms + 8 x 5 ms
    assert "simulated:..." in available_backends()


@pytest.mark.parametrize(
    "name", ["simulated", "simulated:1", "simulated:a:b", "simulated:-1:0", "simulated:1:2:3"]
)
def test_simulated_device_with_bad_arguments_says_what_it_expects(name: str) -> None:
    with pytest.raises(ValueError, match=r"expected simulated:EXPERT_US:ENTRY_US \(microseconds >= 0\)"):
        get_backend(name)


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


def test_import_is_cheap() -> None:
    """``import eaas.kernels`` imports neither Triton nor the backend modules."""
    code = (
        "import sys, eaas.kernels\n"
        "loaded = [m for m in ('triton', 'eaas.kernels.triton_backend', 'eaas.kernels.grouped_mm_backend')"
        " if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr


def test_triton_on_cpu_without_interpreter_is_a_clear_error() -> None:
    code = (
        "import torch\n"
        "from eaas.kernels import experts_forward\n"
        "x = torch.randn(2, 16)\n"
        "try:\n"
        "    experts_forward(x, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1),\n"
        "                    torch.randn(1, 32, 16), torch.randn(1, 16, 16), backend='triton')\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    result = _run_python(code, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    assert "runs on CUDA tensors; got tensors on cpu" in result.stdout
    assert "TRITON_INTERPRET=1" in result.stdout


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("x", r"x must be \[T, H\]"),
        ("group_of", r"group_of must be \[T=4, K\]"),
        ("weight_of", r"weight_of must be \[T, K\] = \(4, 2\)"),
        ("w13", r"w13 must be \[G, 2I, H=32\]"),
        ("w2", r"w2 must be \[G, H, I\] = \(3, 32, 16\)"),
        ("dtype", r"w13 and w2 must have the dtype of x"),
        ("ids", r"group_of.dtype must be int32 or int64"),
    ],
)
def test_bad_inputs_name_the_argument(field: str, message: str) -> None:
    case = make_case(4, 2, 3, hidden=32, inter=16, num_active=2, device=torch.device("cpu"))
    args = dict(x=case.x, group_of=case.group_of, weight_of=case.weight_of, w13=case.w13, w2=case.w2)
    broken = {
        "x": {"x": case.x[None]},
        "group_of": {"group_of": case.group_of[:3]},
        "weight_of": {"weight_of": case.weight_of[:, :1]},
        "w13": {"w13": case.w13[:, :, :31]},
        "w2": {"w2": case.w2[:, :, :15]},
        "dtype": {"w13": case.w13.half()},
        "ids": {"group_of": case.group_of.float()},
    }[field]
    args.update(broken)
    with pytest.raises(ValueError, match=message):
        check_expert_inputs(**args, backend="triton")
