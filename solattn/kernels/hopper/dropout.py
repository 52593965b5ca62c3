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
  column pair) draws the four lanes share. In two parts, so that a kernel can draw where few
  registers are live and deal where the mask is used: :func:`draw_t` packs a lane's draws into
  one word, :func:`keep_t` shuffles the words of the four lanes (three ``shfl.bfly``) and keeps
  each lane's bits.

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
def _lane_xor_4(x):
    """``x`` of lane ``lane ^ 4`` (int32; every lane of the warp executes it)."""
    return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, -1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _lane_xor_8(x):
    """``x`` of lane ``lane ^ 8``."""
    return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 8, 0x1f, -1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _lane_xor_12(x):
    """``x`` of lane ``lane ^ 12``."""
    return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 12, 0x1f, -1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _draw_layout_t(BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """A zero tile in the draw layout of :func:`keep_mask_t` (its layout is what is used)."""
    # [16 w, 8 h, 4 k2, 2 k1, k0 | 2 q, e] -> [16 w, 2 k1, k2 | 2 q, k0 | h, e]: the draw
    # tile's group is (w, s1, k2) and its query (q, s0), where s = 2 s1 + s0 = (lane // 4) % 4
    # is the lane's key offset in its group; h and e are register axes split off.
    d = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, layout)
    d = d.reshape([BLOCK_N // 16, 2, 2, 2, 2, BLOCK_M // 2, 2]).permute((0, 3, 2, 5, 4, 1, 6))
    d, _ = d.reshape([BLOCK_N // 4, BLOCK_M, 2, 2]).split()
    d, _ = d.split()
    return d


@gluon.constexpr_function
def col_warps(layout):
    """How many warps ``layout`` (an accumulator's ``NVMMADistributedLayout``) puts along the
    columns: 1, or 2 where two warpgroups split a tile's columns (the backward's 64-key tiles,
    :func:`solattn.kernels.hopper.backward.acc_layout`). The warp is then the top bit of the
    column index, above the register bits."""
    return layout.warps_per_cta[1]


@gluon.jit
def draw_t(drop, key_start, q_start, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
           layout: gl.constexpr):
    """The draws of :func:`keep_mask_t`'s tile, before they are dealt to the lanes: one draw
    per lane and register pair ``j`` of the draw tile (``[BLOCK_N // 4, BLOCK_M]``), its 4
    keep bits at bit ``4 j`` of one int32 word per lane (a ``[BLOCK_N // 4, W, 8]`` tile, ``W``
    the warps along the columns, :func:`col_warps`: each warp packs its own columns' draws). A
    kernel draws a step's mask where few registers are live, carries the one word, and deals
    it (:func:`keep_t`) where it is used."""
    W: gl.constexpr = col_warps(layout)
    J: gl.constexpr = BLOCK_M // 8 // W
    gl.static_assert(4 * J <= 32, "one 32-bit word per lane holds its draws")
    d_layout: gl.constexpr = _draw_layout_t(BLOCK_N, BLOCK_M, layout).type.layout
    g = gl.arange(0, BLOCK_N // 4, layout=gl.SliceLayout(1, d_layout))
    q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, d_layout))
    bits = _keep_bits(drop, ((key_start >> 2) + g)[:, None], (q_start + q)[None, :])
    # (the warp's columns, register pair j, the lane's column bits)
    b4 = bits.reshape([BLOCK_N // 4, W, J, 8])
    jj = gl.arange(0, J, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(
        3, b4.type.layout))))
    return gl.sum(b4 << (4 * jj)[None, None, :, None], axis=2)  # disjoint bits: an or


@gluon.jit
def _unpack(word, jj, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, d_layout: gl.constexpr):
    """Bit ``4 j`` of ``word`` ([groups, W, 8] int32) for each register pair ``j`` -> the draw
    tile's bool ``[BLOCK_N // 4, BLOCK_M]`` (a constant mask per register: a shift by a
    per-lane amount per register was hoisted out of the step loop and spilled)."""
    k = (word[:, :, None, :] & (1 << (4 * jj))[None, None, :, None]) != 0
    return gl.convert_layout(k.reshape([BLOCK_N // 4, BLOCK_M]), d_layout, assert_trivial=True)


@gluon.jit
def keep_t(word, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """:func:`draw_t`'s draws (``word``) dealt to the lanes: the keep mask (bool, ``layout``).

    Three ``shfl.bfly`` (lane masks 4, 8, 12) bring each lane the words of the other lanes
    of its key group, and each keeps its key's bit of every draw: one shuffle per word, not
    one per draw (32 results held at once spilled the d=128 backward), with immediate lane
    masks (``shfl.idx``'s four per-lane source lanes were hoisted out of the step loop and
    spilled)."""
    W: gl.constexpr = col_warps(layout)
    J: gl.constexpr = BLOCK_M // 8 // W
    d_layout: gl.constexpr = _draw_layout_t(BLOCK_N, BLOCK_M, layout).type.layout
    b4_layout: gl.constexpr = gl.zeros([BLOCK_N // 4, BLOCK_M], gl.int32, d_layout).reshape(
        [BLOCK_N // 4, W, J, 8]).type.layout
    jj = gl.arange(0, J, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(
        3, b4_layout))))
    w_layout: gl.constexpr = word.type.layout
    g = gl.arange(0, BLOCK_N // 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_layout)))
    q = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
    # This lane's key offset s = 2 s1 + s0 (bit s of a draw is its key's); the lane with
    # offset s' = s ^ x (lane ^ 4 x) drew (h, e) = (s' // 2, s' % 2).
    s1 = ((g >> 1) & 1)[:, None, None] + q[None, None, :] * 0
    s0 = (q & 1)[None, None, :] + g[:, None, None] * 0
    s = 2 * s1 + s0
    w1 = _lane_xor_4(word) >> s
    w2 = _lane_xor_8(word) >> s
    w3 = _lane_xor_12(word) >> s
    w0 = word >> s
    # (h, e) was drawn at x = 2 (s1 ^ h) + (s0 ^ e): the words of e = 0 / 1 (even / odd)
    # from the lanes with x1 = 0 (near) or 1 (far), then h picks near or far
    even = gl.where(s0 == 1, w1, w0)
    odd = gl.where(s0 == 1, w0, w1)
    odd_far = gl.where(s0 == 1, w2, w3)
    even_far = gl.where(s0 == 1, w3, w2)
    k00 = _unpack(gl.where(s1 == 1, even_far, even), jj, BLOCK_N, BLOCK_M, d_layout)
    k01 = _unpack(gl.where(s1 == 1, odd_far, odd), jj, BLOCK_N, BLOCK_M, d_layout)
    k10 = _unpack(gl.where(s1 == 1, even, even_far), jj, BLOCK_N, BLOCK_M, d_layout)
    k11 = _unpack(gl.where(s1 == 1, odd, odd_far), jj, BLOCK_N, BLOCK_M, d_layout)
    # joined over h, then e: [..., h, e] as split off in _draw_layout_t
    k = gl.join(gl.join(k00, k10), gl.join(k01, k11))
    k = k.reshape([BLOCK_N // 16, 2, 2, BLOCK_M // 2, 2, 2, 2]).permute((0, 5, 2, 1, 4, 3, 6))
    return gl.convert_layout(k.reshape([BLOCK_N, BLOCK_M]), layout, assert_trivial=True)


@gluon.jit
def keep_mask_t(drop, key_start, q_start, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                layout: gl.constexpr):
    """The transposed keep mask (bool, ``layout``) of keys ``key_start + [0, BLOCK_N)`` (rows;
    ``key_start`` a multiple of 4) and queries ``q_start + [0, BLOCK_M)`` (columns): what the
    backward's ``S^T`` tile needs (:func:`draw_t`, then :func:`keep_t`). ``drop`` as
    :func:`keep_mask`'s."""
    return keep_t(draw_t(drop, key_start, q_start, BLOCK_N, BLOCK_M, layout), BLOCK_N, BLOCK_M,
                  layout)
