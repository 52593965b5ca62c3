"""The oracle's own checks: the tiled online-softmax algorithm against the materialized one."""

from __future__ import annotations

import pytest
import torch
from oracle import max_err

from solattn.reference import attention_ref, attention_tiled


@pytest.mark.parametrize(
    "causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 2)), (True, (8, -1))]
)
@pytest.mark.parametrize("s_q,s_k", [(37, 37), (10, 53), (53, 10)])
def test_tiled_matches_naive(s_q, s_k, causal, window):
    q = torch.randn(2, s_q, 4, 32, dtype=torch.float64)
    k = torch.randn(2, s_k, 2, 32, dtype=torch.float64)
    v = torch.randn(2, s_k, 2, 24, dtype=torch.float64)
    out, lse = attention_tiled(q, k, v, causal=causal, window_size=window, block_m=16, block_n=8)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window)
    assert max_err(out, ref) < 1e-5
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = ~torch.isinf(ref_lse)
    assert max_err(lse[finite], ref_lse[finite]) < 1e-5
