"""One definition of every attention mask: bounds, causal, sliding window.

Every kernel (forward, backward, decode, Hopper) asks this module two questions:

1. *Which key columns may row ``r`` see?*  Every mask solattn supports is a band::

       r + lower <= c <= r + upper      and      0 <= c < n_cols

   For the forward pass rows are queries and columns are keys. flash-attn aligns the mask to the
   bottom-right corner: query ``i`` sits at key position ``i + seqlen_k - seqlen_q``. With
   ``window_size = (left, right)`` (``-1`` = unbounded) and ``off = seqlen_k - seqlen_q``::

       lower = off - left          upper = off + right          (causal: right = 0)

   Example, causal with seqlen_q = 2, seqlen_k = 5 (off = 3)::

       keys     0 1 2 3 4
       query 0  x x x x .        query 0 sees keys 0..3
       query 1  x x x x x        query 1 sees keys 0..4

   The backward kernel walks the transposed problem (rows are keys, columns are queries):
   ``c_q >= r_k - upper`` and ``c_q <= r_k - lower``, so it calls the same helpers with
   ``(lower, upper) -> (-upper, -lower)`` and the flags swapped (:func:`transposed_band`).

2. *Which column blocks does a block of rows need, and which of those need no per-element mask?*
   :func:`block_range` returns ``(lo, full_lo, full_hi, hi)``: columns ``[lo, hi)`` hold every
   allowed column (blocks wholly outside are skipped, never loaded: the seeds' tile skipping), and
   ``[full_lo, full_hi)`` are whole blocks where every column is allowed for every row, so the inner
   loop runs there without a mask. ``[lo, full_lo)`` and ``[full_hi, hi)`` are the masked edges
   (the causal diagonal, the window's edges, the ragged tail of the sequence).

Host code normalizes the user's ``(causal, window_size)`` once, in :func:`window_params` (through
:class:`solattn.params.AttnParams`), into the two constexpr flags ``HAS_LOWER`` / ``HAS_UPPER``
and the sequence-independent offsets; kernels add each sequence's ``seqlen_k - seqlen_q``
(:func:`band_offsets`).
"""

from __future__ import annotations

import triton
import triton.language as tl


def window_params(causal: bool, window_size: tuple[int, int]) -> tuple[bool, bool, int, int]:
    """``(HAS_LEFT, HAS_RIGHT, left, right)``: the sequence-independent part of the band.

    Kernels add ``seqlen_k - seqlen_q`` of the sequence they work on (varlen sequences differ)
    through :func:`band_offsets`.
    """
    left, right = window_size
    if causal:
        right = 0
    return left >= 0, right >= 0, max(left, 0), max(right, 0)


@triton.jit
def band_offsets(seqlen_q, seqlen_k, left, right):
    """``(lower, upper)`` of the forward band for one sequence: ``off - left``, ``off + right``."""
    off = seqlen_k - seqlen_q
    return off - left, off + right


@triton.jit
def transposed_band(lower, upper):
    """The same band seen from the columns (rows become columns): ``(-upper, -lower)``, with the
    ``HAS_LOWER`` / ``HAS_UPPER`` flags swapped by the caller. The backward's dK/dV kernel walks
    keys as rows and queries as columns with it."""
    return -upper, -lower


@triton.jit
def band_mask(
    rows,
    cols,
    n_cols,
    lower,
    upper,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    CHECK_BOUNDS: tl.constexpr,
):
    """Boolean ``[len(rows), len(cols)]`` tile: True where column ``c`` is allowed for row ``r``.

    ``rows``/``cols`` are absolute indices (``tl.arange`` plus the block start). ``CHECK_BOUNDS``
    adds ``c < n_cols`` (the ragged last block). Every mask of every kernel is this function.
    """
    r = rows[:, None]
    c = cols[None, :]
    mask = c >= 0  # all-True tile of the right shape
    if CHECK_BOUNDS:
        mask = mask & (c < n_cols)
    if HAS_LOWER:
        mask = mask & (c >= r + lower)
    if HAS_UPPER:
        mask = mask & (c <= r + upper)
    return mask


@triton.jit
def block_range(
    row_start,
    n_rows,
    n_cols,
    lower,
    upper,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
):
    """Column range ``(lo, full_lo, full_hi, hi)`` for rows ``[row_start, row_start + BLOCK_ROWS)``.

    * ``[lo, hi)``: every column any row of the block may see, ``lo`` a multiple of
      ``BLOCK_COLS`` (blocks outside are never loaded). Empty (``lo >= hi``) when no row sees any
      column.
    * ``[full_lo, full_hi)``: whole column blocks allowed for every row *and* inside ``n_cols``,
      run without a per-element mask. ``lo <= full_lo <= full_hi <= hi``.

    Rows past ``n_rows`` are ignored (their results are never stored), so they do not widen the
    range.
    """
    row_last = tl.minimum(row_start + BLOCK_ROWS, n_rows) - 1
    # Union over rows: the first row gives the smallest lower edge, the last row the largest upper.
    lo = 0
    hi = n_cols
    if HAS_LOWER:
        lo = tl.maximum(row_start + lower, 0)
    if HAS_UPPER:
        hi = tl.minimum(row_last + upper + 1, n_cols)
    lo = (lo // BLOCK_COLS) * BLOCK_COLS
    hi = tl.maximum(hi, lo)
    # Intersection over rows: columns every row (row_start .. row_start + BLOCK_ROWS - 1, the
    # ragged rows included, harmlessly) sees without a mask.
    full_lo = lo
    full_hi = n_cols
    if HAS_LOWER:
        full_lo = tl.maximum(row_start + BLOCK_ROWS - 1 + lower, 0)
    if HAS_UPPER:
        full_hi = tl.minimum(row_start + upper + 1, n_cols)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_COLS) * BLOCK_COLS, lo), hi)
    full_hi = (full_hi // BLOCK_COLS) * BLOCK_COLS
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi
