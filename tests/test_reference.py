"""The oracle's own checks: the tiled online-softmax algorithm, and the mask band's block ranges."""

from __future__ import annotations

import pytest
import torch
from oracle import max_err

from solattn.masking import band_from_window, block_range_py, transpose_band
from solattn.reference import allowed_mask, attention_ref, attention_tiled


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


WINDOWS = [
    (False, (-1, -1)),
    (True, (-1, -1)),
    (False, (0, 0)),
    (False, (7, 3)),
    (True, (20, -1)),
    (False, (-1, 4)),
    (False, (3, -1)),
]


@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("s_q,s_k", [(1, 1), (50, 50), (13, 70), (70, 13), (64, 128), (5, 0)])
@pytest.mark.parametrize("bm,bn", [(16, 16), (16, 32), (32, 8)])
def test_block_range_covers_exactly_the_band(s_q, s_k, causal, window, bm, bn):
    """[lo, hi) holds every allowed column, [full_lo, full_hi) only fully allowed whole blocks."""
    band = band_from_window(causal, window, s_q, s_k)
    ok = allowed_mask(s_q, s_k, causal, window)
    for row_start in range(0, s_q, bm):
        rows = ok[row_start : row_start + bm]
        lo, full_lo, full_hi, hi = block_range_py(row_start, s_q, s_k, band, bm, bn)
        assert 0 <= lo <= full_lo <= full_hi <= hi <= max(s_k, lo)
        assert lo % bn == 0 and full_lo % bn == 0 or full_lo == hi
        cols = rows.any(0).nonzero().flatten()
        if len(cols):
            assert lo <= cols.min() and cols.max() < hi
        assert (full_hi - full_lo) % bn == 0
        # full blocks: every row of the (whole, unragged) row block sees every column. Rows past
        # s_q are ignored by the kernel, so check the real rows only.
        if full_hi > full_lo:
            assert rows[:, full_lo:full_hi].all()
            assert full_hi <= s_k


@pytest.mark.parametrize("causal,window", WINDOWS)
def test_transposed_band_is_the_same_mask(causal, window):
    s_q, s_k = 23, 41
    band = band_from_window(causal, window, s_q, s_k)
    t = transpose_band(band)
    ok = allowed_mask(s_q, s_k, causal, window)
    r = torch.arange(s_k)[:, None]  # keys as rows
    c = torch.arange(s_q)[None, :]  # queries as columns
    mine = torch.ones(s_k, s_q, dtype=torch.bool)
    if t.has_lower:
        mine &= c >= r + t.lower
    if t.has_upper:
        mine &= c <= r + t.upper
    assert torch.equal(mine, ok.T)
