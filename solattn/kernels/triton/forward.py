"""Portable FlashAttention forward in ``triton.language`` (any CUDA GPU Triton supports).

One program computes ``BLOCK_M`` query rows of one (batch, head) against the keys its mask lets
it see, with the online softmax of the seeds (FlashAttention-2's loop order):

    for each key block j in the row block's range (masking.block_range):
        S   = Q K_j^T * scale * log2(e)        (softcap, ALiBi applied here; -inf where masked)
        m'  = max(m, rowmax(S))                running max, in the log2 domain
        P   = exp2(S - m')                     un-normalized probabilities
        l   = l * exp2(m - m') + rowsum(P)     running sum, rescaled to the new max
        O   = O * exp2(m - m') + P V_j         output, rescaled the same way
    O /= l ;  lse = (m + log2(l)) * ln(2)      one division at the end, natural-log LSE

With attention dropout (``HAS_DROPOUT``) the probabilities a Philox mask drops
(:func:`solattn.kernels.common.dropout_keep`) are zeroed after ``l`` has summed them and before
``P V_j``; the output is scaled by ``1 / (1 - dropout_p)`` at the end. ``l`` and the LSE are
the undropped softmax's, as in flash-attn (the backward recomputes P from them).

The key loop is split into three ranges from :func:`solattn.masking.block_range`: masked leading
blocks (window edge), unmasked interior blocks (no per-element predicate, no bounds checks on the
sequence), masked trailing blocks (causal diagonal, window edge, ragged end of the sequence).
Blocks outside the range are never loaded.

A row that sees no key keeps ``m = -inf`` and ``l = 0``; it returns 0 and ``lse = -inf``.
Offsets of batch/head/sequence starts are 64-bit, so tensors beyond 2**31 elements work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from solattn.kernels.common import (
    GROUP_ARG,
    LN2,
    LOG2E,
    SHAPE_ARGS,
    dropout_params,
    launch_fewer_stages,
    online_softmax_step,
    row_block_coords,
    seq_bounds,
    sparse_blocks,
    sparse_index,
    strides4,
    strides4_of,
)
from solattn.kernels.keys import primed
from solattn.kernels.triton.paging import CONTIGUOUS, PAGED_ROW, PAGED_TILE, cache_range
from solattn.launch import Launch, PlanCache, contiguous_strides
from solattn.masking import band_offsets, block_range


@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_dv,
               stride_ks, stride_kd, stride_vs, stride_vd,
               seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               MASKED: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               flex=None, SCORE_MOD: tl.constexpr = None, MASK_MOD: tl.constexpr = None,
               HAS_DROPOUT: tl.constexpr = False, dropout=None):
    """Keys ``[start_n, start_n + BLOCK_N)`` of a contiguous sequence (64-bit block offset)."""
    cols = start_n + offs_n
    kb = k_base + start_n.to(tl.int64) * stride_ks
    vb = v_base + start_n.to(tl.int64) * stride_vs
    k_ptrs = kb + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = vb + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd
    return online_softmax_step(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, cols < seqlen_k, offs_m, cols, offs_d, offs_dv,
        seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP,
        HAS_ALIBI, flex, SCORE_MOD, MASK_MOD, HAS_DROPOUT, dropout)


@triton.jit
def _fwd_range(acc, l_i, m_i, q, k_base, v_base, lo, hi, offs_m, offs_n, offs_d, offs_dv,
               stride_ks, stride_kd, stride_vs, stride_vd,
               seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               MASKED: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, dropout):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_dv,
            stride_ks, stride_kd, stride_vs, stride_vd,
            seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED, HAS_LOWER, HAS_UPPER,
            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT=HAS_DROPOUT, dropout=dropout)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=SHAPE_ARGS + ("num_pages",),
            do_not_specialize_on_alignment=GROUP_ARG)
def attn_fwd_kernel(
    Q, K, V, O, LSE, ALIBI, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, BLOCK_TABLE, SEED,
    stride_qb, stride_qs, stride_qh, stride_qd,  # q: (b, s_q, h, d) or varlen (t_q, h, d), sb = 0
    stride_kb, stride_ks, stride_kh, stride_kd,  # k: (b, s_k, h_kv, d), varlen (t_k, h_kv, d)
    stride_vb, stride_vs, stride_vh, stride_vd,  #   or paged (num_pages, page, h_kv, d); v: d_v
    stride_ob, stride_os, stride_oh, stride_od,  # o: like q with d_v
    stride_lb, stride_lh,                        # lse: (b, h, s_q) or varlen (h, t_q), sb = 0
    stride_ab, stride_ah,                        # alibi slopes: (h,) or (b, h)
    stride_btb, num_pages,                       # block table: (b, max_pages), last stride 1
    seqlen_q, seqlen_k, group_size,              # lengths (varlen: extents: seq_bounds); group
    qk_scale, softcap_prescale, left, right,
    dropout_threshold, dropout_scale,            # round(p * 2**31), 1 / (1 - p); SEED: (1,) i64
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGE_MODE: tl.constexpr,  # solattn.kernels.triton.paging
    HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, STORE_LSE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr = False,
):
    pid_m, h, b, h_kv = row_block_coords(group_size, HAS_UPPER)

    q_start, seqlen_q, k_start, seqlen_k = seq_bounds(
        b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_K,
        PAGE_MODE != 0)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    lower, upper = band_offsets(seqlen_q, seqlen_k, left, right)
    off = seqlen_k - seqlen_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    b64 = b.to(tl.int64)
    h64, hkv64 = h.to(tl.int64), h_kv.to(tl.int64)
    row0 = (q_start + start_m).to(tl.int64)
    q_base = Q + b64 * stride_qb + row0 * stride_qs + h64 * stride_qh
    k_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hkv64 * stride_kh
    v_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + hkv64 * stride_vh
    o_base = O + b64 * stride_ob + row0 * stride_os + h64 * stride_oh

    local_m = tl.arange(0, BLOCK_M)
    q_ptrs = q_base + local_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM), other=0.0)

    alibi_slope_log2 = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + b * stride_ab + h * stride_ah).to(tl.float32)
        alibi_slope_log2 = slope * LOG2E

    dropout = dropout_params(SEED, b, h, dropout_threshold, dropout_scale, HAS_DROPOUT)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, full_lo, full_hi, hi = block_range(start_m, seqlen_q, seqlen_k, lower, upper,
                                           BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)
    # Masked leading blocks (left window edge), unmasked interior, masked trailing blocks.
    if PAGE_MODE == 0:
        acc, l_i, m_i = _fwd_range(
            acc, l_i, m_i, q, k_base, v_base, lo, full_lo, offs_m, offs_n, offs_d, offs_dv,
            stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower, upper,
            qk_scale, softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D,
            BLOCK_DV, True, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
            dropout)
        acc, l_i, m_i = _fwd_range(
            acc, l_i, m_i, q, k_base, v_base, full_lo, full_hi, offs_m, offs_n, offs_d, offs_dv,
            stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower, upper,
            qk_scale, softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D,
            BLOCK_DV, False, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
            dropout)
        acc, l_i, m_i = _fwd_range(
            acc, l_i, m_i, q, k_base, v_base, full_hi, hi, offs_m, offs_n, offs_d, offs_dv,
            stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower, upper,
            qk_scale, softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D,
            BLOCK_DV, True, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
            dropout)
    else:
        # Paged K/V: key j of this sequence is row j % PAGE_SIZE of page
        # BLOCK_TABLE[b, j // PAGE_SIZE]; the pool's batch stride steps pages. No dropout here:
        # paged calls are inference (make_params rejects the pair).
        k_head = K + hkv64 * stride_kh
        v_head = V + hkv64 * stride_vh
        bt_row = BLOCK_TABLE + b64 * stride_btb
        acc, l_i, m_i = cache_range(
            acc, l_i, m_i, q, k_head, v_head, bt_row, num_pages, lo, full_lo, 0, offs_m, offs_n,
            offs_d, offs_dv, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE_SIZE, PAGE_MODE, True,
            HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)
        acc, l_i, m_i = cache_range(
            acc, l_i, m_i, q, k_head, v_head, bt_row, num_pages, full_lo, full_hi, 0, offs_m,
            offs_n, offs_d, offs_dv, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
            stride_vd, seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE_SIZE, PAGE_MODE, False,
            HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)
        acc, l_i, m_i = cache_range(
            acc, l_i, m_i, q, k_head, v_head, bt_row, num_pages, full_hi, hi, 0, offs_m, offs_n,
            offs_d, offs_dv, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE_SIZE, PAGE_MODE, True,
            HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)

    _fwd_store(acc, l_i, m_i, o_base, LSE, b64, h64, q_start, offs_m, local_m, offs_dv,
               stride_os, stride_od, stride_lb, stride_lh, seqlen_q, HEAD_DIM_V, STORE_LSE,
               HAS_DROPOUT, dropout)


@triton.jit
def _fwd_store(acc, l_i, m_i, o_base, LSE, b64, h64, q_start, offs_m, local_m, offs_dv,
               stride_os, stride_od, stride_lb, stride_lh, seqlen_q,
               HEAD_DIM_V: tl.constexpr, STORE_LSE: tl.constexpr,
               HAS_DROPOUT: tl.constexpr = False, dropout=None):
    """Normalize once and store a row block's output and natural-log LSE (forward kernels).
    Rows that saw no key: l = 0 -> output 0, lse = -inf. Dropout scales the output by
    ``1 / (1 - dropout_p)`` here; the LSE is the undropped softmax's."""
    empty = l_i == 0.0
    if HAS_DROPOUT:
        acc = acc * dropout[4]
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    row_ok = offs_m < seqlen_q
    o_ptrs = o_base + local_m[:, None] * stride_os + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, acc.to(o_base.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    if STORE_LSE:
        log2_l = tl.log2(tl.where(empty, 1.0, l_i))
        lse = tl.where(empty, float("-inf"), (m_i + log2_l) * LN2)
        lse_ptrs = LSE + b64 * stride_lb + h64 * stride_lh + q_start + offs_m
        tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _fwd_sparse(acc, l_i, m_i, q, k_base, v_base, LIST, b, h, row, rows, offs_n, offs_d,
                offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, qk_scale, flex,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPARSE_N: tl.constexpr,
                MASKED: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, dropout):
    """The key tiles of the sparse blocks one BlockMask list gives row block ``row``, each
    ``SPARSE_N`` keys walked ``BLOCK_N`` at a time: partial blocks ``MASKED`` (bounds and
    ``MASK_MOD``), full blocks with no per-element mask."""
    count, idx = sparse_blocks(LIST, b, h, row)
    # The key blocks these indices may name: full blocks lie inside the keys (kernel_lists),
    # partial ones may end past them. A row lists each block once at most.
    n_blocks = tl.cdiv(seqlen_k, SPARSE_N) if MASKED else seqlen_k // SPARSE_N
    count = tl.minimum(count, n_blocks)
    for t in range(0, count * (SPARSE_N // BLOCK_N)):
        start_n = (sparse_index(idx, t // (SPARSE_N // BLOCK_N), n_blocks) * SPARSE_N
                   + (t % (SPARSE_N // BLOCK_N)) * BLOCK_N)
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, k_base, v_base, start_n, rows, offs_n, offs_d, offs_dv,
            stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, 0, 0, 0, qk_scale, 1.0, 0.0,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED, False, False, False, False,
            flex, SCORE_MOD, MASK_MOD, HAS_DROPOUT, dropout)
    return acc, l_i, m_i


@triton.jit
def attn_fwd_flex_kernel(
    Q, K, V, O, LSE,
    KV_LIST, FULL_KV_LIST,                       # BlockMask lists, kv-major (sparse_blocks)
    SCORE_ARGS, MASK_ARGS,                       # the mods' captured tensors (flex/codegen.py)
    SEED,                                        # dropout's (1,) int64 seed
    stride_qb, stride_qs, stride_qh, stride_qd,  # q: (b, s_q, h, d) view of flex's (B, H, L, E)
    stride_kb, stride_ks, stride_kh, stride_kd,  # k: (b, s_k, h_kv, d)
    stride_vb, stride_vs, stride_vh, stride_vd,  # v: (b, s_k, h_kv, d_v)
    stride_ob, stride_os, stride_oh, stride_od,  # o: like q with d_v
    stride_lb, stride_lh,                        # lse: (b, h, s_q)
    seqlen_q, seqlen_k, group_size, sm_scale, qk_scale,
    dropout_threshold, dropout_scale,            # round(p * 2**31), 1 / (1 - p)
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,  # the BlockMask's block size
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, STORE_LSE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr = False,
):
    """FlexAttention forward (solattn.flex): the same online softmax over the key blocks a
    BlockMask lists for this row block (``BLOCK_M`` divides ``SPARSE_M``) -- partial blocks with
    ``MASK_MOD``, full blocks unmasked -- with ``SCORE_MOD`` on every score. The host guarantees
    that full blocks lie inside both sequences (ragged edge blocks are listed as partial)."""
    pid_m, h, b, h_kv = row_block_coords(group_size, False)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    local_m = tl.arange(0, BLOCK_M)

    b64 = b.to(tl.int64)
    h64, hkv64 = h.to(tl.int64), h_kv.to(tl.int64)
    row0 = start_m.to(tl.int64)
    q_base = Q + b64 * stride_qb + row0 * stride_qs + h64 * stride_qh
    k_base = K + b64 * stride_kb + hkv64 * stride_kh
    v_base = V + b64 * stride_vb + hkv64 * stride_vh
    o_base = O + b64 * stride_ob + row0 * stride_os + h64 * stride_oh
    q = tl.load(q_base + local_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM), other=0.0)

    flex = (b, h, sm_scale, SCORE_ARGS, MASK_ARGS)
    dropout = dropout_params(SEED, b, h, dropout_threshold, dropout_scale, HAS_DROPOUT)
    rows = tl.minimum(offs_m, seqlen_q - 1)  # the mods see padded rows as the last row
    row = start_m // SPARSE_M
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc, l_i, m_i = _fwd_sparse(
        acc, l_i, m_i, q, k_base, v_base, KV_LIST, b, h, row, rows, offs_n, offs_d, offs_dv,
        stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, qk_scale, flex, HEAD_DIM,
        HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, SPARSE_N, True, SCORE_MOD, MASK_MOD,
        HAS_DROPOUT, dropout)
    acc, l_i, m_i = _fwd_sparse(
        acc, l_i, m_i, q, k_base, v_base, FULL_KV_LIST, b, h, row, rows, offs_n, offs_d,
        offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, qk_scale, flex, HEAD_DIM,
        HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, SPARSE_N, False, SCORE_MOD, None,
        HAS_DROPOUT, dropout)
    _fwd_store(acc, l_i, m_i, o_base, LSE, b64, h64, 0, offs_m, local_m, offs_dv,
               stride_os, stride_od, stride_lb, stride_lh, seqlen_q, HEAD_DIM_V, STORE_LSE,
               HAS_DROPOUT, dropout)


@primed
def attn_fwd(q, k, v, p, *, return_lse=True, arch=90, config=None):
    """Launch the portable forward for :class:`solattn.params.AttnParams` ``p`` on validated,
    non-empty inputs (``solattn.core.attn_forward`` handles empty ones).

    ``q (b, s_q, h, d)`` / ``k (b, s_k, h_kv, d)`` / ``v (b, s_k, h_kv, d_v)``, or packed varlen
    ``(t, h, d)`` with ``p.cu_seqlens_q/k``; ``p.seqused_k`` optionally caps each sequence's key
    count. With ``p.block_table`` (varlen only) ``k``/``v`` are page pools ``(num_pages,
    page_size, h_kv, d[_v])`` read in place (any page size). Returns ``out`` (like q, head dim
    d_v, dtype ``p.out_dtype`` or q's) and ``lse`` (float32 ``(b, h, s_q)`` or ``(h, t_q)``;
    None unless ``return_lse``). ``config`` overrides the table (sweeps).
    """
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
           v.dtype, p.launch_key, return_lse, arch, config)
    plan = _FWD_PLANS.get(key) or _FWD_PLANS.put(key, _fwd_plan(q, k, v, p, return_lse, arch,
                                                                config))
    out = q.new_empty(plan.out_shape, dtype=p.out_dtype or q.dtype)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32) if return_lse else q
    plan.launch(q, k, v, out, lse, p.alibi_slopes if p.has_alibi else q,
                p.cu_seqlens_q if p.varlen else q,
                p.cu_seqlens_k if p.cu_seqlens_k is not None else q,
                p.seqused_k if p.seqused_k is not None else q,
                p.block_table if p.paged else q, p.dropout_seed if p.has_dropout else q)
    return out, (lse if return_lse else None)


@dataclass(frozen=True)
class _FwdPlan:
    out_shape: tuple
    lse_shape: tuple
    launch: Launch


_FWD_PLANS = PlanCache()


def _fwd_plan(q, k, v, p, return_lse, arch, config) -> _FwdPlan:
    """Everything :func:`attn_fwd` launches with but the tensors (unused pointer arguments, whose
    constexpr flag is off, get ``q``)."""
    from solattn.configs import dropout_fwd_config, fwd_config, padded_head_dim

    d, dv = q.shape[-1], v.shape[-1]
    h = q.shape[-2]
    out_shape = (*q.shape[:-1], dv)
    if p.varlen:
        # The kernel gets the extents every cu_seqlens / seqused_k value is clamped into
        # (common.seq_bounds): the packed rows of q and k, or the keys a block-table row holds.
        batch = p.cu_seqlens_q.numel() - 1
        seqlen_q = p.max_seqlen_q
        extent_q = q.shape[0]
        extent_k = p.block_table.shape[1] * k.shape[1] if p.paged else k.shape[0]
        lse_shape = (h, q.shape[0])
        stride_lb, stride_lh = (0, contiguous_strides(lse_shape)[0]) if return_lse else (0, 0)
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        extent_q, extent_k = seqlen_q, seqlen_k
        lse_shape = (batch, h, seqlen_q)
        stride_lb, stride_lh = contiguous_strides(lse_shape)[:2] if return_lse else (0, 0)
    cfg = config or fwd_config(arch, d, dv, p.has_right)
    if p.has_dropout and config is None:
        cfg = dropout_fwd_config(cfg)
    grid = (triton.cdiv(seqlen_q, cfg.block_m), h, batch)
    if p.paged:  # one page number per key tile where pages hold whole tiles, else per key row
        page_size = k.shape[1]
        page_mode = PAGED_TILE if page_size % cfg.block_n == 0 else PAGED_ROW
    else:
        page_size, page_mode = 1, CONTIGUOUS
    launch = Launch(
        attn_fwd_kernel, grid,
        (*strides4(q), *strides4(k), *strides4(v), *strides4_of(out_shape),
         stride_lb, stride_lh, *p.alibi_strides, p.block_table.stride(0) if p.paged else 0,
         k.shape[0] if p.paged else 1, extent_q, extent_k, p.group_size,
         p.qk_scale, p.softcap_prescale, p.left, p.right,
         p.dropout_threshold, p.dropout_scale),
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=padded_head_dim(d), BLOCK_DV=padded_head_dim(dv),
        IS_VARLEN=p.varlen, HAS_SEQUSED_K=p.seqused_k is not None,
        PAGE_SIZE=page_size, PAGE_MODE=page_mode,
        HAS_LOWER=p.has_left, HAS_UPPER=p.has_right,
        HAS_SOFTCAP=p.has_softcap, HAS_ALIBI=p.has_alibi, STORE_LSE=return_lse,
        HAS_DROPOUT=p.has_dropout, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return _FwdPlan(out_shape, lse_shape, launch)


@primed
def attn_fwd_flex(q, k, v, fp, *, arch=90):
    """Launch the FlexAttention forward for :class:`solattn.flex.ops.FlexParams` ``fp`` on
    validated, non-empty ``(b, s, h, d)`` views -> ``(out (B, H, L, d_v), lse (B, H, L) fp32)``
    (contiguous in flex's layout)."""
    from solattn.configs import flex_fwd_config, padded_head_dim

    batch, seqlen_q, h, d = q.shape
    seqlen_k, dv = k.shape[1], v.shape[-1]
    out = q.new_empty(batch, h, seqlen_q, dv)
    lse = q.new_empty(batch, h, seqlen_q, dtype=torch.float32)
    cfg = flex_fwd_config(arch, d, dv)
    sparse_m, sparse_n = fp.block_size
    block_m, block_n = min(cfg.block_m, sparse_m), min(cfg.block_n, sparse_n)
    o = out.transpose(1, 2)
    grid = (triton.cdiv(seqlen_q, block_m), h, batch)
    launch_fewer_stages(lambda stages: attn_fwd_flex_kernel[grid](
        q, k, v, o, lse, fp.kv_list(), fp.full_kv_list(), fp.score_args(), fp.mask_args(),
        fp.dropout_seed if fp.has_dropout else q,
        *strides4(q), *strides4(k), *strides4(v), *strides4(o), lse.stride(0), lse.stride(1),
        seqlen_q, seqlen_k, fp.group_size, fp.scale, fp.qk_scale, fp.dropout_threshold,
        fp.dropout_scale,
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=padded_head_dim(d), BLOCK_DV=padded_head_dim(dv),
        SPARSE_M=sparse_m, SPARSE_N=sparse_n, SCORE_MOD=fp.score_fwd, MASK_MOD=fp.mask_fwd,
        STORE_LSE=True, HAS_DROPOUT=fp.has_dropout, num_warps=cfg.num_warps, num_stages=stages,
    ), cfg.num_stages)
    return out, lse


# Flag sets `solattn aot` compiles for every table config (data only: aot_calls.py replays them):
# the plain kernel, every feature at once with a ragged head dim (d=96 in the 128 tile, ...),
# the most live registers, and the plain kernel with attention dropout (training).
AOT_VARIANTS = {
    "plain": dict(),
    "all-features": dict(IS_VARLEN=True, HAS_LOWER=True, HAS_SOFTCAP=True, HAS_ALIBI=True,
                         HAS_SEQUSED_K=True, RAGGED_HEAD_DIM=True),
    # Paged varlen (serving): a page number per key row (16-token pages) with every feature,
    # and one per tile (256-token pages hold whole key tiles of every table config).
    "paged16-all": dict(IS_VARLEN=True, HAS_LOWER=True, HAS_SOFTCAP=True, HAS_ALIBI=True,
                        HAS_SEQUSED_K=True, PAGE_MODE=PAGED_ROW, PAGE_SIZE=16,
                        RAGGED_HEAD_DIM=True),
    "paged256": dict(IS_VARLEN=True, HAS_SEQUSED_K=True, PAGE_MODE=PAGED_TILE, PAGE_SIZE=256),
    "dropout": dict(HAS_DROPOUT=True),
}

# FlexAttention variants `solattn aot` compiles (attn_fwd_flex_kernel at head dims 64 and 128,
# table tiles, 128 x 128 sparse blocks): mods of solattn.flex.examples by name,
# (score_mod, mask_mod). A plain mask; a gathered mask (document ids) with a gathered bias
# table (the most captured loads); softcap's tanh with an and_masks window.
AOT_FLEX_VARIANTS = {
    "causal": (None, "causal"),
    "doc+relbias": ("relative_bias", "document_causal"),
    "softcap+window": ("softcap_window_and", "softcap_window_and"),
}
