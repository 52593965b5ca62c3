"""ALiBi's distance bias in a wgmma accumulator layout, the one the Hopper (Gluon) forward and
backward subtract from their scores.

The bias of a ``[rows, BLOCK]`` tile is ``slope * |t_r - c|`` for ``c`` the tile's column index
in ``[0, BLOCK)`` and ``t_r`` a row's offset (the forward: the row's diagonal key minus the
block's first key; the backward's transposed tile: the key minus the block's first query and
the diagonal). Written as ``t[:, None] - arange(BLOCK)[None, :]`` the column index is a
``[BLOCK]`` vector, one register per column a thread holds (32 at 128 columns), which the
compiler keeps live across the key loop: with triton 3.9's ptxas the d=128 forward builds then
spilled 168-288 bytes with 44-51 local accesses in their loops (`solattn aot --arch 90`,
2026-11-23). In the accumulator layout (``NVMMADistributedLayout`` version 3) a thread's column
``c`` is ``8 j + 2 (lane % 4) + e``: bits 1-2 come from the lane, the others from the register.
So the index is split into ``c & 6`` (one value per thread, the same in every register) and
``c & ~6`` (a compile-time constant per register), and the bias is computed as
``|(t_r - (c & 6)) - (c & ~6)|``: one per-row value a thread keeps and an immediate per
element, the same numbers (every term is an integer below 2**24, exact in float32) with no
column vector live. (The split is an identity whatever the layout; only the register saving
depends on it.)
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def split_cols(BLOCK: gl.constexpr, layout: gl.constexpr):
    """The column indices ``c`` in ``[0, BLOCK)`` of a ``layout`` tile (``SliceLayout(0,
    layout)``) as ``(c & 6, c & ~6)``: the lane's part and the register's (a constant), whose
    sum is ``c``."""
    c = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
    return c & 6, c & -7


@gluon.jit
def alibi_bias(slope, t, BLOCK: gl.constexpr, layout: gl.constexpr):
    """``slope * |t[:, None] - c[None, :]|`` (float32, ``layout``) for the columns ``c`` in
    ``[0, BLOCK)`` of a tile whose rows have the float32 offsets ``t`` (in
    ``SliceLayout(1, layout)``)."""
    lane_part, reg_part = split_cols(BLOCK, layout)
    return slope * gl.abs((t[:, None] - lane_part.to(gl.float32)[None, :])
                          - reg_part.to(gl.float32)[None, :])
