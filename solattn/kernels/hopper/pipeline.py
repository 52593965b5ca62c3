"""The pipeline vocabulary the Hopper (Gluon) forward and backward share: their mbarrier rings
and TMA loads on the device, and the host side of their TMA operands.

A ring of ``STAGES`` shared-memory slots carries one tile per use; each slot has a *ready*
barrier (the producer's TMA completes it) and an *empty* one (the consumers arrive when they are
done with the tile). Use ``it`` of the ring lands in slot ``it % STAGES`` in that slot's round
``it // STAGES`` (:func:`ring_slot`): consumers wait *ready* with the round's parity
(:func:`wait_ready`), the producer waits *empty* with the opposite parity (:func:`wait_empty`;
its first round, on freshly initialised barriers, passes at once), fills the slot with
:func:`ring_load` / :func:`ring_load2` on its *ready* barrier, and the consumers hand it back
with :func:`release`. The forward's Q tiles are a ring of this kind with one slot per consumer
warpgroup, each used once a tile: slot ``WG``, parity ``tile_it & 1``. :func:`expect_load2`
loads outside a ring (the backward's K and V, once per CTA).

The waits take ``(slot, parity)`` rather than ``it``, so a caller computes the slot arithmetic
where it did before (the forward's consumer computes both of a step's slots first: moving it
next to the waits reorders the SASS). The helpers other than :func:`ring_slot` are builtins,
like :func:`solattn.kernels.hopper.compat.reinterpret`: they emit their barrier and TMA
operations in place, where a ``@gluon.jit`` helper (a call, inlined later) perturbed the
instruction order and register assignment of some Hopper kernels. Each helper takes the arrays
it uses (a kernel's ``@bundle`` of its shared memory holds them).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from solattn.kernels.hopper.compat import reinterpret, tma_load
from solattn.launch import DescriptorCache


@gluon.jit
def ring_slot(it, STAGES: gl.constexpr):
    """``(slot, parity)`` of the ``it``-th use of a ``STAGES``-deep ring."""
    return it % STAGES, (it // STAGES) & 1


@gluon.jit
def step_view(tile, it):
    """``tile`` (``[ROWS, COLS]`` in shared memory, the same bytes on every use ``it`` of a
    loop: the backward's K and V, the forward's Q over its key loop) as use ``it``'s wgmma
    operand. With 256 columns it is reached through a base that changes with ``it`` as far as
    the compiler can tell (``it >> 31``, 0 for every use index, computed by inline assembly
    neither LLVM nor ptxas folds); otherwise it is ``tile`` itself.

    A wgmma takes one 64-bit shared-memory descriptor per 16-wide k-step of a shared-memory
    operand. For a loop-invariant tile triton 3.9's LLVM hoists them all out of the loop: at
    d=256 the backward's ``S^T = K Q^T`` and ``dP^T = V dO^T`` held 16 of K's and 16 of V's
    (64 registers) across its step loop, which ptxas spilled in every build (40-77 local
    accesses in the loops, `solattn aot --arch 90`, 2026-11-29). Rebuilt on each use from a
    uniform base they cost a few uniform adds, and the loops compile spill-free (ALiBi's but
    for a few accesses). Measured, the d=256 backward ran +16% with triton 3.6 as well (H200,
    B2 H8 L4096: 322 -> 375 TFLOP/s, causal 291 -> 339), whose loop then moves 7 instead of
    29 descriptors from registers (``R2UR``). At 64 and 128 columns it returns ``tile``: the
    backward's SASS there is byte-identical with and without it (triton 3.6 and 3.9)."""
    ROWS: gl.constexpr = tile.shape[0]
    COLS: gl.constexpr = tile.shape[1]
    if COLS == 256:
        zero = gl.inline_asm_elementwise("shr.u32 $0, $1, 31;", "=r,r", [it], dtype=gl.int32,
                                         is_pure=True, pack=1)
        tile = reinterpret(tile, tile.dtype, [1, ROWS, COLS], tile.layout).index(zero)
    return tile


@builtin
def wait_ready(ready, slot, parity, _semantic=None):
    """Consumer side: wait until ``slot``'s tile of the round with this parity has landed
    (``(slot, parity)`` from :func:`ring_slot`)."""
    mbarrier.wait(ready.index(slot, _semantic=_semantic), parity, _semantic=_semantic)


@builtin
def wait_empty(empty, slot, parity, _semantic=None):
    """Producer side: wait until every consumer released ``slot``'s tile of the previous round
    (the opposite parity: the first round passes at once on a fresh barrier)."""
    mbarrier.wait(empty.index(slot, _semantic=_semantic), parity.__xor__(1, _semantic=_semantic),
                  _semantic=_semantic)


@builtin
def release(empty, slot, _semantic=None):
    """Consumer side: this warpgroup is done with ``slot``'s tile (one arrival)."""
    mbarrier.arrive(empty.index(slot, _semantic=_semantic), count=1, _semantic=_semantic)


