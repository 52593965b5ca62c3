"""Split-KV attention over a KV cache (flash-decoding), contiguous or paged, in ``triton.language``.

A decode step reads the whole cache once and does almost no arithmetic per byte, so its speed of
light is HBM bandwidth. Two things decide whether a kernel gets there:

* **Every K/V byte is read once.** The query heads of a GQA group share their kv head, so one
  program packs all ``seqlen_q * group`` (query, head) pairs of a kv head into the rows of its
  tile: packed row ``t`` is query ``t // group`` of head ``h_kv * group + t % group``. K and V are
  then read once per kv head, not once per query head.
* **Enough bytes in flight on every SM.** One (batch, kv head) is too little work for a GPU when
  the batch is small, so the key range is cut into ``num_splits`` slices, one program each
  (grid ``(num_splits, m_blocks * h_kv, batch)``). Each writes a partial output and its LSE,
  merged by the associative update of attention states: with ``FUSE_COMBINE`` inside this
  launch, by the last split of each (b, kv head, row block) to finish (an arrival counter per
  program row in a cached workspace, reset by that last split), else by
  :mod:`solattn.kernels.triton.combine`'s kernel. With one split the kernel writes the final
  output directly.
* **One launch per decode step** (:class:`FusedDecode`). A decode step on the GPU does ~10-25 us
  of work, less than the host's cost of a launch and an allocation, so the step is one launch
  allocating only its output: ``APPEND`` writes the new k/v into the cache from inside the
  kernel (each token by the split whose key slice holds it, the one program that reads it,
  before it reads), ``FUSE_COMBINE`` merges the splits, and the partials and counters live in a
  workspace kept per (device, stream).

Keys are addressed by *logical* index ``j`` in ``[0, seqlen_k)``; key ``j`` lives at cache
position ``p = leftpad + j`` (``leftpad`` = 0 without ``cache_leftpad``). In a contiguous cache
``p`` is the row of batch entry ``cache_batch_idx[b]``; in a paged cache it is row ``p % page``
of page ``block_table[b, p // page]``, for any power-of-two page size. When a page holds whole
key blocks (``page >= block_n``, no left padding) one page number serves a whole tile; smaller
pages gather a page number per key row (each row is still ``d`` contiguous elements: 16-byte
loads either way). The addressing, :mod:`solattn.kernels.triton.paging`, is shared with the
portable forward's paged varlen path.

The mask is :mod:`solattn.masking`'s band, bottom-right aligned with ``seqlen_k`` = this
sequence's key count and ``seqlen_q`` = the query count; each split intersects its slice with
:func:`~solattn.masking.block_range`'s masked / unmasked ranges, so only edge blocks pay for the
per-element predicate. Positions past ``seqlen_k`` are never loaded (their page numbers neither).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from solattn.device import device_arch, num_sms
from solattn.kernels.common import GROUP_ARG, LN2, LOG2E
from solattn.kernels.keys import primed
from solattn.kernels.triton.combine import combine_launch, merge_parts
from solattn.kernels.triton.paging import (
    CONTIGUOUS,
    PAGED_ROW,
    PAGED_TILE,
    cache_range,
    page_of,
)
from solattn.launch import Launch, PlanCache, contiguous_strides
from solattn.masking import band_offsets, block_range
from solattn.params import AttnParams, decode_params

# Integer arguments the decode kernel does not specialize on (as the portable kernels'
# SHAPE_ARGS): lengths, split count, window offsets, the block table's row stride and the LSE
# strides (they follow the head and query counts). One binary per (dtype, head dim, flags, MHA
# or GQA) then serves every cache length, batch and head count, and `solattn warmup --kvcache`
# can compile it ahead. q/k/v/o strides stay specialized (16-byte vector loads).
DECODE_SHAPE_ARGS = ("seqlen_q", "seqlen_k_max", "seqlen_new", "num_splits", "left", "right",
                     "num_cache_rows",
                     "stride_btb", "stride_l_split", "stride_lb", "stride_ls", "stride_lh",
                     "stride_lob", "stride_los", "stride_loh")


@triton.jit(do_not_specialize=DECODE_SHAPE_ARGS, do_not_specialize_on_alignment=GROUP_ARG)
def decode_kernel(
    Q, K, V, O, LSE, ALIBI, CACHE_SEQLENS, CACHE_BATCH_IDX, LEFTPAD, BLOCK_TABLE,
    K_NEW, V_NEW, OUT, LSE_OUT, SEMAPHORES,
    stride_qb, stride_qs, stride_qh, stride_qd,        # q: (b, s_q, h, d)
    stride_kb, stride_ks, stride_kh, stride_kd,        # k cache: (b_cache, s_cache, h_kv, d) or
    stride_vb, stride_vs, stride_vh, stride_vd,        #   paged (num_pages, page, h_kv, d); v: d_v
    stride_o_split, stride_ob, stride_os, stride_oh, stride_od,  # o: ([splits,] b, s_q, h, d_v)
    stride_l_split, stride_lb, stride_ls, stride_lh,   # lse: ([splits,] b, .., ..) any order
    stride_ab, stride_ah,                              # alibi slopes: (h,) or (b, h)
    stride_btb,                                        # block table: (b, max_pages)
    stride_knb, stride_kns, stride_knh, stride_knd,    # new k: (b, s_new, h_kv, d) (APPEND)
    stride_vnb, stride_vns, stride_vnh, stride_vnd,    # new v: (b, s_new, h_kv, d_v)
    stride_outb, stride_outs, stride_outh, stride_outd,  # merged out (FUSE_COMBINE)
    stride_lob, stride_los, stride_loh,                # merged lse, (b, s_q, h) order
    seqlen_q, seqlen_k_max, seqlen_new, group_size, num_splits,
    qk_scale, softcap_prescale, left, right,
    num_cache_rows,                                    # k_cache.shape[0]: b_cache or num_pages
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGE_MODE: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    APPEND: tl.constexpr, FUSE_COMBINE: tl.constexpr,
):
    split = tl.program_id(0)
    pid_mh = tl.program_id(1)
    b = tl.program_id(2)
    n_hkv = tl.num_programs(1) // tl.cdiv(seqlen_q * group_size, BLOCK_M)
    h_kv = pid_mh % n_hkv
    pid_m = pid_mh // n_hkv

    # Keys of this sequence: cache_seqlens[b] (+ the appended tokens) minus the left padding.
    # seqlen_k_max is the cache's capacity (a block-table row's keys when paged; the host
    # checks seqlen_new <= it): cache_seqlens is clamped into [0, capacity - seqlen_new] and
    # leftpad into [0, keys], so every position read or written lies in the cache, whatever
    # the index tensors hold (valid values are unchanged).
    seqlen_k = seqlen_k_max
    if HAS_SEQLENS:
        seqlen_k = tl.minimum(tl.maximum(tl.load(CACHE_SEQLENS + b), 0),
                              seqlen_k_max - seqlen_new) + seqlen_new
    leftpad = 0
    if HAS_LEFTPAD:
        leftpad = tl.minimum(tl.maximum(tl.load(LEFTPAD + b), 0), seqlen_k)
        seqlen_k = seqlen_k - leftpad
    lower, upper = band_offsets(seqlen_q, seqlen_k, left, right)
    off = seqlen_k - seqlen_q

    # Packed rows: t -> (query t // group, head h_kv * group + t % group).
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_rows = seqlen_q * group_size
    row_ok = t < n_rows
    q_rows = t // group_size
    heads = h_kv * group_size + t % group_size
    q_first = (pid_m * BLOCK_M) // group_size
    q_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1
    q_last = q_last // group_size

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)

    q_ptrs = (Q + b64 * stride_qb + q_rows[:, None].to(tl.int64) * stride_qs
              + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    slopes = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(ALIBI + b * stride_ab + heads * stride_ah, mask=row_ok, other=0.0)
        slopes = (slopes.to(tl.float32) * LOG2E)[:, None]

    if PAGE_MODE == 0:
        b_cache = b64
        if HAS_BATCH_IDX:
            b_cache = tl.minimum(tl.maximum(tl.load(CACHE_BATCH_IDX + b), 0),
                                 num_cache_rows - 1).to(tl.int64)
        K_head = K + b_cache * stride_kb + h_kv.to(tl.int64) * stride_kh
        V_head = V + b_cache * stride_vb + h_kv.to(tl.int64) * stride_vh
    else:
        K_head = K + h_kv.to(tl.int64) * stride_kh
        V_head = V + h_kv.to(tl.int64) * stride_vh
    BT_ROW = BLOCK_TABLE + b64 * stride_btb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Rows q_first..q_last; block_range's BLOCK_ROWS is an upper bound of their count (it only
    # makes the unmasked interior conservatively smaller, never wrong).
    lo, full_lo, full_hi, hi = block_range(q_first, q_last + 1, seqlen_k, lower, upper,
                                           BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)
    # This split's slice of [lo, hi), in whole key blocks.
    blocks_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
    s_lo = lo + split * blocks_per_split * BLOCK_N
    s_hi = tl.minimum(s_lo + blocks_per_split * BLOCK_N, hi)
    if APPEND:
        # Each new token is written by the split whose slice holds it, which alone reads it;
        # the barrier makes the CTA's writes visible to its own loads below.
        append_owned(K_NEW, V_NEW, K_head, V_head, BT_ROW, num_cache_rows, b64, h_kv, split,
                     num_splits, lo, tl.maximum(blocks_per_split, 1) * BLOCK_N, seqlen_k,
                     seqlen_new, leftpad, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
                     stride_vd, stride_knb, stride_kns, stride_knh, stride_knd,
                     stride_vnb, stride_vns, stride_vnh, stride_vnd, offs_d, offs_dv,
                     HEAD_DIM, HEAD_DIM_V, PAGE_SIZE, PAGE_MODE)
        tl.debug_barrier()
    acc, l_i, m_i = cache_range(
        acc, l_i, m_i, q, K_head, V_head, BT_ROW, num_cache_rows, s_lo,
        tl.minimum(full_lo, s_hi), leftpad,
        q_rows, offs_n, offs_d, offs_dv, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
        stride_vd, seqlen_k, off, lower, upper, qk_scale, softcap_prescale, slopes,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE_SIZE, PAGE_MODE, True,
        HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)
    acc, l_i, m_i = cache_range(
        acc, l_i, m_i, q, K_head, V_head, BT_ROW, num_cache_rows, tl.maximum(full_lo, s_lo),
        tl.minimum(full_hi, s_hi), leftpad,
        q_rows, offs_n, offs_d, offs_dv, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
        stride_vd, seqlen_k, off, lower, upper, qk_scale, softcap_prescale, slopes,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE_SIZE, PAGE_MODE, False,
        HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)
    acc, l_i, m_i = cache_range(
        acc, l_i, m_i, q, K_head, V_head, BT_ROW, num_cache_rows, tl.maximum(full_hi, s_lo),
        s_hi, leftpad,
        q_rows, offs_n, offs_d, offs_dv, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
        stride_vd, seqlen_k, off, lower, upper, qk_scale, softcap_prescale, slopes,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE_SIZE, PAGE_MODE, True,
        HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)

    # Rows that saw no key in this slice: output 0, lse -inf (the combine gives them weight 0).
    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"),
                   (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    split64 = split.to(tl.int64)
    o_ptrs = (O + split64 * stride_o_split + b64 * stride_ob
              + q_rows[:, None].to(tl.int64) * stride_os
              + heads[:, None].to(tl.int64) * stride_oh + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, acc.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    l_ptrs = (LSE + split64 * stride_l_split + b64 * stride_lb + q_rows.to(tl.int64) * stride_ls
              + heads.to(tl.int64) * stride_lh)
    tl.store(l_ptrs, lse, mask=row_ok)

    if FUSE_COMBINE:
        # The last of the (b, kv head, row block)'s splits to finish merges the partials: every
        # split counts itself in once its partials are stored (the barrier orders all its
        # threads' stores before the release); the one that reads num_splits - 1 resets the
        # counter for the next launch and sees every other split's stores (acquire).
        tl.debug_barrier()
        counter = SEMAPHORES + b * tl.num_programs(1) + pid_mh
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            # MERGE_ROWS packed rows at a time (a decode step's kv head has group_size rows),
            # MERGE_PARTS splits a step: an fp32 [rows, parts, d] tile of 64 registers a thread
            # at 4 warps: 16 parts at d=128, the kernel's 128 registers (32 parts took it to 203,
            # two CTAs an SM instead of four).
            MERGE_ROWS: tl.constexpr = 4
            MERGE_PARTS: tl.constexpr = 2048 // BLOCK_DV
            row0 = pid_m * BLOCK_M
            row_end = tl.minimum(row0 + BLOCK_M, n_rows)
            dv_ok = offs_dv < HEAD_DIM_V
            for r0 in range(row0, row_end, MERGE_ROWS):
                tm = r0 + tl.arange(0, MERGE_ROWS)
                tm_ok = tm < row_end
                qm = (tm // group_size).to(tl.int64)
                hm = (h_kv * group_size + tm % group_size).to(tl.int64)
                # .cg: other SMs wrote the partials, read them from L2
                out, lse_all = merge_parts(
                    O + b64 * stride_ob + qm * stride_os + hm * stride_oh,
                    LSE + b64 * stride_lb + qm * stride_ls + hm * stride_lh,
                    tm_ok, offs_dv, dv_ok, stride_o_split, stride_l_split, stride_od,
                    num_splits, MERGE_ROWS, BLOCK_DV, MERGE_PARTS, ".cg")
                out_ptrs = (OUT + b64 * stride_outb + qm[:, None] * stride_outs
                            + hm[:, None] * stride_outh + offs_dv[None, :] * stride_outd)
                tl.store(out_ptrs, out.to(OUT.dtype.element_ty),
                         mask=tm_ok[:, None] & dv_ok[None, :])
                tl.store(LSE_OUT + b64 * stride_lob + qm * stride_los + hm * stride_loh,
                         lse_all, mask=tm_ok)


@triton.jit
def append_owned(K_NEW, V_NEW, K_head, V_head, BT_ROW, num_pages, b64, h_kv, split, num_splits,
                 lo, span, seqlen_k, seqlen_new, leftpad, stride_kp, stride_ks, stride_kd,
                 stride_vp, stride_vs, stride_vd, stride_knb, stride_kns, stride_knh, stride_knd,
                 stride_vnb, stride_vns, stride_vnh, stride_vnd, offs_d, offs_dv,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, PAGE_MODE: tl.constexpr):
    """Write the new tokens of kv head ``h_kv`` that split ``split`` owns into the cache.

    New token ``i`` is logical key ``j = seqlen_k - seqlen_new + i`` at cache position
    ``leftpad + j``. Split ``s`` reads keys ``[lo + s * span, lo + (s + 1) * span)`` only (its
    tiles, masked tail included, never leave that window), so the split whose window holds
    ``j`` owns it; a token outside ``[lo, hi)`` (no query sees it) goes to the first or last
    split, so every token is written exactly once.
    """
    for i in range(seqlen_new):
        j = seqlen_k - seqlen_new + i
        owner = tl.where(j < lo, 0, tl.minimum((j - lo) // span, num_splits - 1))
        if owner == split:
            pos = leftpad + j
            if PAGE_MODE == 0:
                k_dst = K_head + pos.to(tl.int64) * stride_ks
                v_dst = V_head + pos.to(tl.int64) * stride_vs
            else:
                page = page_of(BT_ROW, pos, num_pages, PAGE_SIZE)
                row = (pos % PAGE_SIZE).to(tl.int64)
                k_dst = K_head + page * stride_kp + row * stride_ks
                v_dst = V_head + page * stride_vp + row * stride_vs
            i64 = tl.cast(i, tl.int64)
            h64 = h_kv.to(tl.int64)
            d_ok = offs_d < HEAD_DIM
            k_new = tl.load(K_NEW + b64 * stride_knb + i64 * stride_kns + h64 * stride_knh
                            + offs_d * stride_knd, mask=d_ok)
            tl.store(k_dst + offs_d * stride_kd, k_new.to(K_head.dtype.element_ty), mask=d_ok)
            dv_ok = offs_dv < HEAD_DIM_V
            v_new = tl.load(V_NEW + b64 * stride_vnb + i64 * stride_vns + h64 * stride_vnh
                            + offs_dv * stride_vnd, mask=dv_ok)
            tl.store(v_dst + offs_dv * stride_vd, v_new.to(V_head.dtype.element_ty), mask=dv_ok)


@primed
def attn_decode(q, k_cache, v_cache, p, *, cache_seqlens, seqlen_new, cache_batch_idx,
                cache_leftpad, block_table, num_splits, arch=90, num_sms=132, config=None):
    """Launch split-KV attention (and the combine when ``num_splits > 1``) on validated inputs,
    for :class:`solattn.params.AttnParams` ``p`` (scale, mask band, softcap, ALiBi): the
    separate-launch path, after the new tokens were appended (see :func:`fused_decode` for the
    single launch).

    ``q (b, s_q, h, d)``; ``k_cache (b_cache, s_cache, h_kv, d)`` / ``v_cache (.., d_v)``, or
    paged ``(num_pages, page_size, h_kv, d)`` with ``block_table (b, max_pages)`` int32.
    ``cache_seqlens`` (b,) int32 or None (every sequence spans the whole cache) counts the keys
    before the ``seqlen_new`` tokens already written at positions ``cache_seqlens[b] + i``.
    ``num_splits`` 0 picks :func:`solattn.configs.decode_num_splits`.

    Returns ``out (b, s_q, h, d_v)`` in q's dtype and ``lse (b, h, s_q)`` float32.
    """
    key = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape,
           v_cache.stride(), q.dtype, k_cache.dtype, v_cache.dtype, p.launch_key,
           cache_seqlens is not None, cache_batch_idx is not None, cache_leftpad is not None,
           None if block_table is None else (block_table.shape, block_table.stride()),
           seqlen_new, num_splits, arch, num_sms, config)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _decode_plan(q, k_cache, v_cache, None, p,
                                            cache_seqlens is not None,
                                            cache_batch_idx is not None,
                                            cache_leftpad is not None, block_table, seqlen_new,
                                            num_splits, arch, num_sms, config))
    device = q.device
    out = torch.empty(plan.out_shape, dtype=q.dtype, device=device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=device)
    if plan.decode is None:  # no query row
        lse.fill_(float("-inf"))
        return out, lse
    if plan.combine is None:
        o_buf, l_buf = out, lse
    else:
        o_buf = torch.empty(plan.o_buf_shape, dtype=torch.float32, device=device)
        l_buf = torch.empty(plan.o_buf_shape[:-1], dtype=torch.float32, device=device)
    dummy = cache_seqlens if cache_seqlens is not None else q
    plan.decode(q, k_cache, v_cache, o_buf, l_buf, p.alibi_slopes if p.has_alibi else q,
                dummy, cache_batch_idx if cache_batch_idx is not None else dummy,
                cache_leftpad if cache_leftpad is not None else dummy,
                block_table if block_table is not None else dummy, q, q, q, q, dummy)
    if plan.combine is not None:
        plan.combine(o_buf, l_buf, out, lse)  # lse written through its (b, s_q, h) strides
    return out, lse


@dataclass(frozen=True)
class _DecodePlan:
    out_shape: tuple        # (b, s_q, h, d_v)
    lse_shape: tuple        # (b, h, s_q)
    o_buf_shape: tuple      # (splits, b, s_q, h, d_v) fp32 partials (l_buf: without d_v)
    decode: Launch | None   # None: no query row, nothing to launch
    combine: Launch | None  # None: one split (the decode kernel writes out and lse), or fused
    semaphores: int = 0     # fused combine: one arrival counter per (b, kv head, row block)


_PLANS = PlanCache()


def fused_covers(q, k_cache, k, rotary: bool, config=None) -> str:
    """Why :func:`fused_decode` cannot run this call ("" when it can): the one launch appends
    without rotary only (rotary k and q go through :mod:`solattn.kernels.triton.rotary`), and
    only when one program holds all the query rows of a kv head (``seqlen_q * group <=
    block_m``: programs of other row blocks would read the new keys unsynchronized)."""
    from solattn.configs import decode_block_m

    if q.numel() == 0:
        return "no query row"
    if k is None or k.shape[1] == 0:
        return ""
    if rotary:
        return "rotary embedding of the new keys (the separate append kernel rotates them)"
    rows = q.shape[1] * (q.shape[2] // k_cache.shape[2])
    block_m = config.block_m if config is not None else decode_block_m(rows)
    if rows > block_m:
        return (f"seqlen_q * group = {rows} query rows need several programs per kv head "
                f"(block_m {block_m}): the new keys are appended by a separate launch")
    return ""


def fused_decode_plan(q, k_cache, v_cache, k, v, p, *, has_seqlens, has_batch_idx, has_leftpad,
                      block_table, num_splits, arch=90, num_sms=132, config=None):
    """The :class:`FusedDecode` of a call that :func:`fused_covers` (cached per key: shapes,
    strides, dtypes, flags)."""
    key = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape,
           v_cache.stride(), q.dtype, k_cache.dtype, v_cache.dtype, p.launch_key,
           None if k is None else (k.shape, k.stride(), k.dtype, v.shape, v.stride()),
           has_seqlens, has_batch_idx,
           has_leftpad, None if block_table is None else (block_table.shape, block_table.stride()),
           num_splits, arch, num_sms, config)
    plan = _FUSED.get(key)
    if plan is None:
        plan = _FUSED.put(key, FusedDecode(_decode_plan(
            q, k_cache, v_cache, None if k is None else (k, v), p, has_seqlens, has_batch_idx,
            has_leftpad, block_table, 0 if k is None else k.shape[1], num_splits, arch, num_sms,
            config, fused=True)))
    return plan


_FUSED = PlanCache()


@primed
def fused_decode(q, k_cache, v_cache, k, v, p, *, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, num_splits, arch=90, num_sms=132, config=None, need_lse=True):
    """Append ``k``/``v`` (or None), attend and merge the splits in one launch; arguments as
    :func:`attn_decode` (the call must be one that :func:`fused_covers`). Returns ``(out, lse)``;
    ``lse`` is scratch space, overwritten by the next call, unless ``need_lse``."""
    plan = fused_decode_plan(q, k_cache, v_cache, k, v, p, has_seqlens=cache_seqlens is not None,
                             has_batch_idx=cache_batch_idx is not None,
                             has_leftpad=cache_leftpad is not None, block_table=block_table,
                             num_splits=num_splits, arch=arch, num_sms=num_sms, config=config)
    return plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, p.alibi_slopes if p.has_alibi else None, need_lse)


class _Workspace:
    """The fused launch's fp32 partials, its arrival counters (zero between launches: the last
    split of each (b, kv head, row block) resets its own) and an lse for calls that return none.
    """

    __slots__ = ("o_buf", "l_buf", "semaphores", "lse")

    def __init__(self, plan: _DecodePlan, device):
        f32 = torch.float32
        self.lse = torch.empty(plan.lse_shape, dtype=f32, device=device)
        if plan.semaphores:
            self.o_buf = torch.empty(plan.o_buf_shape, dtype=f32, device=device)
            self.l_buf = torch.empty(plan.o_buf_shape[:-1], dtype=f32, device=device)
            self.semaphores = torch.zeros(plan.semaphores, dtype=torch.int32, device=device)
        else:
            self.o_buf = self.l_buf = self.semaphores = None


# Workspaces larger than this are allocated per call instead of kept (a num_splits chosen by
# hand over a large batch can ask for hundreds of MB of partials).
_MAX_CACHED_WORKSPACE = 64 << 20

# > 0 inside per_call_workspaces().
_PER_CALL = [0]


@contextlib.contextmanager
def per_call_workspaces():
    """Calls inside the ``with`` block allocate their workspace instead of using a kept one:
    the torch.library ops (what compiled graphs call) run in it. torch.compile's CUDA graph
    trees run a graph's warm-up calls eagerly with the allocator routed to the graph's private
    pool, which must hold only tensors the graphs track: a workspace kept from such a call
    makes the trees raise ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs",
    H100, torch 2.11: a gpt-oss static-cache ``generate`` and a compiled
    ``flash_attn_with_kvcache`` step under ``mode="reduce-overhead"``), and the pool could hand
    its blocks out again. A workspace allocated per call lives in the graph like any other
    intermediate (its counters zeroed by a memset node)."""
    _PER_CALL[0] += 1
    try:
        yield
    finally:
        _PER_CALL[0] -= 1


def keeps_workspaces() -> bool:
    """Whether a launch may keep its workspace for later calls (not inside
    :func:`per_call_workspaces`)."""
    return not _PER_CALL[0]


class FusedDecode:
    """One call's single launch: new tokens appended by the splits that read them, split-KV
    attention, and the merge of the splits by the last split of each (b, kv head) to finish
    (:func:`decode_kernel` with ``APPEND`` / ``FUSE_COMBINE``).

    The workspace (partials, counters, scratch lse) is kept per (device, stream): launches on
    one stream run in order, so one workspace serves them all, and a CUDA graph captured on a
    stream keeps the addresses it was captured with. A workspace first needed while a stream is
    being captured is not kept (its zeroed counters exist only inside the graph); neither is one
    over ``_MAX_CACHED_WORKSPACE``, nor any inside :func:`per_call_workspaces`. An eager call
    allocates only ``out`` (and ``lse`` if asked for).
    """

    __slots__ = ("plan", "_workspaces", "_cacheable")

    def __init__(self, plan: _DecodePlan):
        self.plan = plan
        self._workspaces: dict = {}
        partial_bytes = 4 * math.prod(plan.o_buf_shape) if plan.semaphores else 0
        self._cacheable = partial_bytes <= _MAX_CACHED_WORKSPACE

    def _workspace(self, q) -> _Workspace:
        if _PER_CALL[0]:
            return _Workspace(self.plan, q.device)
        index = q.get_device()  # -1 on the CPU (the interpreter)
        key = (q.device, None) if index < 0 else \
            (index, torch._C._cuda_getCurrentRawStream(index))
        ws = self._workspaces.get(key)
        if ws is None:
            ws = _Workspace(self.plan, q.device)
            if self._cacheable and not (index >= 0 and torch.cuda.is_current_stream_capturing()):
                self._workspaces[key] = ws
        return ws

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, alibi_slopes, need_lse=True):
        plan = self.plan
        ws = self._workspace(q)
        # (new_empty: q's device and dtype without torch.empty's keyword parsing, ~0.4 us)
        out = q.new_empty(plan.out_shape)
        lse = q.new_empty(plan.lse_shape, dtype=torch.float32) if need_lse else ws.lse
        dummy = cache_seqlens if cache_seqlens is not None else q
        if plan.semaphores:
            o_buf, l_buf, final_o, final_l, sems = ws.o_buf, ws.l_buf, out, lse, ws.semaphores
        else:
            o_buf, l_buf, final_o, final_l, sems = out, lse, q, q, dummy
        plan.decode(q, k_cache, v_cache, o_buf, l_buf,
                    alibi_slopes if alibi_slopes is not None else q, dummy,
                    cache_batch_idx if cache_batch_idx is not None else dummy,
                    cache_leftpad if cache_leftpad is not None else dummy,
                    block_table if block_table is not None else dummy,
                    k if k is not None else q, v if v is not None else q, final_o, final_l, sems)
        return out, lse


def _decode_plan(q, k_cache, v_cache, kv_new, p, has_seqlens, has_batch_idx, has_leftpad,
                 block_table, seqlen_new, num_splits, arch, num_sms, config,
                 fused=False) -> _DecodePlan:
    """Everything :func:`attn_decode` (``fused``: :class:`FusedDecode`) launches with but the
    tensors (unused pointer arguments, whose constexpr flag is off, get ``cache_seqlens`` or
    ``q``). With ``fused``, ``kv_new`` is the new ``(k, v)`` (or None): the kernel appends them
    itself."""
    from solattn.configs import decode_config, decode_num_splits, padded_head_dim

    batch, seqlen_q, h, d = q.shape
    h_kv, dv = k_cache.shape[2], v_cache.shape[3]
    group = p.group_size
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 1
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    out_shape, lse_shape = (batch, seqlen_q, h, dv), (batch, h, seqlen_q)
    if batch * seqlen_q * h * dv == 0:
        return _DecodePlan(out_shape, lse_shape, (), None, None)

    cfg = config or decode_config(arch, d, dv, seqlen_q * group)
    m_blocks = triton.cdiv(seqlen_q * group, cfg.block_m)
    if num_splits <= 0:
        num_splits = decode_num_splits(batch * h_kv * m_blocks, capacity, cfg.block_n, num_sms)
    num_splits = max(1, min(num_splits, triton.cdiv(max(capacity, 1), cfg.block_n)))

    if paged:
        tile_pages = page_size >= cfg.block_n and not has_leftpad
        page_mode = PAGED_TILE if tile_pages else PAGED_ROW
    else:
        page_mode = CONTIGUOUS
    out_strides, lse_strides = contiguous_strides(out_shape), contiguous_strides(lse_shape)
    lse_bsh = (lse_strides[0], lse_strides[2], lse_strides[1])  # (b, s_q, h) order
    o_buf_shape = (num_splits, batch, seqlen_q, h, dv)
    append = fused and kv_new is not None and seqlen_new > 0
    new_strides = (*kv_new[0].stride(), *kv_new[1].stride()) if append else (0,) * 8
    merged_strides = (0,) * 7
    combine, semaphores = None, 0
    if num_splits == 1:
        o_strides, l_strides = (0, *out_strides), (0, *lse_bsh)
    else:
        o_strides = contiguous_strides(o_buf_shape)
        l_strides = contiguous_strides(o_buf_shape[:-1])
        if fused:
            merged_strides = (*out_strides, *lse_bsh)
            semaphores = batch * m_blocks * h_kv
        else:
            combine = combine_launch(o_buf_shape, o_strides, l_strides, out_strides, lse_bsh,
                                     arch)
    decode = Launch(
        decode_kernel, (num_splits, m_blocks * h_kv, batch),
        (*q.stride(), *k_cache.stride(), *v_cache.stride(), *o_strides, *l_strides,
         *p.alibi_strides, block_table.stride(0) if paged else 0, *new_strides, *merged_strides,
         seqlen_q, capacity, seqlen_new, group, num_splits,
         p.qk_scale, p.softcap_prescale, p.left, p.right, k_cache.shape[0]),
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=padded_head_dim(d), BLOCK_DV=padded_head_dim(dv),
        PAGE_SIZE=page_size, PAGE_MODE=page_mode,
        HAS_SEQLENS=has_seqlens, HAS_BATCH_IDX=has_batch_idx,
        HAS_LEFTPAD=has_leftpad, HAS_LOWER=p.has_left, HAS_UPPER=p.has_right,
        HAS_SOFTCAP=p.has_softcap, HAS_ALIBI=p.has_alibi,
        APPEND=append, FUSE_COMBINE=semaphores > 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return _DecodePlan(out_shape, lse_shape, o_buf_shape, decode, combine, semaphores)


# Layouts `solattn aot` compiles at head dims 64/128 (data only: aot_calls.py replays them):
# name -> (constexpr flags, output pointer type: fp32 partials when split, else the output).
# The wide-query tile (block_m 64) compiles once, with every feature (the most registers).
# "-fused": the single launch of FusedDecode (append and merge of the splits in the kernel).
AOT_VARIANTS = {
    "contiguous": (dict(PAGE_MODE=CONTIGUOUS, PAGE_SIZE=1, HAS_SEQLENS=True), "*fp32"),
    "contiguous-fused": (dict(PAGE_MODE=CONTIGUOUS, PAGE_SIZE=1, HAS_SEQLENS=True, HAS_UPPER=True,
                              APPEND=True, FUSE_COMBINE=True), "*fp32"),
    "paged-tile-fused": (dict(PAGE_MODE=PAGED_TILE, PAGE_SIZE=256, HAS_SEQLENS=True,
                              APPEND=True, FUSE_COMBINE=True), "*fp32"),
    "paged-tile": (dict(PAGE_MODE=PAGED_TILE, PAGE_SIZE=256, HAS_SEQLENS=True), "*bf16"),
    "paged16-all": (dict(PAGE_MODE=PAGED_ROW, PAGE_SIZE=16, HAS_SEQLENS=True,
                         HAS_LEFTPAD=True, HAS_LOWER=True, HAS_UPPER=True, HAS_SOFTCAP=True,
                         HAS_ALIBI=True), "*fp32"),
}
AOT_WIDE_VARIANT = "paged16-all"


def decode_forward(q, k, v, p: AttnParams, return_lse: bool):
    """A :func:`solattn.flash_attn_func` call of few query rows (:func:`solattn.configs.
    small_q_decode`; at least one row and one key) on the decode kernels: ``k`` and ``v`` as
    full caches, nothing appended, the queries aligned to the last keys as flash_attn_func
    aligns them -> ``(out, lse)`` (``lse`` None unless ``return_lse``). The single launch of a
    :func:`solattn.flash_attn_with_kvcache` step without new tokens (the kernels ``solattn warmup
    --kvcache`` compiles)."""
    left, right = p.window
    dp = decode_params(q, k, p.alibi_slopes, p.scale, p.causal, left, right, p.softcap)
    out, lse = fused_decode(q, k, v, None, None, dp, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, num_splits=0,
                            arch=device_arch(q.device), num_sms=num_sms(q.device),
                            need_lse=return_lse)
    return out, (lse if return_lse else None)
