"""The ring's schedule: which (query rows, key rows, mask) pieces each rank computes at each step.

Pure host arithmetic on integers, exact by construction. At step ``s`` rank ``r`` holds the K/V of
rank ``(r - s) mod W``. Its local queries and the visiting keys are each one or two segments
(:class:`~solattn.distributed.layout.Segment`) of the global sequence, and the global mask
(causal and/or window; ``j - i`` in ``[lower, upper]`` for query ``i`` and key ``j``, a
:class:`Band`) restricted to one (query segment, key segment) pair is again a band, shifted by
the two segments' offsets. So each pair is one exact kernel call.

Fewer calls are better (one launch per step is the zigzag ring's classic schedule), so the planner
also tries to cover several pairs with *one* band of the local tensors: a merged box is accepted
only if, on every pair it covers, its band selects exactly the same cells as the global mask
(two bands agree on a rectangle iff they agree after clipping to the diagonals that the
rectangle holds). Of the decompositions {one box, one box per query segment, one per key segment,
one per pair}, the valid one with the fewest non-empty boxes wins. For the causal zigzag this
finds the classic schedule::

    step 0 (own K/V)        src < r                  src > r
    q0 | \\ .              q0 | # .                 q0 | . .
    q1 | # \\              q1 | # .                 q1 | # #
         k0 k1                 k0 k1                    k0 k1
    one causal call        all q x first half k     second half q x all k (no mask)

Each box is then trimmed to the rows and columns that see anything (a window far from the
diagonal leaves most of a chunk pair empty) and re-expressed as flash-attn's bottom-right aligned
``(causal, window_size)`` of the trimmed rectangle; bounds that cut nothing are dropped so the
kernels run unmasked where they can.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from solattn.distributed.layout import Segment, local_segments
from solattn.masking import window_params


@dataclass(frozen=True)
class Band:
    """Key column ``c`` allowed for query row ``a`` iff ``lower <= c - a <= upper``; a bound
    whose ``has_*`` flag is False does not exist (its offset is 0)."""

    has_lower: bool
    has_upper: bool
    lower: int
    upper: int


@dataclass(frozen=True)
class Piece:
    """One kernel call: local query rows ``[q_lo, q_hi)`` against the visiting K/V rows
    ``[k_lo, k_hi)`` with flash-attn's ``(causal, window)`` on that sub-problem."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool
    window: tuple[int, int]

    @property
    def q(self) -> slice:
        return slice(self.q_lo, self.q_hi)

    @property
    def k(self) -> slice:
        return slice(self.k_lo, self.k_hi)

    @property
    def masked(self) -> bool:
        return self.causal or self.window != (-1, -1)


@dataclass(frozen=True)
class RingPlan:
    """The pieces of every step for one rank. ``steps[s]`` uses the K/V of rank
    ``(rank - s) mod world``; ``len(steps)`` is the same on every rank (K/V stop travelling once
    no rank needs them: a window shorter than a chunk needs 2 steps, not ``world``)."""

    rank: int
    world: int
    steps: tuple[tuple[Piece, ...], ...]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def source(self, step: int) -> int:
        """The rank whose K/V this rank holds at ``step``."""
        return (self.rank - step) % self.world


def global_band(causal: bool, window_size: tuple[int, int]) -> Band:
    """The mask of the whole (square) problem: key ``j`` allowed for query ``i`` iff
    ``lower <= j - i <= upper`` (bottom-right and top-left alignment coincide)."""
    has_left, has_right, left, right = window_params(causal, tuple(window_size))
    return Band(has_left, has_right, -left if has_left else 0, right if has_right else 0)


def _shift(band: Band, s: int) -> Band:
    return Band(band.has_lower, band.has_upper, band.lower + s if band.has_lower else 0,
                band.upper + s if band.has_upper else 0)


def _clip(band: Band, q_lo: int, q_hi: int, k_lo: int, k_hi: int):
    """The band's diagonals ``(lo, hi)`` present in the rectangle, or None if it selects no cell.

    Two bands select the same cells of a rectangle iff their clips are equal: each diagonal
    ``c - a`` in ``[k_lo - q_hi + 1, k_hi - 1 - q_lo]`` has at least one cell there.
    """
    dmin, dmax = k_lo - (q_hi - 1), (k_hi - 1) - q_lo
    lo = max(band.lower, dmin) if band.has_lower else dmin
    hi = min(band.upper, dmax) if band.has_upper else dmax
    return (lo, hi) if lo <= hi else None


def _pair_shift(qs: Segment, ks: Segment) -> int:
    """``c - a`` (local columns minus local rows) = ``j - i`` (global) + this shift."""
    return (ks.local - ks.start) - (qs.local - qs.start)


