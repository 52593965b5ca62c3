"""Keys addressed through a KV cache: contiguous per sequence, or paged through a block table.

Shared by the split-KV decode kernel (:mod:`solattn.kernels.triton.decode`) and the portable
forward's paged varlen path (:mod:`solattn.kernels.triton.forward`): both walk *logical* key
indices ``j`` in ``[0, seqlen_k)`` of one sequence, key ``j`` sitting at cache position
``p = leftpad + j`` (``leftpad`` = 0 but for the decode kernel's ``cache_leftpad``):

* ``CONTIGUOUS``: row ``p`` of the sequence's cache rows;
* ``PAGED_TILE``: row ``p % PAGE_SIZE`` of page ``block_table[b, p // PAGE_SIZE]`` when a page
  holds whole key tiles (``PAGE_SIZE`` a multiple of ``BLOCK_N``, tiles start at multiples of
  ``BLOCK_N``): one page number per tile;
* ``PAGED_ROW``: the same address per key row, for any ``PAGE_SIZE >= 1`` (each row is still
  ``d`` contiguous elements: 16-byte loads either way).

Positions past ``seqlen_k`` are never loaded, their page numbers neither: block-table entries
past a sequence's keys may hold anything. The callers bound ``seqlen_k`` (and ``leftpad``) so
that positions stay inside a block-table row, and every page number read is clamped into
``[0, num_pages)``: an invalid entry gives a wrong page, never an address outside the pool.
"""

from __future__ import annotations

import triton
import triton.language as tl

from solattn.kernels.common import online_softmax_step

# PAGE_MODE values (constexpr): how a key position becomes an address.
CONTIGUOUS, PAGED_TILE, PAGED_ROW = 0, 1, 2


@triton.jit
def page_of(BT_ROW, pos, num_pages, PAGE_SIZE: tl.constexpr, mask=None):
    """The page (int64) holding cache position ``pos`` of a block-table row, clamped into
    ``[0, num_pages)`` (``mask``: which lookups to make; the others give page 0)."""
    if mask is None:
        page = tl.load(BT_ROW + pos // PAGE_SIZE)
    else:
        page = tl.load(BT_ROW + pos // PAGE_SIZE, mask=mask, other=0)
    return tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)


@triton.jit
def tile_pages(pos0, offs_n, key_ok, BT_ROW, num_pages, PAGE_SIZE: tl.constexpr,
               PAGE_MODE: tl.constexpr):
    """``(page, row)`` of cache positions ``pos0 + offs_n``: page numbers (int64, a scalar when
    the tile lies in one page, 0 for a contiguous cache) and the row inside the page/sequence.
    ``key_ok`` guards the page-number loads (a scalar for PAGE_MODE 1, per row for 2)."""
    if PAGE_MODE == 0:
        return 0, (pos0 + offs_n).to(tl.int64)
    elif PAGE_MODE == 1:
        # PAGE_SIZE a multiple of BLOCK_N, tiles starting at multiples of BLOCK_N: the
        # whole tile lies in one page.
        page = page_of(BT_ROW, pos0, num_pages, PAGE_SIZE, key_ok)
        return page, (pos0 % PAGE_SIZE + offs_n).to(tl.int64)
    else:
        pos = pos0 + offs_n
        page = page_of(BT_ROW, pos, num_pages, PAGE_SIZE, key_ok)
        return page, (pos % PAGE_SIZE).to(tl.int64)


@triton.jit
def cache_block(acc, l_i, m_i, q, K_head, V_head, page, row, start_n, q_rows, offs_n,
                offs_d, offs_dv, stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
                seqlen_k, off, lower, upper, qk_scale, softcap_prescale, slopes,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
                HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """One online-softmax step over logical keys ``[start_n, start_n + BLOCK_N)``, stored at
    ``(page, row)`` of the cache (see :func:`tile_pages`)."""
    cols = start_n + offs_n
    k_ptrs = K_head + (page * stride_kp + row * stride_ks)[:, None] + offs_d[None, :] * stride_kd
    v_ptrs = V_head + (page * stride_vp + row * stride_vs)[:, None] + offs_dv[None, :] * stride_vd
    return online_softmax_step(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, cols < seqlen_k, q_rows, cols, offs_d, offs_dv,
        seqlen_k, off, lower, upper, qk_scale, softcap_prescale, slopes,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP,
        HAS_ALIBI)


@triton.jit
def cache_range(acc, l_i, m_i, q, K_head, V_head, BT_ROW, num_pages, lo, hi, leftpad, q_rows,
                offs_n, offs_d, offs_dv, stride_kp, stride_ks, stride_kd, stride_vp, stride_vs,
                stride_vd, seqlen_k, off, lower, upper, qk_scale, softcap_prescale, slopes,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                PAGE_SIZE: tl.constexpr, PAGE_MODE: tl.constexpr, MASKED: tl.constexpr,
                HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Online-softmax steps over logical keys ``[lo, hi)`` (``lo`` a multiple of ``BLOCK_N``)
    of the sequence whose cache rows start at ``K_head`` / ``V_head`` (contiguous; the pool of
    ``num_pages`` pages with ``PAGE_MODE`` 1 or 2, looked up in the sequence's block-table row
    ``BT_ROW``).
    ``stride_kp`` / ``stride_vp`` step pages (unused for a contiguous cache); ``slopes`` is the
    ALiBi slope in log2 units, per row or a scalar."""
    if PAGE_MODE == 0:
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            row = (leftpad + start_n + offs_n).to(tl.int64)
            acc, l_i, m_i = cache_block(
                acc, l_i, m_i, q, K_head, V_head, 0, row, start_n, q_rows, offs_n, offs_d,
                offs_dv, stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
                seqlen_k, off, lower, upper, qk_scale, softcap_prescale, slopes,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED,
                HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)
    else:
        # Page numbers are fetched one tile ahead and carried: the K/V loads of a step depend on
        # no load of the same step, so the software pipeliner keeps num_stages - 1 tiles of
        # K/V in flight (with the page lookup inside the step it kept only one).
        # Guards: keys past seqlen_k have no page. Keys in [hi, seqlen_k) do (a masked tail
        # tile reads them with probability 0: they must be real cache rows, never NaN padding).
        if PAGE_MODE == 1:
            ok = lo < seqlen_k
        else:
            ok = (lo + offs_n) < seqlen_k
        page, row = tile_pages(leftpad + lo, offs_n, ok, BT_ROW, num_pages, PAGE_SIZE,
                               PAGE_MODE)
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            nxt = start_n + BLOCK_N
            if PAGE_MODE == 1:
                ok = nxt < seqlen_k
            else:
                ok = (nxt + offs_n) < seqlen_k
            page_n, row_n = tile_pages(leftpad + nxt, offs_n, ok, BT_ROW, num_pages, PAGE_SIZE,
                                       PAGE_MODE)
            acc, l_i, m_i = cache_block(
                acc, l_i, m_i, q, K_head, V_head, page, row, start_n, q_rows, offs_n, offs_d,
                offs_dv, stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
                seqlen_k, off, lower, upper, qk_scale, softcap_prescale, slopes,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED,
                HAS_LOWER, HAS_UPPER, HAS_SOFTCAP, HAS_ALIBI)
            page, row = page_n, row_n
    return acc, l_i, m_i
