"""flash-attn's ``S_dmask``: the attention probabilities of a call with dropout, each dropped
element's sign flipped (``return_attn_probs=True`` with ``dropout_p > 0``).

``S[b, h, i, j] = P[i, j]`` where the forward kept that probability and ``-P[i, j]`` where it
dropped it; ``P`` is the undropped softmax, normalized by the forward's own log-sum-exp (so
``S.abs()`` rows sum to 1, and to 0 for rows that see no key). Elements outside a sequence
(varlen rows and keys past each sequence's lengths) and masked elements are 0.

One program recomputes ``BLOCK_M`` query rows of one (batch entry, query head) against every key
tile, with the forward's own pieces: :func:`~solattn.kernels.common.score_transform` (scale,
softcap, ALiBi), :func:`~solattn.masking.band_mask` (causal / local windows) and
:func:`~solattn.kernels.common.dropout_keep` (the keep mask is a pure function of the seed and
the element's coordinates, so it is exactly the mask the forward applied). It is a testing
output, as in flash-attn: ``(batch, nheads, seqlen_q, seqlen_k)`` elements in q's dtype
(flash-attn pads both lengths to multiples of 128 and stores unnormalized values; both crop to
the same matrix in flash-attn's tests' ``convert_flash_attn_S_to_softmax``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solattn.kernels.common import (
    LOG2E,
    dropout_keep,
    dropout_params,
    score_transform,
    seq_bounds,
)
from solattn.masking import band_mask, band_offsets
from solattn.params import AttnParams

BLOCK_M = 64
BLOCK_N = 64  # a multiple of 4: dropout_keep draws for four consecutive keys at a time


@triton.jit
def attn_probs_kernel(
    Q, K, LSE, ALIBI, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, SEED, S,
    stride_qb, stride_qs, stride_qh, stride_qd,  # q: (b, s_q, h, d) or varlen (t_q, h, d), sb = 0
    stride_kb, stride_ks, stride_kh, stride_kd,  # k: (b, s_k, h_kv, d) or varlen (t_k, h_kv, d)
    stride_lb, stride_lh, stride_lm,             # lse: (b, h, s_q) or varlen (h, t_q), sb = 0
    stride_ab, stride_ah,                        # alibi slopes: (h,) or (b, h)
    stride_sb, stride_sh, stride_sm,             # S: (b, h, out_q, out_k), last stride 1
    seqlen_q, seqlen_k, out_q, out_k, group_size,  # lengths (varlen: extents); S's last dims
    qk_scale, softcap_prescale, left, right, dropout_threshold,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    h_kv = h // group_size
    q_start, seqlen_q, k_start, seqlen_k = seq_bounds(
        b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_K)
    lower, upper = band_offsets(seqlen_q, seqlen_k, left, right)
    off = seqlen_k - seqlen_q

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    b64, h64, hkv64 = b.to(tl.int64), h.to(tl.int64), h_kv.to(tl.int64)
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + q_rows[:, None] * stride_qs
                + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    lse = tl.load(LSE + b64 * stride_lb + h64 * stride_lh + q_rows * stride_lm, mask=row_ok,
                  other=0.0)
    # log2 domain, as the scores; an empty row (lse = -inf) has only -inf scores: subtract 0
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)

    alibi_slope_log2 = 0.0
    if HAS_ALIBI:
        alibi_slope_log2 = tl.load(ALIBI + b * stride_ab + h * stride_ah).to(tl.float32) * LOG2E
    dropout = dropout_params(SEED, b, h, dropout_threshold, 1.0, True)

    k_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hkv64 * stride_kh
    s_base = S + b64 * stride_sb + h64 * stride_sh + offs_m[:, None].to(tl.int64) * stride_sm
    for start_n in range(0, out_k, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd,
                    mask=(cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        s = score_transform(tl.dot(q, tl.trans(k)), offs_m, cols, off, qk_scale,
                            softcap_prescale, alibi_slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        allowed = band_mask(offs_m, cols, seqlen_k, lower, upper, HAS_LOWER, HAS_UPPER, True)
        allowed = allowed & row_ok[:, None]
        p = tl.where(allowed, tl.exp2(tl.where(allowed, s, 0.0) - lse2[:, None]), 0.0)
        p = tl.where(dropout_keep(dropout, offs_m[:, None], cols[None, :]), p, -p)
        tl.store(s_base + cols[None, :], p.to(S.dtype.element_ty),
                 mask=(offs_m[:, None] < out_q) & (cols[None, :] < out_k))


def attn_probs(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
               p: AttnParams) -> torch.Tensor:
    """``S_dmask`` of a forward with dropout that took ``q``, ``k`` and ``p`` and returned
    ``lse``: ``(batch, nheads, seqlen_q, seqlen_k)`` in q's dtype, varlen ``(batch, nheads,
    max_seqlen_q, max_seqlen_k)`` with sequence ``b`` in the top-left corner of ``S[b]``."""
    if p.varlen:
        batch = p.cu_seqlens_q.numel() - 1
        (t_q, heads, d), t_k = q.shape, k.shape[0]
        out_q, out_k = p.max_seqlen_q, p.max_seqlen_k
        sq, sk = (0, *q.stride()), (0, *k.stride())
        sl = (0, *lse.stride())
        extents = (t_q, t_k)
    else:
        batch, s_q, heads, d = q.shape
        out_q, out_k = s_q, k.shape[1]
        sq, sk, sl = q.stride(), k.stride(), lse.stride()
        extents = (s_q, out_k)
    s = torch.empty(batch, heads, out_q, out_k, dtype=q.dtype, device=q.device)
    if s.numel() == 0:
        return s
    has_left, has_right, left, right = p.band
    dummy = p.dropout_seed  # any tensor for the pointers a flag leaves unread
    grid = (triton.cdiv(out_q, BLOCK_M), heads, batch)
    attn_probs_kernel[grid](
        q, k, lse, p.alibi_slopes if p.has_alibi else dummy,
        p.cu_seqlens_q if p.varlen else dummy, p.cu_seqlens_k if p.varlen else dummy,
        p.seqused_k if p.seqused_k is not None else dummy, p.dropout_seed, s,
        *sq, *sk, *sl, *p.alibi_strides, *s.stride()[:3],
        *extents, out_q, out_k, p.group_size,
        p.qk_scale, p.softcap_prescale, left, right, p.dropout_threshold,
        HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(d)),
        IS_VARLEN=p.varlen, HAS_SEQUSED_K=p.seqused_k is not None,
        HAS_LOWER=has_left, HAS_UPPER=has_right, HAS_SOFTCAP=p.has_softcap,
        HAS_ALIBI=p.has_alibi, num_warps=8 if d > 128 else 4)  # d=256 at 4 warps spills
    return s
