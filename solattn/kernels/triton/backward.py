"""Portable FlashAttention backward in ``triton.language`` (FlashAttention-2's structure).

Three kernels, no ``N x N`` buffer anywhere:

1. ``attn_bwd_preprocess_kernel``: ``Delta = rowsum(dO * O) - dLSE`` per query row (fp32, laid
   out like the LSE). ``dLSE`` is the gradient of the returned log-sum-exp: since
   ``d lse / d s_j = P_j``, it only shifts ``Delta`` (``dS = P * (dP - Delta + dLSE)``).
2. ``attn_bwd_dkdv_kernel``: one program per ``BLOCK_N`` keys of one *KV* head. It holds its K and
   V tiles and the dK/dV accumulators, and walks every query block its mask allows, for every
   query head of its GQA group (so dK/dV are summed over the group in registers: no repeated K/V,
   no atomics, deterministic). Per query block, P is recomputed from Q, K and the forward's LSE::

       S^T  = K Q^T  (scale, softcap, ALiBi: forward.score_transform)   P^T = exp2(S^T - lse2)
       dV  += P^T dO          dP^T = V dO^T          dS^T = P^T * (dP^T - Delta)
       dK  += dS^T Q          (softcap: dS^T *= 1 - tanh^2, the chain rule through the cap)

   With ``ATOMIC_DQ`` it also adds ``dS K`` for its (query block, key block) pair into an fp32
   dQ buffer with float atomics (the summation order varies between runs). Large head dims run
   it twice (``COMPUTE_DK`` / ``COMPUTE_DV``), one accumulator per pass.
3. ``attn_bwd_dq_kernel`` (the deterministic dQ): one program per ``BLOCK_M`` query rows walking
   the keys in the forward's order; it recomputes S and dP (two extra matmuls) and owns its rows
   of dQ, so the result is bitwise reproducible. On the H100 it is also the faster strategy
   (d128: 287 vs 225 TFLOP/s for atomics), so the tables use it by default too.

Dropout (``HAS_DROPOUT``, flash-attn 2's backward): both kernels regenerate the forward's keep
mask ``Z`` (:func:`solattn.kernels.common.dropout_keep`, a function of the element's coordinates)
and, with ``P`` the undropped probabilities and ``r = 1 / (1 - dropout_p)``::

    dV += (P * Z)^T dO * r          dS = P * (Z * dP * r - Delta)

``Delta = rowsum(dO * O)`` with the forward's (dropped) ``O`` is still ``sum_j P_j Z_j r dP_j``,
the term the softmax's Jacobian needs, so the preprocess kernel is unchanged.

Masks: the dK/dV kernel is the transposed problem (rows are keys, columns are queries). It calls
:func:`solattn.masking.block_range` and :func:`solattn.masking.band_mask` with the band
``(lower, upper) -> (-upper, -lower)`` and the flags swapped (:func:`transposed_band`);
ALiBi's ``|q + off - k|`` is symmetric, so ``score_transform`` gets ``-off``. With a band, each
loop is split into masked edge blocks and unmasked interior blocks, like the forward's key loop;
without one, only the ragged last block is masked, with vector ops alone: rows past the end are
clamped to the last row and their LSE set to +inf, so their P is exactly 0.
Registers, not FLOPs, bound this kernel (dK and dV live in registers): see configs.BwdConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from solattn.kernels.common import (
    GROUP_ARG,
    LOG2E,
    SHAPE_ARGS,
    dropout_keep,
    dropout_params,
    flex_mask,
    flex_score,
    launch_fewer_stages,
    load_rows,
    row_block_coords,
    score_transform,
    seq_bounds,
    sparse_blocks,
    sparse_index,
    strides4,
    tanh_f32,
)
from solattn.kernels.keys import primed
from solattn.launch import Launch, PlanCache
from solattn.masking import band_mask, band_offsets, block_range, transposed_band


# dLSE's strides follow the lengths too (any layout; 0 without dLSE).
@triton.jit(do_not_specialize=SHAPE_ARGS + ("stride_glb", "stride_glh"))
def attn_bwd_preprocess_kernel(
    O, DO, DLSE, DELTA,
    stride_ob, stride_os, stride_oh, stride_od,      # o: (b, s_q, h, d_v) or varlen (t_q, h, d_v)
    stride_dob, stride_dos, stride_doh, stride_dod,  # do: like o
    stride_lb, stride_lh,                            # delta: like lse, (b, h, s_q) or (h, t_q)
    stride_glb, stride_glh, stride_gls,              # dlse: any strides, same shape as lse
    seqlen_q,                                        # s_q, or t_q for varlen (one flat "sequence")
    HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM_V)
    rows = offs_m.to(tl.int64)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_os
                + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dos
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        dlse = tl.load(DLSE + b * stride_glb + h * stride_glh + rows * stride_gls, mask=row_ok,
                       other=0.0)
        delta = delta - dlse
    tl.store(DELTA + b * stride_lb + h * stride_lh + rows, delta, mask=row_ok)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, start_m,
                offs_n, offs_m, offs_d, offs_dv,
                stride_qs, stride_qd, stride_dos, stride_dod, stride_dqs, stride_dqd,
                seqlen_q, neg_off, t_lower, t_upper, sm_scale, qk_scale, softcap_prescale,
                alibi_slope_log2,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                MASKED: tl.constexpr, T_HAS_LOWER: tl.constexpr, T_HAS_UPPER: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr,
                flex=None, SCORE_MOD: tl.constexpr = None, SCORE_BWD: tl.constexpr = None,
                MASK_MOD: tl.constexpr = None, HAS_DROPOUT: tl.constexpr = False, dropout=None):
    """Queries ``[start_m, start_m + BLOCK_M)`` against this program's keys (transposed tiles).

    Dropout (the forward's mask, regenerated transposed): ``dV += (P * keep)^T dO`` (scaled by
    ``1 / (1 - p)`` at the store) and ``dS = P * (keep * dP / (1 - p) - Delta)``.

    FlexAttention (``flex`` = ``(b, h, sm_scale, SCORE_ARGS, MASK_ARGS, GRADS, key_ok)``):
    ``offs_n`` are the keys clamped to the sequence; ``SCORE_BWD`` turns ``dS`` into the
    gradient of ``q.k * scale`` and adds the captured tensors' gradients (atomics)."""
    cols = start_m + offs_m  # query indices
    # Masked blocks may run past the sequence: clamp the rows read to its last row instead of a
    # 2-D load mask (fewer live registers); band_mask zeroes those columns' P, hence their dS.
    rows = tl.minimum(cols, seqlen_q - 1) if MASKED else cols
    q_ptrs = q_base + rows[:, None].to(tl.int64) * stride_qs + offs_d[None, :] * stride_qd
    do_ptrs = do_base + rows[:, None].to(tl.int64) * stride_dos + offs_dv[None, :] * stride_dod
    q = load_rows(q_ptrs, offs_d, HEAD_DIM, BLOCK_D)
    do = load_rows(do_ptrs, offs_dv, HEAD_DIM_V, BLOCK_DV)
    lse2 = tl.load(lse_base + rows) * LOG2E
    if MASKED:
        # Columns past the sequence and rows that see no key (lse = -inf): lse = +inf makes
        # their P exactly 0, with a vector op where a bounds test in band_mask would be a whole
        # [BLOCK_N, BLOCK_M] tile of predicates (and no inf - inf on keys past seqlen_k).
        lse2 = tl.where((cols < seqlen_q) & (lse2 > float("-inf")), lse2, float("inf"))
    delta = tl.load(delta_base + rows)
    qk = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M) = S^T before the transform
    if SCORE_MOD is not None:
        s = flex_score(qk, rows[None, :], offs_n[:, None], flex, SCORE_MOD)
    elif HAS_SOFTCAP:
        # score_transform(t, HAS_SOFTCAP=False) == score_transform(qk, HAS_SOFTCAP=True) when
        # t = tanh(qk * prescale); keeping t gives the chain rule's 1 - t^2 for free.
        t = tanh_f32(qk * softcap_prescale)
        s = score_transform(t, offs_n, cols, neg_off, qk_scale, softcap_prescale,
                            alibi_slope_log2, False, HAS_ALIBI)
    else:
        s = score_transform(qk, offs_n, cols, neg_off, qk_scale, softcap_prescale,
                            alibi_slope_log2, False, HAS_ALIBI)
    p = tl.exp2(s - lse2[None, :])
    if MASKED:
        if T_HAS_LOWER or T_HAS_UPPER:
            mask = band_mask(offs_n, cols, seqlen_q, t_lower, t_upper, T_HAS_LOWER, T_HAS_UPPER,
                             False)
            p = tl.where(mask, p, 0.0)
        if MASK_MOD is not None:
            p = tl.where(flex_mask(rows[None, :], offs_n[:, None], flex, MASK_MOD), p, 0.0)
        if SCORE_BWD is not None:  # keys past the sequence must add nothing to captured grads
            p = tl.where(flex[6][:, None], p, 0.0)
    if HAS_DROPOUT:
        keep = dropout_keep(dropout, cols[None, :], offs_n[:, None])
    if COMPUTE_DV:
        if HAS_DROPOUT:
            dv = tl.dot(tl.where(keep, p, 0.0).to(do.dtype), do, dv)
        else:
            dv = tl.dot(p.to(do.dtype), do, dv)
    if COMPUTE_DK:
        dp = tl.dot(v, tl.trans(do))
        if HAS_DROPOUT:
            dp = tl.where(keep, dp * dropout[4], 0.0)
        ds = p * (dp - delta[None, :])
        if SCORE_BWD is not None:
            ds = SCORE_BWD(qk * flex[2], flex[0], flex[1], rows[None, :], offs_n[:, None],
                           flex[3], ds, flex[5], 0, True)
        elif HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        ds = ds.to(q.dtype)
        dk = tl.dot(ds, q, dk)
    if ATOMIC_DQ and COMPUTE_DK:
        dq = tl.dot(tl.trans(ds), k) * sm_scale  # (BLOCK_M, BLOCK_D)
        dq_ptrs = (dq_base + start_m.to(tl.int64) * stride_dqs + offs_m[:, None] * stride_dqs
                   + offs_d[None, :] * stride_dqd)
        if MASKED:
            tl.atomic_add(dq_ptrs, dq, sem="relaxed",
                          mask=(cols[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM))
        elif BLOCK_D != HEAD_DIM:
            tl.atomic_add(dq_ptrs, dq, mask=offs_d[None, :] < HEAD_DIM, sem="relaxed")
        else:
            tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_range(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, lo, hi,
                offs_n, offs_m, offs_d, offs_dv,
                stride_qs, stride_qd, stride_dos, stride_dod, stride_dqs, stride_dqd,
                seqlen_q, neg_off, t_lower, t_upper, sm_scale, qk_scale, softcap_prescale,
                alibi_slope_log2,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                MASKED: tl.constexpr, T_HAS_LOWER: tl.constexpr, T_HAS_UPPER: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr, STAGES: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, dropout):
    # STAGES: Q/dO tiles in flight (software pipelining) for this loop alone.
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=STAGES):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        dk, dv = _dkdv_block(
            dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, start_m,
            offs_n, offs_m, offs_d, offs_dv,
            stride_qs, stride_qd, stride_dos, stride_dod, stride_dqs, stride_dqd,
            seqlen_q, neg_off, t_lower, t_upper, sm_scale, qk_scale, softcap_prescale,
            alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED,
            T_HAS_LOWER, T_HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, ATOMIC_DQ, COMPUTE_DK, COMPUTE_DV,
            HAS_DROPOUT=HAS_DROPOUT, dropout=dropout)
    return dk, dv


