"""The backward of a paged ``flash_attn_varlen_func`` call: gather, varlen backward, scatter-add.

The forward reads pages in place (:mod:`solattn.kernels.triton.paging`). Its backward is rare
(serving does not train; training does not page), so it reuses the contiguous varlen backward
instead of a paged copy of it:

1. gather: every sequence's ``max_pages_per_seq`` block-table pages, in order, become
   ``page_size * max_pages_per_seq`` contiguous key rows of that sequence (a ``(batch * cap,
   h_kv, d)`` copy of K and V, ``cap = max_pages_per_seq * page_size``);
2. the varlen backward runs on them with ``cu_seqlens_k = [0, cap, 2 cap, ...]`` and
   ``seqused_k`` = each sequence's key count, so keys past it get zero gradients;
3. scatter-add: each gathered row's dK/dV is added into the row of the page it came from
   (``index_put_(accumulate=True)``): a page shared by sequences (a cached prefix) sums their
   gradients.

Nothing is read back to the host (no synchronization): the copy covers the whole block table,
whose entries past a sequence's keys (padding, possibly out of range) are clamped into
``[0, num_pages)`` -- their rows have zero gradient and add nothing. Extra memory: two gathered
copies and their gradients, ``4 * batch * cap * h_kv * d`` elements.
"""

from __future__ import annotations

import dataclasses

import torch

from solattn.params import AttnParams


def page_rows(block_table: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """``(batch * cap,)`` int64: the row of the flattened ``(num_pages * page_size, ...)`` pool
    that holds key position ``j`` of sequence ``b``, at index ``b * cap + j``."""
    pages = block_table.clamp(0, num_pages - 1).to(torch.int64)
    offs = torch.arange(page_size, device=block_table.device, dtype=torch.int64)
    return (pages[:, :, None] * page_size + offs).reshape(-1)


def paged_backward(dout, q, k, v, out, lse, p: AttnParams, *, dlse, backward):
    """Gradients ``(dq, dk, dv)`` of a paged varlen forward; ``dk``/``dv`` have the page
    pools' shapes. ``backward`` is :func:`solattn.core.attn_backward` (contiguous keys)."""
    num_pages, page_size = k.shape[0], k.shape[1]
    batch, max_pages = p.block_table.shape
    cap = max_pages * page_size
    rows = page_rows(p.block_table, num_pages, page_size)
    k_rows = k.reshape(num_pages * page_size, *k.shape[2:])
    v_rows = v.reshape(num_pages * page_size, *v.shape[2:])
    k_seq, v_seq = k_rows.index_select(0, rows), v_rows.index_select(0, rows)
    if p.seqused_k is not None:
        used = p.seqused_k
    else:
        used = (p.cu_seqlens_k[1:] - p.cu_seqlens_k[:-1]).contiguous()
    cu_k = torch.arange(0, (batch + 1) * cap, cap, dtype=torch.int32, device=q.device)
    seq_p = dataclasses.replace(p, block_table=None, cu_seqlens_k=cu_k, seqused_k=used,
                                max_seqlen_k=cap)
    dq, dk_seq, dv_seq = backward(dout, q, k_seq, v_seq, out, lse, seq_p, dlse=dlse)
    dk = k.new_zeros(k_rows.shape).index_put_((rows,), dk_seq, accumulate=True)
    dv = v.new_zeros(v_rows.shape).index_put_((rows,), dv_seq, accumulate=True)
    return dq, dk.view(k.shape), dv.view(v.shape)
