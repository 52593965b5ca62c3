"""Attention dropout's keep mask on a wgmma accumulator tile, for the Hopper (Gluon) kernels.

The mask is the portable kernels' (:func:`solattn.kernels.common.dropout_keep`, the scheme in
:mod:`solattn.dropout`): element ``(i, j)`` (query ``i``, key ``j`` of their sequence) is kept
when output ``j % 4`` of the Philox4x32-7 draw at counter ``(j // 4, i, h, b)`` passes the
threshold. The draw is the same function (:func:`~solattn.kernels.common._philox`), so every
kernel, portable or Hopper, forward or backward, regenerates the same mask.

What differs is how a draw reaches the four elements it serves. In the accumulator layout
(``NVMMADistributedLayout`` version 3, 4 warps of 16 rows) a thread holds rows ``16 w + lane // 4
+ 8 h`` and columns ``8 c + 2 (lane % 4) + e`` (``h, e`` in {0, 1}, ``c`` per register pair).

* Forward (rows = queries, columns = keys, :func:`keep_mask`): a thread's two keys ``4 g + 2 b +
  e`` (``b = lane % 2``) are half of a group of four, the other half in lane ``lane ^ 1`` on
  the same rows. Each lane of the pair draws one group for one of the two rows (row ``r + 8 b``)
  and one ``shfl.bfly 1`` hands the partner the two keep bits it needs: one draw per four
  elements (drawing per element pair costs twice the multiplies: ``solattn aot`` SASS, 2026-11-28).
* Backward (rows = keys, columns = queries, :func:`keep_mask_t`): a group's four keys are rows
  ``4 g' + o`` held by lanes ``lane + 4 o``; each of the four draws one of the (row pair,
  column pair) draws the four lanes share and three shuffles give each lane its keep bits.

The draw tile is the accumulator tile relabelled (``reshape`` / ``permute`` / ``split`` of the
register and lane bits, no data movement): its layout is derived from the accumulator's, so
its index vectors are the lane's and register's own, and the result is joined back and
converted with ``assert_trivial``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from solattn.kernels.common import _kept, _philox


@gluon.jit
def _lane_xor_1(x):
    """``x`` of lane ``lane ^ 1`` (int32; every lane of the warp executes it)."""
    return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 1, 0x1f, -1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _keep_bits(drop, groups, rows):
    """The four keep bits (bit ``o``: key ``4 g + o``) of the draws at key groups ``groups``
    and query rows ``rows`` (broadcast against each other), as int32."""
    r0, r1, r2, r3 = _philox(drop, groups, rows)
    th = drop[3]
    return (_kept(r0, th).to(gl.int32) | (_kept(r1, th).to(gl.int32) << 1)
            | (_kept(r2, th).to(gl.int32) << 2) | (_kept(r3, th).to(gl.int32) << 3))


@gluon.jit
def keep_mask(drop, row_start, start_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              layout: gl.constexpr):
    """The keep mask (bool, ``layout``) of queries ``row_start + [0, BLOCK_M)`` (rows) and keys
    ``start_n + [0, BLOCK_N)`` (columns; ``start_n`` a multiple of 4). ``drop`` is the kernel's
    ``(seed, b, h, threshold, scale)`` tuple (:func:`solattn.kernels.common.dropout_params`)."""
    # [16 w, 8 h, lane // 4 | 4 g, 2 b, e] -> [16 w, 8 b, lane // 4 | 4 g, h, e]: in the draw
    # tile the row bit 3 is the lane's b and h, e are register axes split off.
    d = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, layout)
    d = d.reshape([BLOCK_M // 16, 2, 8, BLOCK_N // 4, 2, 2]).permute((0, 4, 2, 3, 1, 5))
    d, _ = d.reshape([BLOCK_M, BLOCK_N // 4, 2, 2]).split()
    d, _ = d.split()
    d_layout: gl.constexpr = d.type.layout
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, d_layout))  # the row this lane draws
    g = gl.arange(0, BLOCK_N // 4, layout=gl.SliceLayout(0, d_layout))
    bits = _keep_bits(drop, ((start_n >> 2) + g)[None, :], (row_start + r)[:, None])
    b = ((r >> 3) & 1)[:, None]
    other = _lane_xor_1(bits)
    # element (h, e): bit 2 b + e of the draw of row r + 8 h, drawn by the lane whose b is h
    top = gl.where(b == 0, bits, other) >> (2 * b)
    low = gl.where(b == 1, bits, other) >> (2 * b)
    # joined over h, then e: [..., h, e] as split off above
    k = gl.join(gl.join((top & 1) != 0, (low & 1) != 0), gl.join((top & 2) != 0, (low & 2) != 0))
    k = k.reshape([BLOCK_M // 16, 2, 8, BLOCK_N // 4, 2, 2]).permute((0, 4, 2, 3, 1, 5))
    return gl.convert_layout(k.reshape([BLOCK_M, BLOCK_N]), layout, assert_trivial=True)


@gluon.jit
def _lane_value(x, src):
    """``x`` of lane ``src`` (int32; every lane of the warp executes it)."""
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r",
                                     [x, src], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def keep_mask_t(drop, key_start, q_start, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                layout: gl.constexpr):
    """The transposed keep mask (bool, ``layout``) of keys ``key_start + [0, BLOCK_N)`` (rows;
    ``key_start`` a multiple of 4) and queries ``q_start + [0, BLOCK_M)`` (columns): what the
    backward's ``S^T`` tile needs. ``drop`` as :func:`keep_mask`'s."""
    # [16 w, 8 h, 4 k2, 2 k1, k0 | 2 q, e] -> [16 w, 2 k1, k2 | 2 q, k0 | h, e]: the draw
    # tile's group is (w, s1, k2) and its query (q, s0), where s = 2 s1 + s0 = (lane // 4) % 4
    # is the lane's key offset in its group; h and e are register axes split off.
    d = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, layout)
    d = d.reshape([BLOCK_N // 16, 2, 2, 2, 2, BLOCK_M // 2, 2]).permute((0, 3, 2, 5, 4, 1, 6))
    d, _ = d.reshape([BLOCK_N // 4, BLOCK_M, 2, 2]).split()
    d, _ = d.split()
    d_layout: gl.constexpr = d.type.layout
    g = gl.arange(0, BLOCK_N // 4, layout=gl.SliceLayout(1, d_layout))
    q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, d_layout))
    bits = _keep_bits(drop, ((key_start >> 2) + g)[:, None], (q_start + q)[None, :])
    # This lane's key offset s (bit s of a draw is its key's) and the lanes of its group: the
    # lane (lane & 0b10011) | (s' << 2) drew (h, e) = (s' // 2, s' % 2).
    s = ((((g >> 1) & 1) << 1)[:, None] | (q & 1)[None, :])
    base = ((g & 1) << 4)[:, None] | ((q >> 1) & 3)[None, :]
    k00 = (_lane_value(bits, base) >> s) & 1
    k01 = (_lane_value(bits, base | 4) >> s) & 1
    k10 = (_lane_value(bits, base | 8) >> s) & 1
    k11 = (_lane_value(bits, base | 12) >> s) & 1
    # joined over h, then e: [..., h, e] as split off above
    k = gl.join(gl.join(k00 != 0, k10 != 0), gl.join(k01 != 0, k11 != 0))
    k = k.reshape([BLOCK_N // 16, 2, 2, BLOCK_M // 2, 2, 2, 2]).permute((0, 5, 2, 1, 4, 3, 6))
    return gl.convert_layout(k.reshape([BLOCK_N, BLOCK_M]), layout, assert_trivial=True)