@triton.jit(do_not_specialize=SHAPE_ARGS, do_not_specialize_on_alignment=GROUP_ARG)
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV, ALIBI, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, SEED,
    stride_qb, stride_qs, stride_qh, stride_qd,      # q: (b, s_q, h, d) or varlen (t_q, h, d)
    stride_kb, stride_ks, stride_kh, stride_kd,      # k: (b, s_k, h_kv, d)
    stride_vb, stride_vs, stride_vh, stride_vd,      # v: (b, s_k, h_kv, d_v)
    stride_dob, stride_dos, stride_doh, stride_dod,  # do: (b, s_q, h, d_v)
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,  # dq accumulator: (b, s_q, h, d) fp32
    stride_dkb, stride_dks, stride_dkh, stride_dkd,  # dk: like k
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,  # dv: like v
    stride_lb, stride_lh,                            # lse and delta: (b, h, s_q) or (h, t_q)
    stride_ab, stride_ah,                            # alibi slopes: (h,) or (b, h)
    seqlen_q, seqlen_k, group_size,                  # varlen: rows of q, k (seq_bounds)
    sm_scale, qk_scale, softcap_prescale, left, right,
    dropout_threshold, dropout_scale,                # round(p * 2**31), 1 / (1 - p); SEED (1,)
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M_EDGE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr,
    STAGES: tl.constexpr, EDGE_STAGES: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
):
    # STAGES / EDGE_STAGES: software-pipelining depth of the unmasked interior loop / of the
    # masked edge loops (whose mask tiles leave fewer registers for loads in flight).
    # COMPUTE_DK / COMPUTE_DV: both in one pass, or (large head dims, where two fp32 accumulators
    # of block_n x d do not fit in registers) one per launch, recomputing P in each.
    # Grid: (key blocks, h_kv, batch). With a lower band bound (causal is an upper bound on the
    # keys, i.e. a lower bound on the queries seen by a key) early key blocks have the most work:
    # they run in the first wave.
    pid_n = tl.program_id(0)
    h_kv = tl.program_id(1)
    b = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = seq_bounds(
        b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_K)
    start_n = pid_n * BLOCK_N
    if start_n >= seqlen_k:
        return
    lower, upper = band_offsets(seqlen_q, seqlen_k, left, right)
    neg_off = seqlen_q - seqlen_k  # ALiBi's |q + off - k| = |k - off - q|

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # Masked edge blocks step BLOCK_M_EDGE (<= BLOCK_M, dividing it) queries at a time: the mask
    # tiles cost registers, and the kernel's register peak is then the unmasked interior loop's.
    offs_m_edge = tl.arange(0, BLOCK_M_EDGE)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    local_n = tl.arange(0, BLOCK_N)
    row_ok = offs_n < seqlen_k

    b64 = b.to(tl.int64)
    krow = (k_start + start_n).to(tl.int64)
    k, v, dk, dv = _dkdv_init(K, V, b64, krow, h_kv, local_n, offs_d, offs_dv, row_ok,
                              stride_kb, stride_ks, stride_kh, stride_kd,
                              stride_vb, stride_vs, stride_vh, stride_vd,
                              HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV,
                              COMPUTE_DK, COMPUTE_DV)

    # The transposed band: rows are keys, columns are queries.
    t_lower, t_upper = transposed_band(lower, upper)
    lo, full_lo, full_hi, hi = block_range(start_n, seqlen_k, seqlen_q, t_lower, t_upper,
                                           BLOCK_N, BLOCK_M, HAS_UPPER, HAS_LOWER)
    for g in range(0, group_size):
        h = (h_kv * group_size + g).to(tl.int64)
        q_base = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
        do_base = DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dos + h * stride_doh
        dq_base = DQ + b64 * stride_dqb + q_start.to(tl.int64) * stride_dqs + h * stride_dqh
        lse_base = LSE + b64 * stride_lb + h * stride_lh + q_start
        delta_base = DELTA + b64 * stride_lb + h * stride_lh + q_start
        alibi_slope_log2 = 0.0
        if HAS_ALIBI:
            alibi_slope_log2 = tl.load(ALIBI + b * stride_ab + h * stride_ah).to(tl.float32)
            alibi_slope_log2 = alibi_slope_log2 * LOG2E
        dropout = dropout_params(SEED, b, h, dropout_threshold, dropout_scale, HAS_DROPOUT)
        # Masked leading edge (the causal diagonal: the transposed band's lower edge), unmasked
        # interior, masked trailing edge (left window, the ragged end of the queries). Without
        # the lower edge the leading range is empty (block_range: full_lo == lo), so it is not
        # compiled; without any band only the ragged end is masked.
        if HAS_UPPER:
            dk, dv = _dkdv_range(
                dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, lo, full_lo,
                offs_n, offs_m_edge, offs_d, offs_dv, stride_qs, stride_qd, stride_dos,
                stride_dod, stride_dqs, stride_dqd, seqlen_q, neg_off, t_lower, t_upper, sm_scale,
                qk_scale, softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_M_EDGE,
                BLOCK_D, BLOCK_DV, True, HAS_UPPER, HAS_LOWER, HAS_SOFTCAP, HAS_ALIBI, ATOMIC_DQ,
                COMPUTE_DK, COMPUTE_DV, EDGE_STAGES, HAS_DROPOUT, dropout)
        dk, dv = _dkdv_range(
            dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, full_lo, full_hi,
            offs_n, offs_m, offs_d, offs_dv, stride_qs, stride_qd, stride_dos, stride_dod,
            stride_dqs, stride_dqd, seqlen_q, neg_off, t_lower, t_upper, sm_scale, qk_scale,
            softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D,
            BLOCK_DV, False, HAS_UPPER, HAS_LOWER, HAS_SOFTCAP, HAS_ALIBI, ATOMIC_DQ,
            COMPUTE_DK, COMPUTE_DV, STAGES, HAS_DROPOUT, dropout)
        dk, dv = _dkdv_range(
            dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, full_hi, hi,
            offs_n, offs_m_edge, offs_d, offs_dv, stride_qs, stride_qd, stride_dos, stride_dod,
            stride_dqs, stride_dqd, seqlen_q, neg_off, t_lower, t_upper, sm_scale, qk_scale,
            softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_M_EDGE, BLOCK_D,
            BLOCK_DV, True, HAS_UPPER, HAS_LOWER, HAS_SOFTCAP, HAS_ALIBI, ATOMIC_DQ, COMPUTE_DK,
            COMPUTE_DV, EDGE_STAGES, HAS_DROPOUT, dropout)

    _dkdv_store(dk, dv, DK, DV, b64, krow, h_kv, local_n, offs_d, offs_dv, row_ok, sm_scale,
                stride_dkb, stride_dks, stride_dkh, stride_dkd,
                stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                HEAD_DIM, HEAD_DIM_V, COMPUTE_DK, COMPUTE_DV, HAS_DROPOUT, dropout_scale)


