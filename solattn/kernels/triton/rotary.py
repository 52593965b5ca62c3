"""Rotary embedding of q and in-place append of new k/v tokens into a KV cache.

Rotary (RoPE) rotates pairs of a head's first ``rotary_dim`` channels by a position's angle::

    non-interleaved (GPT-NeoX):  pairs (i, i + rotary_dim/2)      interleaved (GPT-J):  (2i, 2i+1)
    x_a' = x_a cos - x_b sin          x_b' = x_b cos + x_a sin     cos/sin index i

Channels past ``rotary_dim`` are copied unchanged. ``cos``/``sin`` are ``(seqlen_ro, rotary_dim/2)``
and row ``p`` is position ``p``. Math is float32, the result is rounded to the tensor's dtype.

:func:`append_kv` writes token ``i`` of batch entry ``b`` (``k``/``v`` of shape
``(b, s_new, h_kv, d)``) at cache position ``cache_seqlens[b] + i``: row ``p`` of sequence
``cache_batch_idx[b]`` of a contiguous cache, or row ``p % page`` of page
``block_table[b, p // page]`` of a paged one; k is rotated at position ``p`` first. Nothing
else in the cache is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solattn.kernels.keys import primed
from solattn.kernels.triton.paging import page_of
from solattn.launch import Launch, PlanCache


@triton.jit
def rotary_tile(X_row, offs_h, offs_d, stride_h, stride_d, h_ok, COS_row, SIN_row, stride_cd,
                HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """float32 ``(BLOCK_H, BLOCK_D)`` tile of heads ``offs_h`` of one token, rotated."""
    m = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    ptrs = X_row + offs_h[:, None] * stride_h
    x = tl.load(ptrs + offs_d[None, :] * stride_d, mask=m, other=0.0).to(tl.float32)
    if ROT_DIM > 0:
        half: tl.constexpr = ROT_DIM // 2
        rot = offs_d < ROT_DIM
        if INTERLEAVED:
            partner = offs_d ^ 1
            cidx = offs_d // 2
            sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
        else:
            first = offs_d < half
            partner = tl.where(first, offs_d + half, offs_d - half)
            cidx = tl.where(first, offs_d, offs_d - half)
            sign = tl.where(first, -1.0, 1.0)
        xp = tl.load(ptrs + partner[None, :] * stride_d, mask=m & rot[None, :],
                     other=0.0).to(tl.float32)
        c = tl.load(COS_row + cidx * stride_cd, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(SIN_row + cidx * stride_cd, mask=rot, other=0.0).to(tl.float32)
        x = tl.where(rot[None, :], x * c[None, :] + sign[None, :] * xp * s[None, :], x)
    return x


@triton.jit
def rotary_q_kernel(
    X, Y, COS, SIN, SEQLEN_OFFSETS,
    stride_xb, stride_xs, stride_xh, stride_xd,   # x: (b, s, h, d)
    stride_yb, stride_ys, stride_yh, stride_yd,   # y: like x
    stride_cs, stride_cd,                         # cos/sin: (seqlen_ro, rotary_dim / 2)
    n_heads, seqlen_ro,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    PER_TOKEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``y[b, i] = rope(x[b, i], pos)``, ``pos = offsets[b] + i`` (PER_TOKEN) or ``offsets[b]``,
    clamped into the table's ``[0, seqlen_ro)`` rows (an invalid offset rotates by a wrong
    angle, never reads outside cos/sin)."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    pos = tl.load(SEQLEN_OFFSETS + b)
    if PER_TOKEN:
        pos += i
    pos = tl.minimum(tl.maximum(pos, 0), seqlen_ro - 1)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < n_heads
    b64 = b.to(tl.int64)
    x_row = X + b64 * stride_xb + i.to(tl.int64) * stride_xs
    y = rotary_tile(x_row, offs_h, offs_d, stride_xh, stride_xd, h_ok,
                    COS + pos.to(tl.int64) * stride_cs, SIN + pos.to(tl.int64) * stride_cs,
                    stride_cd, HEAD_DIM, ROT_DIM, INTERLEAVED)
    y_ptrs = (Y + b64 * stride_yb + i.to(tl.int64) * stride_ys + offs_h[:, None] * stride_yh
              + offs_d[None, :] * stride_yd)
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=h_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def append_kv_kernel(
    KN, VN, KC, VC, COS, SIN, CACHE_SEQLENS, CACHE_BATCH_IDX, BLOCK_TABLE,
    stride_knb, stride_kns, stride_knh, stride_knd,   # k new: (b, s_new, h_kv, d)
    stride_vnb, stride_vns, stride_vnh, stride_vnd,   # v new: (b, s_new, h_kv, d_v)
    stride_kcb, stride_kcs, stride_kch, stride_kcd,   # k cache: (b_cache, s_cache, h_kv, d) or
    stride_vcb, stride_vcs, stride_vch, stride_vcd,   #   paged (num_pages, page, h_kv, d)
    stride_cs, stride_cd, stride_btb,
    n_heads,
    capacity, num_cache_rows, seqlen_ro,              # keys a cache row / block-table row holds,
                                                      # k_cache.shape[0], cos rows (1 without)
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # Every index value read is clamped into the tensors' extents (the host checks
    # s_new <= capacity): an invalid one writes a wrong cache row, never outside the cache.
    i = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    s_new = tl.num_programs(0)
    pos = tl.minimum(tl.maximum(tl.load(CACHE_SEQLENS + b), 0), capacity - s_new) + i
    if PAGED:
        page = page_of(BLOCK_TABLE + b64 * stride_btb, pos, num_cache_rows, PAGE_SIZE)
        k_row = KC + page * stride_kcb + (pos % PAGE_SIZE).to(tl.int64) * stride_kcs
        v_row = VC + page * stride_vcb + (pos % PAGE_SIZE).to(tl.int64) * stride_vcs
    else:
        b_cache = b64
        if HAS_BATCH_IDX:
            b_cache = tl.minimum(tl.maximum(tl.load(CACHE_BATCH_IDX + b), 0),
                                 num_cache_rows - 1).to(tl.int64)
        k_row = KC + b_cache * stride_kcb + pos.to(tl.int64) * stride_kcs
        v_row = VC + b_cache * stride_vcb + pos.to(tl.int64) * stride_vcs
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < n_heads
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    pos_ro = tl.minimum(pos, seqlen_ro - 1).to(tl.int64)
    k = rotary_tile(KN + b64 * stride_knb + i.to(tl.int64) * stride_kns, offs_h, offs_d,
                    stride_knh, stride_knd, h_ok,
                    COS + pos_ro * stride_cs, SIN + pos_ro * stride_cs,
                    stride_cd, HEAD_DIM, ROT_DIM, INTERLEAVED)
    tl.store(k_row + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
             k.to(KC.dtype.element_ty), mask=h_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    v_m = h_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    v = tl.load(VN + b64 * stride_vnb + i.to(tl.int64) * stride_vns + offs_h[:, None] * stride_vnh
                + offs_dv[None, :] * stride_vnd, mask=v_m)
    tl.store(v_row + offs_h[:, None] * stride_vch + offs_dv[None, :] * stride_vcd, v, mask=v_m)


def _block_h(n_heads: int, d: int) -> int:
    return max(1, min(triton.next_power_of_2(n_heads), 4096 // triton.next_power_of_2(d)))


def _cos_strides(cos):
    return (cos.stride(0), cos.stride(1)) if cos is not None else (0, 0)


_PLANS = PlanCache()


def _rope_key(cos, sin):
    """What a launch depends on of the rotary tables besides their values."""
    return None if cos is None else (cos.shape, cos.stride(), cos.dtype, sin.dtype)


@primed
def rotary_q(q, cos, sin, seqlen_offsets, *, interleaved: bool, per_token: bool):
    """``q (b, s, h, d)`` rotated (a new tensor) at ``offsets[b] (+ i when per_token)``."""
    y = torch.empty_like(q)
    if y.numel() == 0:
        return y
    key = ("rotary_q", q.shape, q.stride(), q.dtype, _rope_key(cos, sin), interleaved, per_token)
    launch = _PLANS.get(key)
    if launch is None:  # y's strides follow q's layout (empty_like), fixed by the key
        launch = _PLANS.put(key, _rotary_q_launch(q, y, cos, interleaved, per_token))
    launch(q, y, cos, sin, seqlen_offsets)
    return y


def _rotary_q_launch(q, y, cos, interleaved, per_token) -> Launch:
    from solattn.configs import padded_head_dim

    batch, s, h, d = q.shape
    bh = _block_h(h, d)
    return Launch(
        rotary_q_kernel, (s, batch, triton.cdiv(h, bh)),
        (*q.stride(), *y.stride(), *_cos_strides(cos), h, cos.shape[0]),
        HEAD_DIM=d, ROT_DIM=2 * cos.shape[1], INTERLEAVED=interleaved, PER_TOKEN=per_token,
        BLOCK_H=bh, BLOCK_D=padded_head_dim(d), num_warps=4)


@primed
def append_kv(k, v, k_cache, v_cache, cache_seqlens, *, cos=None, sin=None, interleaved=True,
              cache_batch_idx=None, block_table=None):
    """Write ``k``/``v (b, s_new, h_kv, d)`` into the cache in place at ``cache_seqlens[b] + i``
    (rotating k when ``cos``/``sin`` are given)."""
    if k.numel() == 0 and v.numel() == 0:
        return
    key = ("append_kv", k.shape, k.stride(), v.shape, v.stride(), k_cache.shape,
           k_cache.stride(), v_cache.shape, v_cache.stride(), k.dtype, v.dtype, k_cache.dtype,
           v_cache.dtype, _rope_key(cos, sin), interleaved, cache_batch_idx is not None,
           None if block_table is None else (block_table.shape, block_table.stride()))
    launch = _PLANS.get(key)
    if launch is None:
        launch = _PLANS.put(key, _append_kv_launch(k, v, k_cache, v_cache, cos, interleaved,
                                                   cache_batch_idx is not None, block_table))
    dummy = cache_seqlens
    launch(k, v, k_cache, v_cache, cos if cos is not None else k, sin if sin is not None else k,
           cache_seqlens, cache_batch_idx if cache_batch_idx is not None else dummy,
           block_table if block_table is not None else dummy)


def _append_kv_launch(k, v, k_cache, v_cache, cos, interleaved, has_batch_idx,
                      block_table) -> Launch:
    from solattn.configs import padded_head_dim

    batch, s_new, h_kv, d = k.shape
    dv = v.shape[-1]
    paged = block_table is not None
    bh = _block_h(h_kv, max(d, dv))
    return Launch(
        append_kv_kernel, (s_new, batch, triton.cdiv(h_kv, bh)),
        (*k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *_cos_strides(cos),
         block_table.stride(0) if paged else 0, h_kv,
         block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1],
         k_cache.shape[0], cos.shape[0] if cos is not None else 1),
        HEAD_DIM=d, HEAD_DIM_V=dv, ROT_DIM=2 * cos.shape[1] if cos is not None else 0,
        INTERLEAVED=interleaved, PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
        HAS_BATCH_IDX=has_batch_idx, BLOCK_H=bh,
        BLOCK_D=padded_head_dim(d), BLOCK_DV=padded_head_dim(dv), num_warps=4)
