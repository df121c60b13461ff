"""The per-group-loop reference against a direct per-(token, entry) definition."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_cases import make_case

from eaas.kernels.reference import experts_forward_reference


def test_reference_matches_the_definition() -> None:
    case = make_case(9, 3, 5, hidden=12, inter=7, num_active=4, device=torch.device("cpu"), seed=21)
    expected = torch.zeros(9, 12)
    for token in range(9):
        for k in range(3):
            group = int(case.group_of[token, k])
            if group < 0:
                continue
            gate, up = case.w13[group, :7], case.w13[group, 7:]
            hidden = F.silu(case.x[token] @ gate.T) * (case.x[token] @ up.T)
            expected[token] += case.weight_of[token, k] * (hidden @ case.w2[group].T)
    torch.testing.assert_close(experts_forward_reference(*case.args()), expected, atol=1e-5, rtol=1e-5)
