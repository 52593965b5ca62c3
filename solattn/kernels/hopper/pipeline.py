"""Pieces the Hopper (Gluon) forward and backward share: the slot/parity arithmetic of their
mbarrier rings on the device, and the host side of their TMA operands.

A ring of ``STAGES`` shared-memory slots carries one tile per use; each slot has a *ready*
barrier (the producer's TMA completes it) and an *empty* one (the consumers arrive when they are
done with the tile). Use ``it`` of the ring lands in slot ``it % STAGES`` in that slot's round
``it // STAGES``: consumers wait *ready* with the round's parity, the producer waits *empty*
with the opposite parity (so its first round, on freshly initialised barriers, passes at once).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def ring_slot(it, STAGES: gl.constexpr):
    """``(slot, parity)`` of the ``it``-th use of a ``STAGES``-deep ring."""
    return it % STAGES, (it // STAGES) & 1


@functools.lru_cache(maxsize=None)
def smem_layout(dtype: torch.dtype):
    """128-byte-swizzled layout of a rank-4 ``[1, 1, rows, d]`` fp16/bf16 tile (d * 2 bytes >=
    128), the operand layout of every Q/K/V/O/dO tile."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)


def unsupported_operands(q: torch.Tensor, v: torch.Tensor, head_dims: tuple) -> str:
    """Why a Hopper kernel cannot take these operands ("" when it can): fp16/bf16 (the 16-bit
    :func:`smem_layout`), ``d_v == d``, and a head dim the kernel has a config for."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (fp16/bf16 only)"
    if head_dim != head_dim_v:
        return f"head_dim {head_dim} != head_dim_v {head_dim_v}"
    if head_dim not in head_dims:
        return f"head_dim {head_dim} not in {head_dims}"
    return ""


def tma_strides_ok(t: torch.Tensor) -> bool:
    """TMA needs a contiguous last dim and 16-byte aligned strides (and base: checked per call)."""
    size = t.element_size()
    return t.stride(-1) == 1 and all((s * size) % 16 == 0 for s in t.stride()[:-1])


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where TMA cannot read it (strides, or an unaligned base: a
    contiguous view at an odd offset is copied too, where ``.contiguous()`` would return it)."""
    if tma_strides_ok(t) and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)
