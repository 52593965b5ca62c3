"""Column indices of a wgmma accumulator tile without a per-column vector, and ALiBi's distance
bias built on them: what the Hopper (Gluon) forward, backward and flex backward use where a score
depends on its column's index (ALiBi, the backward's band mask, the flex mods' query index).

Written as ``start + arange(BLOCK)`` the column index is a ``[BLOCK]`` vector, one register per
column a thread holds (32 at 128 columns), which the compiler keeps live across the step loop:
with triton 3.9's ptxas the d=128 ALiBi forward builds then spilled 168-288 bytes with 44-51
local accesses in their loops (`solattn aot --arch 90`, 2026-11-23), the causal ALiBi backward
32-72 B, the flex backward's mods 8-24 accesses in the loop. In the accumulator layout
(``NVMMADistributedLayout`` version 3) a thread's column ``c`` is ``8 j + 2 (lane % 4) + e``:
bits 1-2 come from the lane, the others from the register. :func:`split_cols` splits the index
into ``c & 6`` (one value per thread, the same in every register) and ``c & ~6`` (a
compile-time constant per register); an expression that adds the first to per-row or scalar
terms before the second, e.g. ``|(t_r - (c & 6)) - (c & ~6)|`` for ALiBi
(:func:`alibi_bias`), costs an immediate per element and keeps no column vector live. The
numbers are the same (integers; in float32 exact below 2**24). The split is an identity
whatever the layout; only the register saving depends on it.
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
