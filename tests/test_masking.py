"""The mask helpers the kernels run (``solattn.masking``'s ``@triton.jit`` functions), executed as
device code (compiled on a GPU, Triton's interpreter on CPU) against the brute-force mask of the
oracle (``reference.allowed_mask``)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from oracle import DEVICE

from solattn.masking import band_mask, band_offsets, block_range, transposed_band, window_params
from solattn.reference import allowed_mask


@triton.jit
def _block_range_probe(OUT, n_rows, n_cols, left, right, TRANSPOSED: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                       HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Program ``i``: ``block_range`` of row block ``i`` -> OUT[i, 0:4]; forward band (rows are
    queries) or, with TRANSPOSED, the backward's (rows are keys), set up as the kernels do."""
    pid = tl.program_id(0)
    if TRANSPOSED:  # n_rows keys, n_cols queries
        lower, upper = band_offsets(n_cols, n_rows, left, right)
        t_lower, t_upper = transposed_band(lower, upper)
        lo, full_lo, full_hi, hi = block_range(pid * BLOCK_ROWS, n_rows, n_cols, t_lower,
                                               t_upper, BLOCK_ROWS, BLOCK_COLS, HAS_RIGHT,
                                               HAS_LEFT)
    else:
        lower, upper = band_offsets(n_rows, n_cols, left, right)
        lo, full_lo, full_hi, hi = block_range(pid * BLOCK_ROWS, n_rows, n_cols, lower, upper,
                                               BLOCK_ROWS, BLOCK_COLS, HAS_LEFT, HAS_RIGHT)
    tl.store(OUT + pid * 4 + 0, lo)
    tl.store(OUT + pid * 4 + 1, full_lo)
    tl.store(OUT + pid * 4 + 2, full_hi)
    tl.store(OUT + pid * 4 + 3, hi)


@triton.jit
def _band_mask_probe(OUT, n_rows, n_cols, left, right, TRANSPOSED: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """The whole ``[n_rows, n_cols]`` mask (n <= BLOCK) from ``band_mask`` with bounds checks."""
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    if TRANSPOSED:
        lower, upper = band_offsets(n_cols, n_rows, left, right)
        t_lower, t_upper = transposed_band(lower, upper)
        mask = band_mask(rows, cols, n_cols, t_lower, t_upper, HAS_RIGHT, HAS_LEFT, True)
    else:
        lower, upper = band_offsets(n_rows, n_cols, left, right)
        mask = band_mask(rows, cols, n_cols, lower, upper, HAS_LEFT, HAS_RIGHT, True)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(OUT + rows[:, None] * BLOCK + cols[None, :], mask.to(tl.int32), mask=ok)


WINDOWS = [
    (False, (-1, -1)),
    (True, (-1, -1)),
    (False, (0, 0)),
    (False, (7, 3)),
    (True, (20, -1)),
    (False, (-1, 4)),
    (False, (3, -1)),
]


def _ranges(n_rows, n_cols, causal, window, bm, bn, transposed):
    has_left, has_right, left, right = window_params(causal, window)
    n_blocks = triton.cdiv(n_rows, bm)
    out = torch.full((max(n_blocks, 1), 4), -7, dtype=torch.int32, device=DEVICE)
    if n_blocks:
        _block_range_probe[(n_blocks,)](out, n_rows, n_cols, left, right, TRANSPOSED=transposed,
                                        BLOCK_ROWS=bm, BLOCK_COLS=bn, HAS_LEFT=has_left,
                                        HAS_RIGHT=has_right)
    return out[:n_blocks].cpu().tolist()


@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("s_q,s_k", [(1, 1), (50, 50), (13, 70), (70, 13), (64, 128), (5, 0)])
@pytest.mark.parametrize("bm,bn", [(16, 16), (16, 32), (32, 8)])
def test_block_range_covers_exactly_the_band(s_q, s_k, causal, window, bm, bn, transposed):
    """[lo, hi) holds every allowed column, [full_lo, full_hi) only fully allowed whole blocks."""
    ok = allowed_mask(s_q, s_k, causal, window)
    if transposed:  # rows are keys, columns are queries
        ok = ok.T
    n_rows, n_cols = ok.shape
    for i, (lo, full_lo, full_hi, hi) in enumerate(_ranges(n_rows, n_cols, causal, window, bm,
                                                           bn, transposed)):
        rows = ok[i * bm:(i + 1) * bm]
        assert 0 <= lo <= full_lo <= full_hi <= hi <= max(n_cols, lo)
        assert lo % bn == 0 and (full_lo % bn == 0 or full_lo == hi)
        cols = rows.any(0).nonzero().flatten()
        if len(cols):
            assert lo <= cols.min() and cols.max() < hi
        assert (full_hi - full_lo) % bn == 0
        # Full blocks: every real row of the block sees every column (rows past the end are
        # never stored by the kernels, so they are not checked).
        if full_hi > full_lo:
            assert rows[:, full_lo:full_hi].all()
            assert full_hi <= n_cols


@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("s_q,s_k", [(23, 41), (41, 23), (1, 30)])
def test_band_mask_is_the_oracle_mask(s_q, s_k, causal, window, transposed):
    has_left, has_right, left, right = window_params(causal, window)
    ok = allowed_mask(s_q, s_k, causal, window)
    if transposed:
        ok = ok.T
    n_rows, n_cols = ok.shape
    out = torch.full((64, 64), -1, dtype=torch.int32, device=DEVICE)
    _band_mask_probe[(1,)](out, n_rows, n_cols, left, right, TRANSPOSED=transposed, BLOCK=64,
                           HAS_LEFT=has_left, HAS_RIGHT=has_right)
    assert torch.equal(out[:n_rows, :n_cols].cpu().bool(), ok.cpu())
