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
