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
instruction order and register assignment of some Hopper kernels. Gluon in Triton 3.6 exports
no ``@aggregate`` to bundle a ring's arrays; each helper takes the arrays it uses.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from solattn.backends import num_sms
from solattn.kernels.hopper.compat import tma_load
from solattn.kernels.triton.decode import keeps_workspaces


@gluon.jit
def ring_slot(it, STAGES: gl.constexpr):
    """``(slot, parity)`` of the ``it``-th use of a ``STAGES``-deep ring."""
    return it % STAGES, (it // STAGES) & 1


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


# ---------------------------------------------------------------------------------------------
# Tile schedules of persistent grids (the forward's and the flex backward's partitions all walk
# the same tiles: each computes the next from the slot it is at, or reads the one its producer
# claimed)
# ---------------------------------------------------------------------------------------------

@gluon.jit
def dealt(tile, num_tiles, grid_size):
    """The tile a persistent CTA runs at its ``tile``-th slot of the round robin, dealt in
    snake order: round ``r`` of ``grid_size`` tiles goes to CTAs 0, 1, ... when ``r`` is even
    and back from the last CTA when odd, so that no CTA gets the same place of every round
    (where tiles alternate in length, e.g. a causal sequence's m-blocks, it would get the long
    or the short one every time). With one CTA per tile (``grid_size == num_tiles``) the
    identity."""
    r = tile // grid_size
    c = tile - r * grid_size
    if (r & 1) == 1:
        c = gl.minimum(grid_size, num_tiles - r * grid_size) - 1 - c
    return r * grid_size + c


# Dynamic tile scheduling (HopperFwdConfig.dynamic, the flex backward's DYNAMIC): SCHED is the
# launch's int32 workspace, [0] the tile counter, [1] the CTAs retired, then two slots per CTA
# through which its producer hands the claimed tile indices to the CTA's other partitions (each
# reader arrives once on `tid_empty`: its count is the number of reading partitions). Counters
# start at 0 and the last CTA to retire puts them back to 0, so launches on one stream (forward
# and backward kernels alike) share a workspace.
SCHED_SLOTS = gl.constexpr(2)


@gluon.jit
def lane0():
    """One warp's lanes as a ``[32]`` tensor -> ``(lane index, lane == 0)``."""
    lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    return lanes, lanes == 0


@gluon.jit
def claim_next(SCHED, tid_ready, tid_empty, j, grid_size):
    """Producer (one warp), at its ``j``-th tile: claim the CTA's next tile (``grid_size`` + a
    ticket of the launch's counter: every CTA's first tile is its program id) and publish it
    in the CTA's slot ``j % 2`` for the consumers (:func:`next_tile`) -> its index. The claim
    comes before the current tile's loads, so its latency hides behind them."""
    lanes, first = lane0()
    zero = lanes * 0
    ticket = gl.atomic_add(SCHED + zero, zero + 1, mask=first, sem="relaxed")
    nxt = gl.max(gl.where(first, ticket, 0), axis=0) + grid_size
    slot = j % SCHED_SLOTS
    mbarrier.wait(tid_empty.index(slot), ((j // SCHED_SLOTS) & 1) ^ 1)
    # (every lane stores the value: whichever thread arrives has its store ordered before)
    gl.store(SCHED + (2 + gl.program_id(0) * SCHED_SLOTS + slot) + zero, zero + nxt)
    mbarrier.arrive(tid_ready.index(slot), count=1)
    return nxt


@gluon.jit
def next_tile(SCHED, tid_ready, tid_empty, j):
    """Consumer, after its ``j``-th tile: the index of its next one, from the producer's slot
    (a volatile load: the producer's store is made visible by the barrier, not through L1)."""
    slot = j % SCHED_SLOTS
    mbarrier.wait(tid_ready.index(slot), (j // SCHED_SLOTS) & 1)
    nxt = gl.load(SCHED + (2 + gl.program_id(0) * SCHED_SLOTS + slot), volatile=True)
    mbarrier.arrive(tid_empty.index(slot), count=1)
    return nxt


@gluon.jit
def retire(SCHED, grid_size):
    """Producer, after its last claim: count the CTA retired; the last of the grid resets both
    counters for the next launch (every claim is made by then)."""
    lanes, first = lane0()
    zero = lanes * 0
    retired = gl.atomic_add(SCHED + 1 + zero, zero + 1, mask=first, sem="acq_rel")
    if gl.max(gl.where(first, retired, 0), axis=0) == grid_size - 1:
        gl.store(SCHED + lanes, zero, mask=lanes < 2)




_SCHED_WORKSPACES: dict = {}


def sched_workspace(q) -> torch.Tensor:
    """The int32 ``SCHED`` workspace of a dynamic launch (:data:`SCHED_SLOTS`' comment) on
    ``q``'s device and its current stream: zeroed once and kept per (device, stream), since
    each launch leaves its counters at 0 and launches on one stream run in order (a CUDA graph
    captured with a kept one replays with it, in its stream's order). Not kept when first
    needed while the stream is being captured (its zeroing would exist only in the graph), nor
    inside :func:`~solattn.kernels.triton.decode.per_call_workspaces` (torch.compile's graphs:
    as the fused decode's workspace), where each call gets its own."""
    n = 2 + SCHED_SLOTS.value * num_sms(q.device)
    index = q.get_device()  # -1 on the CPU (solattn warmup's replays)
    if index < 0 or not keeps_workspaces():
        return torch.zeros(n, dtype=torch.int32, device=q.device)
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    ws = _SCHED_WORKSPACES.get(key)
    if ws is None:
        ws = torch.zeros(n, dtype=torch.int32, device=q.device)
        if not torch.cuda.is_current_stream_capturing():
            _SCHED_WORKSPACES[key] = ws
    return ws


@functools.lru_cache(maxsize=None)
def smem_layout(dtype: torch.dtype):
    """128-byte-swizzled layout of a rank-4 ``[1, 1, rows, d]`` fp16/bf16 tile (d * 2 bytes >=
    128), the operand layout of every Q/K/V/O/dO tile."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)


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
