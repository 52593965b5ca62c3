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

The key loop is split into three ranges from :func:`solattn.masking.block_range`: masked leading
blocks (window edge), unmasked interior blocks (no per-element predicate, no bounds checks on the
sequence), masked trailing blocks (causal diagonal, window edge, ragged end of the sequence).
Blocks outside the range are never loaded.

A row that sees no key keeps ``m = -inf`` and ``l = 0``; it returns 0 and ``lse = -inf``.
Offsets of batch/head/sequence starts are 64-bit, so tensors beyond 2**31 elements work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solattn.masking import band_mask, band_offsets, block_range

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def tanh_f32(x):
    """tanh through exp2 (portable: libdevice is unavailable in Triton's interpreter)."""
    e = tl.exp2(x * (2.0 * 1.4426950408889634))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def score_transform(qk, rows, cols, off, qk_scale, softcap_prescale, alibi_slope_log2,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw ``q.k`` -> score in the log2 domain: scale, softcap, ALiBi (in flash-attn's order).

    ``qk_scale`` is ``scale * log2(e)`` without softcap and ``softcap * log2(e)`` with it
    (then ``softcap_prescale = scale / softcap``). Shared by forward, backward and decode.
    """
    if HAS_SOFTCAP:
        s = qk_scale * tanh_f32(qk * softcap_prescale)
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        dist = rows[:, None] + off - cols[None, :]
        dist = tl.where(dist < 0, -dist, dist)
        s = s - alibi_slope_log2 * dist.to(tl.float32)
    return s


@triton.jit
def load_rows(ptrs, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load a ``[rows, BLOCK_D]`` tile whose rows are all in bounds: only a head dim padded to
    ``BLOCK_D`` is masked, so an unpadded tile loads with no predicate at all."""
    if BLOCK_D != HEAD_DIM:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def online_softmax_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, key_ok, rows, cols, offs_d, offs_dv,
                        seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        MASKED: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """One online-softmax step over a tile of keys, given pointer tiles to its K and V rows.

    The one copy of the update (shared by the forward and the decode kernels, which differ only
    in how they address K/V): ``key_ok`` (``cols < seqlen_k``) guards loads of masked tiles;
    unmasked tiles load without predicates (only a padded head dim is masked).
    """
    if MASKED:
        k = tl.load(k_ptrs, mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        k = load_rows(k_ptrs, offs_d, HEAD_DIM, BLOCK_D)
    qk = tl.dot(q, tl.trans(k))
    s = score_transform(qk, rows, cols, off, qk_scale, softcap_prescale, alibi_slope_log2,
                        HAS_SOFTCAP, HAS_ALIBI)
    if MASKED:
        mask = band_mask(rows, cols, seqlen_k, lower, upper, HAS_LOWER, HAS_UPPER, True)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with every key masked so far keeps m = -inf: subtract 0 instead (exp2(-inf) = 0).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=key_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    else:
        v = load_rows(v_ptrs, offs_dv, HEAD_DIM_V, BLOCK_DV)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_dv,
               stride_ks, stride_kd, stride_vs, stride_vd,
               seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               MASKED: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
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
        HAS_ALIBI)


@triton.jit
def _fwd_range(acc, l_i, m_i, q, k_base, v_base, lo, hi, offs_m, offs_n, offs_d, offs_dv,
               stride_ks, stride_kd, stride_vs, stride_vd,
               seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               MASKED: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_dv,
            stride_ks, stride_kd, stride_vs, stride_vd,
            seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED, HAS_LOWER, HAS_UPPER,
            HAS_SOFTCAP, HAS_ALIBI)
    return acc, l_i, m_i


@triton.jit
def seq_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k,
               IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of batch entry ``b`` (varlen or padded batch)."""
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + b)
        seqlen_q = tl.load(CU_SEQLENS_Q + b + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + b)
        seqlen_k = tl.load(CU_SEQLENS_K + b + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    if HAS_SEQUSED_K:
        seqlen_k = tl.load(SEQUSED_K + b)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def row_block_coords(group_size, HAS_UPPER: tl.constexpr):
    """``(pid_m, h, b, h_kv)`` of a program in a (query blocks, heads, batch) grid.

    Upper-banded (causal) problems give later row blocks more work: they run first, so the last
    wave is made of short programs (longest-first scheduling). Shared by the forward and the
    backward's dQ kernel, which walk the same row blocks.
    """
    pid_m = tl.program_id(0)
    if HAS_UPPER:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    return pid_m, h, tl.program_id(2), h // group_size


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, ALIBI, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
    stride_qb, stride_qs, stride_qh, stride_qd,  # q: (b, s_q, h, d) or varlen (t_q, h, d), sb = 0
    stride_kb, stride_ks, stride_kh, stride_kd,  # k: (b, s_k, h_kv, d)
    stride_vb, stride_vs, stride_vh, stride_vd,  # v: (b, s_k, h_kv, d_v)
    stride_ob, stride_os, stride_oh, stride_od,  # o: like q with d_v
    stride_lb, stride_lh,                        # lse: (b, h, s_q) or varlen (h, t_q), sb = 0
    stride_ab, stride_ah,                        # alibi slopes: (h,) or (b, h)
    seqlen_q, seqlen_k, group_size,              # batched lengths; h_q // h_kv
    qk_scale, softcap_prescale, left, right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, STORE_LSE: tl.constexpr,
):
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
        alibi_slope_log2 = slope * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, full_lo, full_hi, hi = block_range(start_m, seqlen_q, seqlen_k, lower, upper,
                                           BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)
    # Masked leading blocks (left window edge), unmasked interior, masked trailing blocks.
    acc, l_i, m_i = _fwd_range(
        acc, l_i, m_i, q, k_base, v_base, lo, full_lo, offs_m, offs_n, offs_d, offs_dv,
        stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower, upper,
        qk_scale, softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D,
        BLOCK_DV, True, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)
    acc, l_i, m_i = _fwd_range(
        acc, l_i, m_i, q, k_base, v_base, full_lo, full_hi, offs_m, offs_n, offs_d, offs_dv,
        stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower, upper,
        qk_scale, softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D,
        BLOCK_DV, False, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)
    acc, l_i, m_i = _fwd_range(
        acc, l_i, m_i, q, k_base, v_base, full_hi, hi, offs_m, offs_n, offs_d, offs_dv,
        stride_ks, stride_kd, stride_vs, stride_vd, seqlen_k, off, lower, upper,
        qk_scale, softcap_prescale, alibi_slope_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D,
        BLOCK_DV, True, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)

    # Normalize once. Rows that saw no key: l = 0 -> output 0, lse = -inf.
    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    row_ok = offs_m < seqlen_q
    o_ptrs = o_base + local_m[:, None] * stride_os + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, acc.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    if STORE_LSE:
        log2_l = tl.log2(tl.where(empty, 1.0, l_i))
        lse = tl.where(empty, float("-inf"), (m_i + log2_l) * 0.6931471805599453)
        lse_ptrs = LSE + b64 * stride_lb + h64 * stride_lh + q_start + offs_m
        tl.store(lse_ptrs, lse, mask=row_ok)


def _strides4(t):
    """(batch, seq, head, dim) strides; a packed varlen (t, h, d) tensor has batch stride 0."""
    if t.dim() == 3:
        return (0, *t.stride())
    return t.stride()


def attn_fwd(q, k, v, *, scale, has_left, has_right, left, right, softcap, alibi_slopes,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, seqused_k=None,
             return_lse=True, arch=90):
    """Launch the portable forward on normalized, validated arguments.

    ``q (b, s_q, h, d)`` / ``k (b, s_k, h_kv, d)`` / ``v (b, s_k, h_kv, d_v)``, or packed varlen
    ``(t, h, d)`` with ``cu_seqlens_q/k`` (int32, length b + 1) and ``max_seqlen_q``.
    ``seqused_k`` (b,) int32 optionally caps each sequence's key count (KV caches).
    Returns ``out`` (like q, head dim d_v) and ``lse`` (float32 ``(b, h, s_q)`` or ``(h, t_q)``;
    None when ``return_lse`` is False).
    """
    from solattn.configs import fwd_config, padded_head_dim

    varlen = cu_seqlens_q is not None
    d, dv = q.shape[-1], v.shape[-1]
    h, h_kv = q.shape[-2], k.shape[-2]
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = max_seqlen_q, 0
        out = q.new_empty(*q.shape[:-1], dv)
        lse = q.new_empty(h, q.shape[0], dtype=torch.float32) if return_lse else None
        stride_lb, stride_lh = (0, lse.stride(0)) if return_lse else (0, 0)
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = k.shape[1]
        out = q.new_empty(*q.shape[:-1], dv)
        lse = q.new_empty(batch, h, seqlen_q, dtype=torch.float32) if return_lse else None
        stride_lb, stride_lh = (lse.stride(0), lse.stride(1)) if return_lse else (0, 0)
    if out.numel() == 0 or batch == 0:
        if return_lse and lse.numel():
            lse.fill_(float("-inf"))
        return out.zero_(), lse
    cfg = fwd_config(arch, d, dv, has_right)
    if softcap > 0:
        qk_scale, prescale = softcap * LOG2E, scale / softcap
    else:
        qk_scale, prescale = scale * LOG2E, 1.0
    if alibi_slopes is not None:
        strides = alibi_slopes.stride()
        stride_ab, stride_ah = (0, strides[0]) if alibi_slopes.dim() == 1 else strides
    else:
        stride_ab = stride_ah = 0
    grid = (triton.cdiv(seqlen_q, cfg.block_m), h, batch)
    dummy = q  # unused pointer arguments (their constexpr flag is off)
    attn_fwd_kernel[grid](
        q, k, v, out, lse if return_lse else dummy,
        alibi_slopes if alibi_slopes is not None else dummy,
        cu_seqlens_q if varlen else dummy, cu_seqlens_k if varlen else dummy,
        seqused_k if seqused_k is not None else dummy,
        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(out),
        stride_lb, stride_lh, stride_ab, stride_ah,
        seqlen_q, seqlen_k, h // h_kv,
        qk_scale, prescale, left, right,
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=padded_head_dim(d), BLOCK_DV=padded_head_dim(dv),
        IS_VARLEN=varlen, HAS_SEQUSED_K=seqused_k is not None,
        HAS_LOWER=has_left, HAS_UPPER=has_right,
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None, STORE_LSE=return_lse,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def aot_specs(arch: int):
    """Every configuration the dispatcher can pick on ``arch`` (see :mod:`solattn.aot`).

    Per table entry (head dim, upper-banded): the plain kernel and one with every feature on
    (varlen, left window, softcap, ALiBi, ragged head dim).
    """
    from solattn.aot import AotSpec, make_signature
    from solattn.configs import all_fwd_configs

    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32",
                "ALIBI": "*fp32", "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32",
                "SEQUSED_K": "*i32"}
    unit = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
    variants = {
        "plain": dict(),
        "all-features": dict(IS_VARLEN=True, HAS_LOWER=True, HAS_SOFTCAP=True, HAS_ALIBI=True,
                             HAS_SEQUSED_K=True),
    }
    specs = []
    for (d, upper), cfg in all_fwd_configs(arch).items():
        for vname, flags in variants.items():
            # the all-features variant also takes a ragged head dim (d=96 in the 128 tile, etc.)
            hd = d if vname != "all-features" or d <= 16 else d * 3 // 4
            consts = dict(HEAD_DIM=hd, HEAD_DIM_V=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          BLOCK_D=d, BLOCK_DV=d, IS_VARLEN=False, HAS_SEQUSED_K=False,
                          HAS_LOWER=False, HAS_UPPER=upper, HAS_SOFTCAP=False, HAS_ALIBI=False,
                          STORE_LSE=True)
            consts.update(flags)
            sig, consts = make_signature(attn_fwd_kernel, pointers=pointers, constexprs=consts,
                                         floats=("qk_scale", "softcap_prescale"), unit=unit)
            specs.append(AotSpec(
                name="fwd_portable", fn=attn_fwd_kernel, signature=sig, constexprs=consts,
                config=(f"d{hd} bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} "
                        f"s{cfg.num_stages} {'causal ' if upper else ''}{vname}"),
                options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                pointer_args=tuple(pointers),
                divisible_args=tuple(n for n in sig if n.startswith("stride_") and n not in unit
                                     and not n.startswith("stride_a"))))
    return specs
