"""Merge partial attention states: the associative update of (output, log-sum-exp) pairs.

Attention of one query over a key set ``K = K_1 u K_2 u ...`` (disjoint) is recovered exactly from
the attention over each part. Part ``s`` gives its normalized output ``O_s`` and its log-sum-exp
``L_s = log sum_{j in K_s} exp(score_j)``; then::

    L = log sum_s exp(L_s)                   (computed as  M + log sum_s exp(L_s - M),  M = max L_s)
    O = sum_s exp(L_s - L) * O_s

A part that saw no key has ``L_s = -inf``: weight 0, and its ``O_s`` is never read (so it may hold
garbage). If every part is empty the row's output is 0 and its LSE ``-inf``. The merge is
associative and commutative, which is what split-KV decoding, ring attention and
cascade/shared-prefix attention rely on.

One program merges ``BLOCK_R`` rows in one pass over the splits with :func:`merge_parts` (the
online softmax over the parts' LSEs, float32, a tile of parts at a time); the fused split-KV
decode merges with the same helper inside its last split's program
(:mod:`solattn.kernels.triton.decode`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from solattn.kernels.keys import primed
from solattn.launch import Launch, PlanCache


@triton.jit
def merge_parts(o_rows, l_rows, row_ok, offs_d, d_ok, stride_o_part, stride_l_part, stride_od,
                num_parts, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr,
                CACHE_MODIFIER: tl.constexpr):
    """Merge parts ``0 .. num_parts - 1`` of ``ROWS`` rows -> ``(out (ROWS, BLOCK_D), lse)``.

    ``o_rows`` / ``l_rows`` (ROWS,) point at part 0's output row and LSE; part ``s`` is
    ``stride_o_part`` / ``stride_l_part`` further. The online softmax over the parts' LSEs
    (``m`` the largest so far, ``total = sum exp(L - m)``, ``acc = sum exp(L - m) * O``), ``PARTS``
    parts a step: one ``[ROWS, PARTS]`` LSE tile and one ``[ROWS, PARTS, BLOCK_D]`` output tile,
    each a single load, so a step costs one L2 round trip whatever ``PARTS`` is (a part at a
    time, even unrolled, ptxas kept about two parts' loads in flight: ~0.13 us a part, measured
    by ``scripts/merge_micro.py``). With parts on the middle axis the compiler gives each thread
    all ``PARTS`` values of its (row, column) elements (warps over rows, lanes over columns):
    the sums over parts stay in registers. A weight-0 part (``L = -inf``) adds nothing: its
    output may be anything, NaN included."""
    parts = tl.arange(0, PARTS)
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_parts, PARTS):
        s = (s0 + parts).to(tl.int64)
        ok = row_ok[:, None] & ((s0 + parts) < num_parts)[None, :]
        l_s = tl.load(l_rows[:, None] + s[None, :] * stride_l_part, mask=ok,
                      other=float("-inf"), cache_modifier=CACHE_MODIFIER)
        o_s = tl.load(o_rows[:, None, None] + s[None, :, None] * stride_o_part
                      + offs_d[None, None, :] * stride_od,
                      mask=ok[:, :, None] & d_ok[None, None, :], other=0.0,
                      cache_modifier=CACHE_MODIFIER).to(tl.float32)
        m_new = tl.maximum(m, tl.max(l_s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        w = tl.exp(l_s - m_use[:, None])  # 0 for a part that saw no key (its output unread)
        acc = acc * alpha[:, None] + tl.sum(
            tl.where((w > 0.0)[:, :, None], w[:, :, None] * o_s, 0.0), 1)
        total = total * alpha + tl.sum(w, 1)
        m = m_new
    return merge_finish(m, total, acc)


@triton.jit
def merge_finish(m, total, acc):
    """The merged ``(out, lse)`` of a merge state: 0 and ``-inf`` for rows every part missed."""
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"),
                   tl.where(empty, 0.0, m) + tl.log(tl.where(empty, 1.0, total)))
    return out, lse


@triton.jit
def combine_kernel(
    OP, LP, O, LSE,
    stride_ops, stride_op0, stride_op1, stride_op2, stride_opd,  # out_partial (splits, A, B, C, d)
    stride_lps, stride_lp0, stride_lp1, stride_lp2,              # lse_partial (splits, A, B, C)
    stride_o0, stride_o1, stride_o2, stride_od,                  # out (A, B, C, d)
    stride_l0, stride_l1, stride_l2,                             # lse (A, B, C), any strides
    n_rows, dim_b, dim_c, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < n_rows
    r64 = r.to(tl.int64)
    i2 = r64 % dim_c
    i1 = (r64 // dim_c) % dim_b
    i0 = r64 // (dim_c * dim_b)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lp_row = LP + i0 * stride_lp0 + i1 * stride_lp1 + i2 * stride_lp2
    op_row = OP + i0 * stride_op0 + i1 * stride_op1 + i2 * stride_op2

    # PARTS splits a step: an fp32 [BLOCK_R, PARTS, BLOCK_D] tile of 64 registers a thread
    PARTS: tl.constexpr = 8192 // (BLOCK_R * BLOCK_D)
    out, lse = merge_parts(op_row, lp_row, row_ok, offs_d, d_ok, stride_ops, stride_lps,
                           stride_opd, num_splits, BLOCK_R, BLOCK_D, PARTS, "")

    o_ptrs = (O + (i0 * stride_o0 + i1 * stride_o1 + i2 * stride_o2)[:, None]
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if STORE_LSE:
        tl.store(LSE + i0 * stride_l0 + i1 * stride_l1 + i2 * stride_l2, lse, mask=row_ok)


def rows_per_program(d: int) -> int:
    # ~2K fp32 accumulator elements per program (16 registers a thread at 4 warps), leaving room
    # for the 64-bit row pointers; larger tiles spilled (`solattn aot`, 2026-11-22).
    return max(1, min(32, 2048 // triton.next_power_of_2(d)))


def combine_launch(partial_shape, out_partial_strides, lse_partial_strides, out_strides,
                   lse_strides=None, arch: int = 90) -> Launch:
    """The combine kernel's launch for partials of shape ``(splits, A, B, C, d)`` and these
    strides (``lse_strides`` None: no merged lse is stored) on an ``sm_{arch}`` GPU. Called with
    the tensors ``(out_partial, lse_partial, out, lse or lse_partial)``."""
    from solattn.configs import combine_num_warps, padded_head_dim

    n_splits, a, b, c, d = partial_shape
    block_r = rows_per_program(d)
    return Launch(
        combine_kernel, (triton.cdiv(a * b * c, block_r),),
        (*out_partial_strides, *lse_partial_strides, *out_strides,
         *(lse_strides if lse_strides is not None else (0, 0, 0)), a * b * c, b, c, n_splits),
        HEAD_DIM=d, BLOCK_R=block_r, BLOCK_D=padded_head_dim(d),
        STORE_LSE=lse_strides is not None, num_warps=combine_num_warps(arch, d))


_PLANS = PlanCache()


@primed
def combine_into(out_partial, lse_partial, out, lse):
    """Merge ``out_partial (splits, A, B, C, d)`` / ``lse_partial (splits, A, B, C)`` into
    ``out (A, B, C, d)`` and ``lse (A, B, C)`` (any strides; ``lse`` may be None)."""
    from solattn.device import device_arch

    n_splits, a, b, c, d = out_partial.shape
    if a * b * c == 0 or d == 0:
        return
    lse_strides = lse.stride() if lse is not None else None
    arch = device_arch(out.device)
    key = (out_partial.shape, out_partial.stride(), lse_partial.stride(), out.stride(),
           lse_strides, out_partial.dtype, lse_partial.dtype, out.dtype, arch)
    launch = _PLANS.get(key) or _PLANS.put(key, combine_launch(
        out_partial.shape, out_partial.stride(), lse_partial.stride(), out.stride(), lse_strides,
        arch))
    launch(out_partial, lse_partial, out, lse if lse is not None else lse_partial)


# Head dims `solattn aot` compiles (fp32 partials into a bf16 output; data only).
AOT_HEAD_DIMS = (64, 128, 256)