@triton.jit
def _dkdv_init(K, V, b64, krow, h_kv, local_n, offs_d, offs_dv, row_ok,
               stride_kb, stride_ks, stride_kh, stride_kd,
               stride_vb, stride_vs, stride_vh, stride_vd,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr):
    """A dK/dV program's K and V tiles (rows from ``krow``) and its zeroed accumulators."""
    k_ptrs = (K + b64 * stride_kb + krow * stride_ks + h_kv.to(tl.int64) * stride_kh
              + local_n[:, None] * stride_ks + offs_d[None, :] * stride_kd)
    v_ptrs = (V + b64 * stride_vb + krow * stride_vs + h_kv.to(tl.int64) * stride_vh
              + local_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd)
    k = tl.load(k_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    v = tl.load(v_ptrs, mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)

    # A pass that skips one gradient carries a 1 x 1 placeholder (no registers) instead.
    if COMPUTE_DK:
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    else:
        dk = tl.zeros([1, 1], dtype=tl.float32)
    if COMPUTE_DV:
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    else:
        dv = tl.zeros([1, 1], dtype=tl.float32)
    return k, v, dk, dv


@triton.jit
def _dkdv_store(dk, dv, DK, DV, b64, krow, h_kv, local_n, offs_d, offs_dv, row_ok, sm_scale,
                stride_dkb, stride_dks, stride_dkh, stride_dkd,
                stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr,
                HAS_DROPOUT: tl.constexpr = False, dropout_scale=1.0):
    """Store a dK/dV program's gradients (dK scaled by the softmax scale here, once; dV by
    dropout's ``1 / (1 - p)``)."""
    if COMPUTE_DK:
        dk = dk * sm_scale
        dk_ptrs = (DK + b64 * stride_dkb + krow * stride_dks + h_kv.to(tl.int64) * stride_dkh
                   + local_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd)
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    if COMPUTE_DV:
        if HAS_DROPOUT:
            dv = dv * dropout_scale
        dv_ptrs = (DV + b64 * stride_dvb + krow * stride_dvs + h_kv.to(tl.int64) * stride_dvh
                   + local_n[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _dq_block(dq, q, do, lse2, delta, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_dv,
              stride_ks, stride_kd, stride_vs, stride_vd,
              seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              MASKED: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              flex=None, SCORE_MOD: tl.constexpr = None, SCORE_BWD: tl.constexpr = None,
              MASK_MOD: tl.constexpr = None, HAS_DROPOUT: tl.constexpr = False, dropout=None):
    """Keys ``[start_n, start_n + BLOCK_N)`` added into this program's dQ rows (FlexAttention:
    ``offs_m`` are the queries clamped to the sequence, see :func:`_dkdv_block`). Dropout:
    ``dS = P * (keep * dP / (1 - p) - Delta)``, the forward's mask regenerated."""
    cols = start_n + offs_n
    # As in _dkdv_block: clamp the keys read in masked blocks (band_mask zeroes their P and dS).
    rows = tl.minimum(cols, seqlen_k - 1) if MASKED else cols
    k_ptrs = k_base + rows[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = v_base + rows[:, None].to(tl.int64) * stride_vs + offs_dv[None, :] * stride_vd
    k = load_rows(k_ptrs, offs_d, HEAD_DIM, BLOCK_D)
    v = load_rows(v_ptrs, offs_dv, HEAD_DIM_V, BLOCK_DV)
    qk = tl.dot(q, tl.trans(k))
    if SCORE_MOD is not None:
        s = flex_score(qk, offs_m[:, None], rows[None, :], flex, SCORE_MOD)
    elif HAS_SOFTCAP:
        t = tanh_f32(qk * softcap_prescale)
        s = score_transform(t, offs_m, cols, off, qk_scale, softcap_prescale, alibi_slope_log2,
                            False, HAS_ALIBI)
    else:
        s = score_transform(qk, offs_m, cols, off, qk_scale, softcap_prescale, alibi_slope_log2,
                            False, HAS_ALIBI)
    if MASKED:
        s = s + tl.where(cols < seqlen_k, 0.0, float("-inf"))[None, :]  # keys past the end
    p = tl.exp2(s - lse2[:, None])
    if MASKED and (HAS_LOWER or HAS_UPPER):
        mask = band_mask(offs_m, cols, seqlen_k, lower, upper, HAS_LOWER, HAS_UPPER, False)
        p = tl.where(mask, p, 0.0)
    if MASKED and MASK_MOD is not None:
        p = tl.where(flex_mask(offs_m[:, None], rows[None, :], flex, MASK_MOD), p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    if HAS_DROPOUT:
        dp = tl.where(dropout_keep(dropout, offs_m[:, None], cols[None, :]),
                      dp * dropout[4], 0.0)
    ds = p * (dp - delta[:, None])
    if SCORE_BWD is not None:  # captured grads are added by the dK/dV kernel only
        ds = SCORE_BWD(qk * flex[2], flex[0], flex[1], offs_m[:, None], rows[None, :], flex[3],
                       ds, (), 1, False)
    elif HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _dq_range(dq, q, do, lse2, delta, k_base, v_base, lo, hi, offs_m, offs_n, offs_d, offs_dv,
              stride_ks, stride_kd, stride_vs, stride_vd,
              seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              MASKED: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, dropout):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start_n, offs_m, offs_n, offs_d,
                       offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower,
                       upper, qk_scale, softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V,
                       BLOCK_D, BLOCK_DV, MASKED, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI,
                       HAS_DROPOUT=HAS_DROPOUT, dropout=dropout)
    return dq


@triton.jit(do_not_specialize=SHAPE_ARGS, do_not_specialize_on_alignment=GROUP_ARG)
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, ALIBI, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, SEED,
    stride_qb, stride_qs, stride_qh, stride_qd,      # q: (b, s_q, h, d) or varlen (t_q, h, d)
    stride_kb, stride_ks, stride_kh, stride_kd,      # k: (b, s_k, h_kv, d)
    stride_vb, stride_vs, stride_vh, stride_vd,      # v: (b, s_k, h_kv, d_v)
    stride_dob, stride_dos, stride_doh, stride_dod,  # do: (b, s_q, h, d_v)
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,  # dq: like q
    stride_lb, stride_lh,                            # lse and delta: (b, h, s_q) or (h, t_q)
    stride_ab, stride_ah,                            # alibi slopes: (h,) or (b, h)
    seqlen_q, seqlen_k, group_size,                  # varlen: rows of q, k (seq_bounds)
    sm_scale, qk_scale, softcap_prescale, left, right,
    dropout_threshold, dropout_scale,                # round(p * 2**31), 1 / (1 - p); SEED (1,)
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
):
    # Grid: (query blocks, h, batch), longest-first for upper-banded masks as in the forward.
    pid_m, h, b, h_kv = row_block_coords(group_size, HAS_UPPER)
    q_start, seqlen_q, k_start, seqlen_k = seq_bounds(
        b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_K)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    lower, upper = band_offsets(seqlen_q, seqlen_k, left, right)
    off = seqlen_k - seqlen_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    local_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen_q

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    qrow = (q_start + start_m).to(tl.int64)
    q, do, lse2, delta = _dq_init(Q, DO, LSE, DELTA, b64, h64, qrow, q_start, offs_m, local_m,
                                  offs_d, offs_dv, row_ok, stride_qb, stride_qs, stride_qh,
                                  stride_qd, stride_dob, stride_dos, stride_doh, stride_dod,
                                  stride_lb, stride_lh, HEAD_DIM, HEAD_DIM_V)
    hk64 = h_kv.to(tl.int64)
    k_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hk64 * stride_kh
    v_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + hk64 * stride_vh
    alibi_slope_log2 = 0.0
    if HAS_ALIBI:
        alibi_slope_log2 = tl.load(ALIBI + b * stride_ab + h * stride_ah).to(tl.float32)
        alibi_slope_log2 = alibi_slope_log2 * LOG2E
    dropout = dropout_params(SEED, b, h, dropout_threshold, dropout_scale, HAS_DROPOUT)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = block_range(start_m, seqlen_q, seqlen_k, lower, upper,
                                           BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)
    # Masked edges, unmasked interior, masked edges (without a band: the ragged end only; the
    # leading range is empty without a lower edge, so it is not compiled).
    if HAS_LOWER:
        dq = _dq_range(
            dq, q, do, lse2, delta, k_base, v_base, lo, full_lo, offs_m, offs_n, offs_d, offs_dv,
            stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower, upper, qk_scale,
            softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV,
            True, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, dropout)
    dq = _dq_range(
        dq, q, do, lse2, delta, k_base, v_base, full_lo, full_hi, offs_m, offs_n, offs_d,
        offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower, upper,
        qk_scale, softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D,
        BLOCK_DV, False, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, dropout)
    dq = _dq_range(
        dq, q, do, lse2, delta, k_base, v_base, full_hi, hi, offs_m, offs_n, offs_d, offs_dv,
        stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower, upper, qk_scale,
        softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV,
        True, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, dropout)
    dq = dq * sm_scale
    tl.store(DQ + b64 * stride_dqb + qrow * stride_dqs + h64 * stride_dqh
             + local_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _dq_init(Q, DO, LSE, DELTA, b64, h64, qrow, q_start, offs_m, local_m, offs_d, offs_dv, row_ok,
             stride_qb, stride_qs, stride_qh, stride_qd,
             stride_dob, stride_dos, stride_doh, stride_dod, stride_lb, stride_lh,
             HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    """A dQ program's Q and dO rows (from ``qrow``), their LSE (log2 domain) and Delta."""
    q = tl.load(Q + b64 * stride_qb + qrow * stride_qs + h64 * stride_qh
                + local_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    do = tl.load(DO + b64 * stride_dob + qrow * stride_dos + h64 * stride_doh
                 + local_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    lse_off = b64 * stride_lb + h64 * stride_lh + q_start + offs_m
    lse2 = tl.load(LSE + lse_off, mask=row_ok, other=0.0) * LOG2E
    # A row that sees no key (lse = -inf): +inf makes its P exactly 0 in every block.
    lse2 = tl.where(lse2 > float("-inf"), lse2, float("inf"))
    delta = tl.load(DELTA + lse_off, mask=row_ok, other=0.0)
    return q, do, lse2, delta


@triton.jit
def _dkdv_sparse(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, LIST, b, h, row,
                 offs_n, offs_m, offs_d, offs_dv, stride_qs, stride_qd, stride_dos, stride_dod,
                 stride_dqs, stride_dqd, seqlen_q, sm_scale, qk_scale, flex,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPARSE_M: tl.constexpr,
                 MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr, COMPUTE_DK: tl.constexpr,
                 COMPUTE_DV: tl.constexpr, STAGES: tl.constexpr, SCORE_MOD: tl.constexpr,
                 SCORE_BWD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 dropout):
    """The query tiles of the sparse blocks one BlockMask list (q-major) gives key block
    ``row``: partial blocks ``MASKED`` with ``MASK_MOD``, full blocks unmasked."""
    count, idx = sparse_blocks(LIST, b, h, row)
    # The query blocks these indices may name (full ones inside the queries: kernel_lists).
    n_blocks = tl.cdiv(seqlen_q, SPARSE_M) if MASKED else seqlen_q // SPARSE_M
    count = tl.minimum(count, n_blocks)
    for t in tl.range(0, count * (SPARSE_M // BLOCK_M), num_stages=STAGES):
        start_m = (sparse_index(idx, t // (SPARSE_M // BLOCK_M), n_blocks) * SPARSE_M
                   + (t % (SPARSE_M // BLOCK_M)) * BLOCK_M)
        start_m = tl.multiple_of(start_m, BLOCK_M)
        dk, dv = _dkdv_block(
            dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, start_m,
            offs_n, offs_m, offs_d, offs_dv,
            stride_qs, stride_qd, stride_dos, stride_dod, stride_dqs, stride_dqd,
            seqlen_q, 0, 0, 0, sm_scale, qk_scale, 1.0, 0.0, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
            BLOCK_DV, MASKED, False, False, False, False, ATOMIC_DQ, COMPUTE_DK, COMPUTE_DV,
            flex, SCORE_MOD, SCORE_BWD, MASK_MOD, HAS_DROPOUT, dropout)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_flex_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV,
    Q_LIST, FULL_Q_LIST,                             # BlockMask lists, q-major (sparse_blocks)
    SCORE_ARGS, MASK_ARGS, GRADS,                    # captured tensors; fp32 grads of some
    SEED,                                            # dropout's (1,) int64 seed
    stride_qb, stride_qs, stride_qh, stride_qd,      # q: (b, s_q, h, d) view of (B, H, L, E)
    stride_kb, stride_ks, stride_kh, stride_kd,      # k: (b, s_k, h_kv, d)
    stride_vb, stride_vs, stride_vh, stride_vd,      # v: (b, s_k, h_kv, d_v)
    stride_dob, stride_dos, stride_doh, stride_dod,  # do: (b, s_q, h, d_v)
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,  # dq accumulator: (b, s_q, h, d) fp32
    stride_dkb, stride_dks, stride_dkh, stride_dkd,  # dk: like k
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,  # dv: like v
    stride_lb, stride_lh,                            # lse and delta: (b, h, s_q)
    seqlen_q, seqlen_k, group_size, sm_scale, qk_scale,
    dropout_threshold, dropout_scale,                # round(p * 2**31), 1 / (1 - p)
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M_EDGE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
    SCORE_MOD: tl.constexpr, SCORE_BWD: tl.constexpr, MASK_MOD: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr,
    STAGES: tl.constexpr, EDGE_STAGES: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
):
    """FlexAttention dK/dV (solattn.flex): attn_bwd_dkdv_kernel's program (``BLOCK_N`` keys of one
    KV head, every query head of its group) walking the query blocks a BlockMask lists for its
    key block (``BLOCK_N`` divides ``SPARSE_N``): partial blocks ``BLOCK_M_EDGE`` queries at a
    time with ``MASK_MOD``, full blocks ``BLOCK_M`` at a time unmasked."""
    pid_n = tl.program_id(0)
    h_kv = tl.program_id(1)
    b = tl.program_id(2)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_m_edge = tl.arange(0, BLOCK_M_EDGE)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    local_n = tl.arange(0, BLOCK_N)
    row_ok = offs_n < seqlen_k
    b64 = b.to(tl.int64)
    krow = start_n.to(tl.int64)
    k, v, dk, dv = _dkdv_init(K, V, b64, krow, h_kv, local_n, offs_d, offs_dv, row_ok,
                              stride_kb, stride_ks, stride_kh, stride_kd,
                              stride_vb, stride_vs, stride_vh, stride_vd,
                              HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV,
                              COMPUTE_DK, COMPUTE_DV)
    keys = tl.minimum(offs_n, seqlen_k - 1)  # the mods see padded keys as the last key
    row = start_n // SPARSE_N
    for g in range(0, group_size):
        h = h_kv * group_size + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        do_base = DO + b64 * stride_dob + h64 * stride_doh
        dq_base = DQ + b64 * stride_dqb + h64 * stride_dqh
        lse_base = LSE + b64 * stride_lb + h64 * stride_lh
        delta_base = DELTA + b64 * stride_lb + h64 * stride_lh
        flex = (b, h, sm_scale, SCORE_ARGS, MASK_ARGS, GRADS, row_ok)
        dropout = dropout_params(SEED, b, h, dropout_threshold, dropout_scale, HAS_DROPOUT)
        dk, dv = _dkdv_sparse(
            dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, Q_LIST, b, h, row,
            keys, offs_m_edge, offs_d, offs_dv, stride_qs, stride_qd, stride_dos, stride_dod,
            stride_dqs, stride_dqd, seqlen_q, sm_scale, qk_scale, flex, HEAD_DIM, HEAD_DIM_V,
            BLOCK_M_EDGE, BLOCK_D, BLOCK_DV, SPARSE_M, True, ATOMIC_DQ, COMPUTE_DK, COMPUTE_DV,
            EDGE_STAGES, SCORE_MOD, SCORE_BWD, MASK_MOD, HAS_DROPOUT, dropout)
        dk, dv = _dkdv_sparse(
            dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, FULL_Q_LIST, b, h,
            row, keys, offs_m, offs_d, offs_dv, stride_qs, stride_qd, stride_dos, stride_dod,
            stride_dqs, stride_dqd, seqlen_q, sm_scale, qk_scale, flex, HEAD_DIM, HEAD_DIM_V,
            BLOCK_M, BLOCK_D, BLOCK_DV, SPARSE_M, False, ATOMIC_DQ, COMPUTE_DK, COMPUTE_DV,
            STAGES, SCORE_MOD, SCORE_BWD, None, HAS_DROPOUT, dropout)
    _dkdv_store(dk, dv, DK, DV, b64, krow, h_kv, local_n, offs_d, offs_dv, row_ok, sm_scale,
                stride_dkb, stride_dks, stride_dkh, stride_dkd,
                stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                HEAD_DIM, HEAD_DIM_V, COMPUTE_DK, COMPUTE_DV, HAS_DROPOUT, dropout_scale)


@triton.jit
def _dq_sparse(dq, q, do, lse2, delta, k_base, v_base, LIST, b, h, row, rows, offs_n, offs_d,
               offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, qk_scale, flex,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPARSE_N: tl.constexpr,
               MASKED: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_BWD: tl.constexpr,
               MASK_MOD: tl.constexpr, HAS_DROPOUT: tl.constexpr, dropout):
    """The key tiles of the sparse blocks one BlockMask list (kv-major) gives row block
    ``row``, added into dQ (as the forward's _fwd_sparse)."""
    count, idx = sparse_blocks(LIST, b, h, row)
    n_blocks = tl.cdiv(seqlen_k, SPARSE_N) if MASKED else seqlen_k // SPARSE_N
    count = tl.minimum(count, n_blocks)
    for t in range(0, count * (SPARSE_N // BLOCK_N)):
        start_n = (sparse_index(idx, t // (SPARSE_N // BLOCK_N), n_blocks) * SPARSE_N
                   + (t % (SPARSE_N // BLOCK_N)) * BLOCK_N)
        start_n = tl.multiple_of(start_n, BLOCK_N)
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start_n, rows, offs_n, offs_d,
                       offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, 0, 0, 0,
                       qk_scale, 1.0, 0.0, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED,
                       False, False, False, False, flex, SCORE_MOD, SCORE_BWD, MASK_MOD,
                       HAS_DROPOUT, dropout)
    return dq


@triton.jit
def attn_bwd_dq_flex_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    KV_LIST, FULL_KV_LIST,                           # BlockMask lists, kv-major
    SCORE_ARGS, MASK_ARGS,                           # the mods' captured tensors
    SEED,                                            # dropout's (1,) int64 seed
    stride_qb, stride_qs, stride_qh, stride_qd,      # q: (b, s_q, h, d) view of (B, H, L, E)
    stride_kb, stride_ks, stride_kh, stride_kd,      # k: (b, s_k, h_kv, d)
    stride_vb, stride_vs, stride_vh, stride_vd,      # v: (b, s_k, h_kv, d_v)
    stride_dob, stride_dos, stride_doh, stride_dod,  # do: (b, s_q, h, d_v)
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,  # dq: like q
    stride_lb, stride_lh,                            # lse and delta: (b, h, s_q)
    seqlen_q, seqlen_k, group_size, sm_scale, qk_scale,
    dropout_threshold, dropout_scale,                # round(p * 2**31), 1 / (1 - p)
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
    SCORE_MOD: tl.constexpr, SCORE_BWD: tl.constexpr, MASK_MOD: tl.constexpr,
    HAS_DROPOUT: tl.constexpr = False,
):
    """FlexAttention dQ (deterministic: no atomics): attn_bwd_dq_kernel's program walking the
    key blocks a BlockMask lists for its row block, as the flex forward does."""
    pid_m, h, b, h_kv = row_block_coords(group_size, False)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    local_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen_q
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    qrow = start_m.to(tl.int64)
    q, do, lse2, delta = _dq_init(Q, DO, LSE, DELTA, b64, h64, qrow, 0, offs_m, local_m,
                                  offs_d, offs_dv, row_ok, stride_qb, stride_qs, stride_qh,
                                  stride_qd, stride_dob, stride_dos, stride_doh, stride_dod,
                                  stride_lb, stride_lh, HEAD_DIM, HEAD_DIM_V)
    hk64 = h_kv.to(tl.int64)
    k_base = K + b64 * stride_kb + hk64 * stride_kh
    v_base = V + b64 * stride_vb + hk64 * stride_vh
    flex = (b, h, sm_scale, SCORE_ARGS, MASK_ARGS)
    dropout = dropout_params(SEED, b, h, dropout_threshold, dropout_scale, HAS_DROPOUT)
    rows = tl.minimum(offs_m, seqlen_q - 1)
    row = start_m // SPARSE_M
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_sparse(dq, q, do, lse2, delta, k_base, v_base, KV_LIST, b, h, row, rows, offs_n,
                    offs_d, offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k,
                    qk_scale, flex, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, SPARSE_N,
                    True, SCORE_MOD, SCORE_BWD, MASK_MOD, HAS_DROPOUT, dropout)
    dq = _dq_sparse(dq, q, do, lse2, delta, k_base, v_base, FULL_KV_LIST, b, h, row, rows,
                    offs_n, offs_d, offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k,
                    qk_scale, flex, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, SPARSE_N,
                    False, SCORE_MOD, SCORE_BWD, None, HAS_DROPOUT, dropout)
    dq = dq * sm_scale
    tl.store(DQ + b64 * stride_dqb + qrow * stride_dqs + h64 * stride_dqh
             + local_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@primed
def attn_bwd(do, q, k, v, out, lse, p, *, dlse=None, arch=90, config=None):
    """Gradients ``(dq, dk, dv)`` of the forward for :class:`solattn.params.AttnParams` ``p``, on
    validated, non-empty inputs (``solattn.core.attn_backward`` handles empty ones).

    Shapes as :func:`solattn.kernels.triton.forward.attn_fwd`; ``out`` and ``lse`` are the
    forward's outputs, ``do`` the gradient of ``out`` (any strides), ``dlse`` the gradient of
    ``lse`` or None. ``p.deterministic`` computes dQ in its own kernel (no float atomics);
    otherwise the config's ``atomic_dq`` decides. ``config`` overrides the table (benchmarks,
    tests).
    """
    varlen = p.varlen
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.shape,
           out.stride(), do.shape, do.stride(), lse.shape, lse.stride(),
           None if dlse is None else (dlse.shape, dlse.stride(), dlse.dtype),
           q.dtype, k.dtype, v.dtype, out.dtype, do.dtype, lse.dtype, p.launch_key, arch, config)
    # Varlen rows past cu_seqlens[-1] belong to no sequence: their gradients are zero.
    alloc = torch.zeros_like if varlen else torch.empty_like
    dq, dk, dv = alloc(q), alloc(k), alloc(v)
    delta = torch.empty_like(lse)
    plan = _BWD_PLANS.get(key)
    if plan is None:  # the buffers' strides follow the inputs' layouts (empty_like), fixed by key
        plan = _BWD_PLANS.put(key, _bwd_plan(do, q, k, v, out, lse, dlse, dq, dk, dv, p, arch,
                                             config))
    # dQ accumulated by atomics in fp32 (laid out like dq), or written by its own kernel.
    dq_acc = torch.zeros_like(q, dtype=torch.float32) if plan.atomic_dq else dq
    plan.preprocess(out, do, dlse if dlse is not None else delta, delta)
    dummy = q
    alibi = p.alibi_slopes if p.has_alibi else dummy
    cu_q = p.cu_seqlens_q if varlen else dummy
    cu_k = p.cu_seqlens_k if varlen else dummy
    used_k = p.seqused_k if p.seqused_k is not None else dummy
    seed = p.dropout_seed if p.has_dropout else dummy
    for dkdv in plan.dkdv:
        dkdv(q, k, v, do, lse, delta, dq_acc, dk, dv, alibi, cu_q, cu_k, used_k, seed)
    if plan.atomic_dq:
        dq.copy_(dq_acc)
    else:
        plan.dq(q, k, v, do, lse, delta, dq, alibi, cu_q, cu_k, used_k, seed)
    return dq, dk, dv


@dataclass(frozen=True)
class _BwdPlan:
    atomic_dq: bool
    preprocess: Launch
    dkdv: tuple          # one launch, or two (dK, then dV) with split_dkdv
    dq: Launch | None    # None with atomic dQ


_BWD_PLANS = PlanCache()


def _bwd_plan(do, q, k, v, out, lse, dlse, dq, dk, dv, p, arch, config) -> _BwdPlan:
    """Everything :func:`attn_bwd` launches with but the tensors, from the first call's tensors
    (``dq``, ``dk``, ``dv`` and delta, like ``lse``, are the buffers that call allocated)."""
    from solattn.configs import bwd_config, padded_head_dim

    varlen = p.varlen
    d, dv_dim = q.shape[-1], v.shape[-1]
    h, h_kv = q.shape[-2], k.shape[-2]
    if varlen:
        batch = p.cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = p.max_seqlen_q, p.max_seqlen_k
        # The kernels get the packed rows of q and k: every cu_seqlens / seqused_k value is
        # clamped into them (common.seq_bounds).
        extent_q, extent_k = q.shape[0], k.shape[0]
        stride_lb, stride_lh = 0, lse.stride(0)
        n_rows = q.shape[0]  # the preprocess walks the packed rows as one sequence
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        extent_q, extent_k = seqlen_q, seqlen_k
        stride_lb, stride_lh = lse.stride(0), lse.stride(1)
        n_rows = seqlen_q
    cfg = config or bwd_config(arch, d, dv_dim, scores=p.has_softcap or p.has_alibi)
    atomic_dq = cfg.atomic_dq and not p.deterministic
    bd, bdv = padded_head_dim(d), padded_head_dim(dv_dim)

    if dlse is not None:
        glb, glh, gls = (0, *dlse.stride()) if varlen else dlse.stride()
    else:
        glb = glh = gls = 0
    pre_m = 64
    preprocess = Launch(
        attn_bwd_preprocess_kernel, (triton.cdiv(n_rows, pre_m), h, 1 if varlen else batch),
        (*strides4(out), *strides4(do), stride_lb, stride_lh, glb, glh, gls, n_rows),
        HEAD_DIM_V=dv_dim, BLOCK_M=pre_m, BLOCK_DV=bdv, HAS_DLSE=dlse is not None,
        num_warps=4)

    flags = dict(IS_VARLEN=varlen, HAS_SEQUSED_K=p.seqused_k is not None, HAS_LOWER=p.has_left,
                 HAS_UPPER=p.has_right, HAS_SOFTCAP=p.has_softcap, HAS_ALIBI=p.has_alibi,
                 HAS_DROPOUT=p.has_dropout)
    common = (stride_lb, stride_lh, *p.alibi_strides, extent_q, extent_k, p.group_size,
              p.scale, p.qk_scale, p.softcap_prescale, p.left, p.right, p.dropout_threshold,
              p.dropout_scale)
    # dq_acc is laid out like dq (zeros_like of q in fp32, or dq itself).
    passes = [(True, False), (False, True)] if cfg.split_dkdv else [(True, True)]
    dkdv = tuple(Launch(
        attn_bwd_dkdv_kernel, (triton.cdiv(seqlen_k, cfg.block_n), h_kv, batch),
        (*strides4(q), *strides4(k), *strides4(v), *strides4(do), *strides4(dq),
         *strides4(dk), *strides4(dv), *common),
        HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_M_EDGE=cfg.edge_block_m, BLOCK_D=bd, BLOCK_DV=bdv, ATOMIC_DQ=atomic_dq,
        COMPUTE_DK=compute_dk, COMPUTE_DV=compute_dv, STAGES=cfg.num_stages,
        EDGE_STAGES=cfg.edge_num_stages, **flags, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages) for compute_dk, compute_dv in passes)
    dq_launch = None if atomic_dq else Launch(
        attn_bwd_dq_kernel, (triton.cdiv(seqlen_q, cfg.dq_block_m), h, batch),
        (*strides4(q), *strides4(k), *strides4(v), *strides4(do), *strides4(dq), *common),
        HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
        BLOCK_D=bd, BLOCK_DV=bdv, **flags,
        num_warps=cfg.dq_num_warps, num_stages=cfg.dq_num_stages)
    return _BwdPlan(atomic_dq, preprocess, dkdv, dq_launch)


@primed
def attn_bwd_flex(do, q, k, v, out, lse, fp, *, dlse=None, arch=90, config=None):
    """Gradients of :func:`solattn.kernels.triton.forward.attn_fwd_flex` for
    :class:`solattn.flex.ops.FlexParams` ``fp``: ``(dq, dk, dv)`` in flex's ``(B, H, L, E)``
    layout (contiguous) and the fp32 gradients of the score_mod's captured tensors that require
    grad (``fp.grad_buffers()``, filled in place with atomics). ``q/k/v/do/out`` are
    ``(b, s, h, d)`` views; ``lse`` (and ``dlse``) ``(B, H, L)``."""
    from solattn.configs import bwd_config, padded_head_dim

    batch, seqlen_q, h, d = q.shape
    seqlen_k, h_kv, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    dq = q.new_empty(batch, h, seqlen_q, d).transpose(1, 2)
    dk = k.new_empty(batch, h_kv, seqlen_k, d).transpose(1, 2)
    dv = v.new_empty(batch, h_kv, seqlen_k, dv_dim).transpose(1, 2)
    cfg = config or bwd_config(arch, d, dv_dim, scores=fp.score is not None)
    sparse_m, sparse_n = fp.block_size
    bd, bdv = padded_head_dim(d), padded_head_dim(dv_dim)

    delta = torch.empty_like(lse)
    glb, glh, gls = dlse.stride() if dlse is not None else (0, 0, 0)
    pre_m = 64
    attn_bwd_preprocess_kernel[(triton.cdiv(seqlen_q, pre_m), h, batch)](
        out, do, dlse if dlse is not None else delta, delta,
        *strides4(out), *strides4(do), lse.stride(0), lse.stride(1), glb, glh, gls, seqlen_q,
        HEAD_DIM_V=dv_dim, BLOCK_M=pre_m, BLOCK_DV=bdv, HAS_DLSE=dlse is not None,
        num_warps=4)

    grads = fp.grad_buffers()
    atomic_dq = cfg.atomic_dq
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic_dq else dq
    mods = dict(SCORE_MOD=fp.score_fwd, SCORE_BWD=fp.score_bwd, MASK_MOD=fp.mask_fwd,
                HAS_DROPOUT=fp.has_dropout)
    seed = fp.dropout_seed if fp.has_dropout else q
    block_n = min(cfg.block_n, sparse_n)
    passes = [(True, False), (False, True)] if cfg.split_dkdv else [(True, True)]
    for compute_dk, compute_dv in passes:
        launch_fewer_stages(lambda stages: attn_bwd_dkdv_flex_kernel[
            (triton.cdiv(seqlen_k, block_n), h_kv, batch)](
            q, k, v, do, lse, delta, dq_acc, dk, dv, fp.q_list(), fp.full_q_list(),
            fp.score_args(), fp.mask_args(), fp.grad_args(grads), seed,
            *strides4(q), *strides4(k), *strides4(v), *strides4(do), *strides4(dq_acc),
            *strides4(dk), *strides4(dv), lse.stride(0), lse.stride(1),
            seqlen_q, seqlen_k, h // h_kv, fp.scale, fp.qk_scale, fp.dropout_threshold,
            fp.dropout_scale,
            HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_M=min(cfg.block_m, sparse_m), BLOCK_N=block_n,
            BLOCK_M_EDGE=min(cfg.edge_block_m, sparse_m), BLOCK_D=bd, BLOCK_DV=bdv,
            SPARSE_M=sparse_m, SPARSE_N=sparse_n, ATOMIC_DQ=atomic_dq, COMPUTE_DK=compute_dk,
            COMPUTE_DV=compute_dv, STAGES=stages, EDGE_STAGES=min(cfg.edge_num_stages, stages),
            **mods, num_warps=cfg.num_warps, num_stages=stages), cfg.num_stages)
    if atomic_dq:
        dq.copy_(dq_acc)
    else:
        dq_block_m = min(cfg.dq_block_m, sparse_m)
        launch_fewer_stages(lambda stages: attn_bwd_dq_flex_kernel[
            (triton.cdiv(seqlen_q, dq_block_m), h, batch)](
            q, k, v, do, lse, delta, dq, fp.kv_list(), fp.full_kv_list(), fp.score_args(),
            fp.mask_args(), seed, *strides4(q), *strides4(k), *strides4(v), *strides4(do),
            *strides4(dq), lse.stride(0), lse.stride(1), seqlen_q, seqlen_k, h // h_kv,
            fp.scale, fp.qk_scale, fp.dropout_threshold, fp.dropout_scale, HEAD_DIM=d,
            HEAD_DIM_V=dv_dim, BLOCK_M=dq_block_m,
            BLOCK_N=min(cfg.dq_block_n, sparse_n), BLOCK_D=bd, BLOCK_DV=bdv,
            SPARSE_M=sparse_m, SPARSE_N=sparse_n, **mods,
            num_warps=cfg.dq_num_warps, num_stages=stages), cfg.dq_num_stages)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), grads


# Flag sets `solattn aot` compiles (data only: aot_calls.py replays them). Per table config with
# the plain scores: no mask, causal, every mask at once (varlen, two-sided band, ragged head
# dim; only this one for d <= 32, far below the register limit) and causal with dropout; with
# the scores config (softcap or ALiBi), every feature. The dQ kernel compiles with the superset
# variants and the dropout one only.
AOT_MASK_NONE = dict(IS_VARLEN=False, HAS_SEQUSED_K=False, HAS_LOWER=False, HAS_UPPER=False,
                     HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False)
AOT_VARIANTS = {
    "plain": AOT_MASK_NONE,
    "causal": dict(AOT_MASK_NONE, HAS_UPPER=True),
    "masks": dict(AOT_MASK_NONE, IS_VARLEN=True, HAS_LOWER=True, HAS_UPPER=True),
    "all-features": dict(AOT_MASK_NONE, IS_VARLEN=True, HAS_SEQUSED_K=True, HAS_LOWER=True,
                         HAS_UPPER=True, HAS_SOFTCAP=True, HAS_ALIBI=True),
    # Training with attention dropout (plain-scores configs, dK/dV and dQ kernels).
    "causal-dropout": dict(AOT_MASK_NONE, HAS_UPPER=True, HAS_DROPOUT=True),
}

# FlexAttention variants `solattn aot` compiles for the flex dK/dV and dQ kernels (head dims 64
# and 128, 128 x 128 sparse blocks), as the forward's: the bias tables' gradients add the atomics
# of captured tensors that require grad (per element; per row, column and tile after a sum).
AOT_FLEX_VARIANTS = {
    "causal": (None, "causal"),
    "doc+relbias-grad": ("relative_bias", "document_causal"),
    "softcap+window": ("softcap_window_and", "softcap_window_and"),
    "position-biases-grad": ("position_biases", "causal"),
}