@builtin
def ring_load(desc, coord, smem, ready, slot, _semantic=None):
    """Producer side: TMA one ``desc`` tile at ``coord`` into ring slot ``slot`` of ``smem``;
    ``ready[slot]`` completes once it landed."""
    mbarrier.expect(ready.index(slot, _semantic=_semantic), desc.block_type.nbytes,
                    _semantic=_semantic)
    tma_load(desc, coord, ready.index(slot, _semantic=_semantic),
             smem.index(slot, _semantic=_semantic), _semantic=_semantic)


@builtin
def ring_load2(desc_a, coord_a, smem_a, desc_b, coord_b, smem_b, ready, slot, _semantic=None):
    """:func:`ring_load` of two tiles into the same slot of two buffers, on one barrier (it
    completes once both landed)."""
    mbarrier.expect(ready.index(slot, _semantic=_semantic),
                    desc_a.block_type.nbytes + desc_b.block_type.nbytes, _semantic=_semantic)
    tma_load(desc_a, coord_a, ready.index(slot, _semantic=_semantic),
             smem_a.index(slot, _semantic=_semantic), _semantic=_semantic)
    tma_load(desc_b, coord_b, ready.index(slot, _semantic=_semantic),
             smem_b.index(slot, _semantic=_semantic), _semantic=_semantic)


@builtin
def expect_load2(desc_a, coord_a, smem_a, desc_b, coord_b, smem_b, bar, _semantic=None):
    """TMA two tiles (outside any ring: the backward's K and V, loaded once) on one barrier
    ``bar``, which completes once both landed."""
    mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes,
                    _semantic=_semantic)
    tma_load(desc_a, coord_a, bar, smem_a, _semantic=_semantic)
    tma_load(desc_b, coord_b, bar, smem_b, _semantic=_semantic)


@functools.lru_cache(maxsize=None)
def smem_layout(dtype: torch.dtype):
    """128-byte-swizzled layout of a rank-4 ``[1, 1, rows, d]`` fp16/bf16 tile (d * 2 bytes >=
    128), the operand layout of every Q/K/V/O/dO tile."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)


def descriptors(shape, strides, dtype, rows: int, cols: int) -> DescriptorCache:
    """Rank-4 descriptors over the ``(b, h, s, d)`` view of ``(b, s, h, d)`` tensors of this
    shape and strides, ``[1, 1, rows, cols]`` tiles (``cols >= d``: the columns past ``d`` read
    0 and are not stored), by base address."""
    b, s, h, d = shape
    sb, ss, sh, _ = strides
    layout = smem_layout(dtype)
    return DescriptorCache(lambda base: TensorDescriptor(
        base, [b, h, s, d], [sb, sh, ss, 1], [1, 1, rows, cols], layout))


def unsupported_operands(q: torch.Tensor, v: torch.Tensor, head_dims: tuple,
                         same_dims: bool = True) -> str:
    """Why a Hopper kernel cannot take these operands ("" when it can): fp16/bf16 (the 16-bit
    :func:`smem_layout`), ``d_v == d`` (unless ``same_dims`` is False), and a head dim the
    kernel has a config for."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (fp16/bf16 only)"
    if same_dims and head_dim != head_dim_v:
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


def kept_decision(decisions, operands: tuple, fields: tuple, covers, plan_of, who: str):
    """A Hopper kernel's ``prepare``: ``((*operands, plan), "covered")`` where it runs the call
    (operands made TMA-readable), else ``(None, why not)``. ``covers()`` says whether it
    applies; ``plan_of(*operands)`` gives the plan, whose ``spill_bytes`` > 0 refuses the call
    (a mod pushed ``who`` past its registers). The outcome is kept in ``decisions`` (a
    :class:`solattn.launch.PlanCache`) by everything it reads: the operands' shapes, strides
    and alignment, the first one's dtype and device, and ``fields`` (what ``covers`` and the
    plan read of the call's parameters). Operands TMA cannot read where they are are copied
    each call, and such calls are decided anew each time."""
    aligned = not functools.reduce(lambda a, t: a | t.data_ptr(), operands, 0) & 15
    key = (*(x for t in operands for x in (t.shape, t.stride())), operands[0].dtype,
           operands[0].device, aligned, *fields)
    decided = decisions.get(key)
    if decided is None:
        ok, why = covers()
        if not ok:
            decided = decisions.put(key, (None, why))
    if decided is not None:
        plan, why = decided
        return ((*operands, plan) if plan is not None else None), why
    if not aligned or not all(tma_strides_ok(t) for t in operands):
        operands = tuple(tma_ready(t) for t in operands)
        key = None  # copies this call: not kept
    plan, why = plan_of(*operands), "covered"
    if plan.spill_bytes:
        plan, why = None, (f"the mods spill {plan.spill_bytes} bytes of registers in the Hopper "
                           f"{who}'s consumers")
    if key is not None:
        decisions.put(key, (plan, why))
    return ((*operands, plan) if plan is not None else None), why
