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
   ``(lower, upper) -> (-upper, -lower)`` (:func:`transpose_band` on the host).

2. *Which column blocks does a block of rows need, and which of those need no per-element mask?*
   :func:`block_range` returns ``(lo, full_lo, full_hi, hi)``: columns ``[lo, hi)`` hold every
   allowed column (blocks wholly outside are skipped, never loaded: the seeds' tile skipping), and
   ``[full_lo, full_hi)`` are whole blocks where every column is allowed for every row, so the inner
   loop runs there without a mask. ``[lo, full_lo)`` and ``[full_hi, hi)`` are the masked edges
   (the causal diagonal, the window's edges, the ragged tail of the sequence).

Host code normalizes the user's ``(causal, window_size)`` once, in :func:`band_from_window`, into
the two constexpr flags ``HAS_LOWER`` / ``HAS_UPPER`` and the two runtime offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class Band:
    """A normalized mask: columns ``c`` allowed for row ``r`` iff ``r + lower <= c <= r + upper``.

    ``has_lower`` / ``has_upper`` say whether the bound exists at all; when it does not, the
    offset is unused (0). These are the only mask facts a kernel is specialized on.
    """

    has_lower: bool
    has_upper: bool
    lower: int
    upper: int

    @property
    def is_full(self) -> bool:
        return not (self.has_lower or self.has_upper)


def band_from_window(
    causal: bool, window_size: tuple[int, int], seqlen_q: int, seqlen_k: int
) -> Band:
    """Turn flash-attn's ``(causal, window_size)`` into a :class:`Band` (bottom-right aligned).

    ``causal=True`` is the window ``(left, 0)``. ``seqlen_q``/``seqlen_k`` are the (maximum)
    sequence lengths; for varlen the kernels recompute the offset per sequence, so only the
    ``left``/``right`` part is baked in here (see :func:`band_offsets`).
    """
    left, right = window_size
    if causal:
        right = 0
    off = seqlen_k - seqlen_q
    has_lower = left >= 0
    has_upper = right >= 0
    return Band(
        has_lower, has_upper, off - left if has_lower else 0, off + right if has_upper else 0
    )


def window_params(causal: bool, window_size: tuple[int, int]) -> tuple[bool, bool, int, int]:
    """``(HAS_LEFT, HAS_RIGHT, left, right)``: the sequence-independent part of the band.

    Kernels add ``seqlen_k - seqlen_q`` of the sequence they work on (varlen sequences differ)
    through :func:`band_offsets`.
    """
    left, right = window_size
    if causal:
        right = 0
    return left >= 0, right >= 0, max(left, 0), max(right, 0)


def transpose_band(band: Band) -> Band:
    """The same mask seen from the columns: rows become columns (used by the backward pass)."""
    return Band(band.has_upper, band.has_lower, -band.upper, -band.lower)


@triton.jit
def band_offsets(seqlen_q, seqlen_k, left, right):
    """``(lower, upper)`` of the forward band for one sequence: ``off - left``, ``off + right``."""
    off = seqlen_k - seqlen_q
    return off - left, off + right


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


def block_range_py(
    row_start: int, n_rows: int, n_cols: int, band: Band, block_rows: int, block_cols: int
) -> tuple[int, int, int, int]:
    """Pure-Python twin of :func:`block_range` (for tests, schedulers and host heuristics)."""
    row_last = min(row_start + block_rows, n_rows) - 1
    lo = max(row_start + band.lower, 0) if band.has_lower else 0
    hi = min(row_last + band.upper + 1, n_cols) if band.has_upper else n_cols
    lo = (lo // block_cols) * block_cols
    hi = max(hi, lo)
    full_lo = max(row_start + block_rows - 1 + band.lower, 0) if band.has_lower else lo
    full_hi = min(row_start + band.upper + 1, n_cols) if band.has_upper else n_cols
    full_lo = min(max(-(-full_lo // block_cols) * block_cols, lo), hi)
    full_hi = min(max((full_hi // block_cols) * block_cols, full_lo), hi)
    return lo, full_lo, full_hi, hi