def _rect(qs: Segment, ks: Segment) -> tuple[int, int, int, int]:
    return qs.local, qs.local + qs.length, ks.local, ks.local + ks.length


def _box_band(q_segs, k_segs, band: Band):
    """One local band equal to the global mask on every pair of the box, ``"empty"`` if the box
    selects nothing, or None if no single band fits."""
    truth = {}
    for qs, ks in itertools.product(q_segs, k_segs):
        truth[qs, ks] = _clip(_shift(band, _pair_shift(qs, ks)), *_rect(qs, ks))
    candidates = [_pair_shift(qs, ks) for (qs, ks), t in truth.items() if t is not None]
    if not candidates:
        return "empty"
    for s in dict.fromkeys(candidates):
        cand = _shift(band, s)
        if all(_clip(cand, *_rect(qs, ks)) == t for (qs, ks), t in truth.items()):
            return cand
    return None


def _piece(q_lo: int, q_hi: int, k_lo: int, k_hi: int, band: Band) -> Piece:
    """Trim the box to the rows/columns that see anything; express the band bottom-right aligned.

    Row ``a`` sees a column iff ``k_lo - upper <= a < k_hi - lower``; column ``c`` is seen iff
    ``q_lo + lower <= c < q_hi + upper``. After the trim the first column and the last row touch
    the band, so ``lower <= seqlen_k - seqlen_q <= upper`` (both window sides are >= 0).
    """
    rows, cols = [q_lo, q_hi], [k_lo, k_hi]
    if band.has_upper:
        rows[0], cols[1] = max(q_lo, k_lo - band.upper), min(k_hi, q_hi + band.upper)
    if band.has_lower:
        rows[1], cols[0] = min(q_hi, k_hi - band.lower), max(k_lo, q_lo + band.lower)
    (q_lo, q_hi), (k_lo, k_hi) = rows, cols
    n_q, n_k = q_hi - q_lo, k_hi - k_lo
    off = n_k - n_q  # flash-attn's bottom-right alignment of the trimmed sub-problem
    shift = q_lo - k_lo  # local diagonal c - a -> sub-problem diagonal c' - a'
    left = right = -1
    if band.has_lower and band.lower + shift > -(n_q - 1):
        left = off - (band.lower + shift)
    if band.has_upper and band.upper + shift < n_k - 1:
        right = band.upper + shift - off
    if left < -1 or right < -1:  # an internal invariant, not user input
        raise RuntimeError(f"ring plan: trimmed band has window ({left}, {right}) < 0")
    causal = right == 0
    return Piece(q_lo, q_hi, k_lo, k_hi, causal, (left, -1 if causal else right))


def plan_step(q_segs: tuple[Segment, ...], k_segs: tuple[Segment, ...],
              band: Band) -> tuple[Piece, ...]:
    """The pieces of local queries ``q_segs`` against visiting keys ``k_segs`` (see module doc)."""
    options = [
        [(q_segs, k_segs)],
        [((qs,), k_segs) for qs in q_segs],
        [(q_segs, (ks,)) for ks in k_segs],
        [((qs,), (ks,)) for qs in q_segs for ks in k_segs],
    ]
    best = None
    for boxes in options:
        bands = [_box_band(qb, kb, band) for qb, kb in boxes]
        if any(b is None for b in bands):
            continue
        pieces = tuple(
            _piece(qb[0].local, qb[-1].local + qb[-1].length, kb[0].local,
                   kb[-1].local + kb[-1].length, b)
            for (qb, kb), b in zip(boxes, bands) if b != "empty")
        if best is None or len(pieces) < len(best):
            best = pieces
    return best


@functools.lru_cache(maxsize=256)
def _all_steps(layout: str, world: int, seqlen_local: int, band: Band):
    """Every rank's pieces at every step ``0 .. world - 1``."""
    segs = [local_segments(layout, r, world, seqlen_local) for r in range(world)]
    return tuple(tuple(plan_step(segs[r], segs[(r - s) % world], band) for s in range(world))
                 for r in range(world))


def make_plan(layout: str, rank: int, world: int, seqlen_local: int, causal: bool,
              window_size: tuple[int, int]) -> RingPlan:
    """The schedule of ``rank`` (see :class:`RingPlan`); identical step count on every rank."""
    per_rank = _all_steps(layout, world, seqlen_local, global_band(causal, window_size))
    last = max((s for steps in per_rank for s, pieces in enumerate(steps) if pieces), default=0)
    return RingPlan(rank, world, per_rank[rank][: last + 1])
