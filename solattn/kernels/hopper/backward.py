"""Hopper (sm_90a) FlashAttention backward in Gluon: TMA, an mbarrier ring, warp-specialized wgmma.

One CTA owns ``BLOCK_N = 128`` keys (64 at d=256: :func:`acc_layout`) of one (batch, KV head)
and walks every query block of every query head of the GQA group (so dK/dV sum over the group in
registers); dK and dV stay in registers for the CTA's whole life, dQ is summed in fp32 with
atomics (FlashAttention-3's split). Small causal grids split a group over several CTAs per key
block (``kv_splits``: fp32 partial dK/dV, summed by :func:`bwd_dkdv_reduce_kernel`). Three warp
roles (``warp_specialize``)::

    producer (1 warp)                consumers (8 warps = 2 warpgroups, 64 keys each)
    TMA K, V once -> kv_ready        for each step t (query head g, query block i):
    for each step t:                   [S^T = K Q_i^T, dP^T = V dO_i^T issued at the end of t-1]
      wait qdo_empty[s]                wait S^T, dP^T
      TMA Q_i, -lse/scale -> q_ready   P^T = exp2(S^T * c); dS^T = P^T * dP^T
      TMA dO_i, -Delta -> do_ready     dV += P^T dO_i                 (P^T from registers)
                                       dS^T -> smem; bar.sync
    dQ writer (1 warp; 2: determ.)     dK += dS^T Q_i; dQ_i = dS K    (dS^T from smem)
    for each step t:                   issue step t+1's S^T, dP^T (LOOKAHEAD 2, 1) ...
      wait dq_ready                    wait dV, dK, dQ_i; arrive qdo_empty[s]
      red.global.add.v4 dQ_i rows      dQ_i * scale -> smem; arrive dq_ready (DQ_WRITER)
      arrive dq_empty                  ... or issue them now (LOOKAHEAD 0); wait S^T, dP^T
                                     dK * scale, dV -> global

``s = t % STAGES``. The consumer warpgroups compute ``S^T`` and ``dP^T`` (keys as rows), so
``P^T`` is already the ``A`` operand of ``dV += P^T dO`` (a free layout conversion, as the
forward's ``P``). ``dS^T`` goes through shared memory: the ``A`` operand of ``dK += dS^T Q``
(d=64: from registers instead, ``dk_from_regs``) and, as a transposed view, of ``dQ = dS K``,
whose rows (128-query steps: d=64 without softcap or ALiBi) or columns (64-query steps) the two
warpgroups split (:func:`acc_layout`). The dQ staging rows are padded by 32 bytes at d=128
(``dq_pad``) and swizzled in 32-byte chunks over 4 rows at d=64 (``dq_vec``, ``writer_rows``):
conflict-free accumulator stores.

The accumulators of ``S^T`` and ``dP^T`` start at the per-query terms (``-lse / scale`` and
``-Delta``), so ``P^T = exp2(acc * scale * log2 e)`` and ``dS^T = P^T * acc`` need no column
vector live across the waits. Masks fold into the same initial value: keys past the sequence
(zero-filled TMA rows) and, in the edge blocks of a band (the causal diagonal), masked-out
pairs start at ``-inf``, so ``P = 0``; query rows past the sequence and rows that saw no key
(``lse = -inf``) get ``-inf`` from the preprocess kernel. Query blocks outside the band are never
loaded (:func:`solattn.masking.block_range` on the transposed band).

Barrier phases as in :mod:`solattn.kernels.hopper.forward`: the ``u``-th use of ring slot
``s`` waits ``*_ready[s]`` with parity ``u & 1`` and ``qdo_empty[s]`` with ``(u & 1) ^ 1`` (a
fresh barrier has completed the phase of parity 1); ``dq_ready``/``dq_empty`` alternate per step
the same way; ``kv_ready`` completes once. A Triton preprocess kernel writes each query row's
``-lse / scale`` and ``-Delta`` (``Delta = rowsum(dO * O) - dLSE``) into flat buffers padded to
whole query blocks, which the producer loads by TMA. docs/hopper-backward.md has the register
and shared-memory budget and the measured variants.

Deterministic mode (``DETERMINISTIC``, ``deterministic=True``): every element of dQ receives one
addition per key block that touches its query block, and the writer warps add them in
increasing key-block order, so the fp32 sums (and the bf16/fp16 dQ) are bitwise the same on
every run. A zeroed int32 turn counter per (query head, query block) sits after the dQ
accumulator in the workspace; the writer of key block ``n`` waits until the counter reads ``n``
(``ld.acquire``), adds its tile, and stores ``n + 1`` (``st.release``); the first key block that
walks the query block (its predecessor's query range ends before it, :func:`_dq_turn`) does not
wait. The key blocks that walk a query block are contiguous (``lo`` and ``hi`` of
:func:`_query_range` grow with the key block), so each turn is stored by the key block just
below. Progress: a CTA waits only on CTAs of its own (sequence, KV head) with a lower key block,
which have a lower linear block index in both grids (key blocks along x, or along y with LPT;
the kernel is not persistent: one CTA per tile), and the GPU starts CTAs in linear index order
(the assumption of CUTLASS's serial split-K semaphore and FlashAttention-3's deterministic
backward). So the lowest unfinished CTA is resident and waits on finished CTAs only: it
finishes, and by induction every CTA does. To keep the waits short, every CTA walks its query
blocks in the same phase: query blocks from the last down (the key block below reaches any
shared block no later: its range ends no later), the group's query heads inside each block
(not heads outside: with causal bands a lower key block has more blocks per head, and would
fall behind by that difference per head), and no ``STAGGER``; and the LPT grid
(:func:`~solattn.configs.hopper_backward.lpt_grid`), which starts a head's key blocks a
fraction of a CTA's life apart, not together. The cost is a lag of one hand-off (the adds,
their drain and the flag's round trip through L2, about 1-2 us) per co-resident key block of a
head, paid where they start together, not per step. Two writer warps take the even and odd
steps (``dq_ready`` a pair of barriers): each waits for its turn before its rows arrive and
hands the staging buffer back before its release drains the adds, so neither the poll nor
the drain holds the consumers (:func:`add_staged_dq_in_turn`). dK and dV need nothing: each
CTA sums them in registers over a fixed walk, and a split group's partials are summed in split
order (:func:`bwd_dkdv_reduce_kernel`).

This module holds the device code only: the host side (coverage, GQA splits, plans, launch) is
:mod:`solattn.kernels.hopper.backward_plan`, the tiles and grid rules
:mod:`solattn.configs.hopper_backward`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
)

from solattn.configs import triton_version
from solattn.kernels.common import tanh_f32
from solattn.kernels.hopper.columns import alibi_bias, split_cols
from solattn.kernels.hopper.compat import (
    Value,
    barrier,
    bundle,
    mma_wait,
    tma_store,
    warp_arrive,
    warp_specialize,
)
from solattn.kernels.hopper.dropout import draw_t, keep_t
from solattn.kernels.hopper.pipeline import (
    expect_load2,
    ring_load2,
    ring_slot,
    step_view,
    wait_empty,
    wait_ready,
)
from solattn.masking import band_mask, band_offsets, block_range, transposed_band

# The consumer partition: CONSUMER_WARPS warps = two warpgroups, each owning 64 of the CTA's
# BLOCK_N = 128 keys (a wgmma accumulator covers 64 rows per warpgroup); at d=256, BLOCK_N = 64
# keys both warpgroups share (acc_layout).
CONSUMER_WARPS = gl.constexpr(8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@gluon.constexpr_function
def acc_layout(ROWS, COLS):
    """The layout of a ``[ROWS, COLS]`` consumer accumulator over the two warpgroups (a wgmma
    accumulator covers 64 rows a warpgroup). 128 rows: each warpgroup owns 64 of them, all
    columns; 64 rows: both hold every row and split the columns.

    ``S^T``, ``dP^T``, ``dK``, ``dV`` have the CTA's ``BLOCK_N`` keys as rows: 128, or 64 at
    d=256, where ``2 x 128 x 256`` fp32 dK/dV would not fit the registers (split by columns
    they are 128 registers a thread, as at d=128; neither warpgroup then holds a whole row of
    ``P^T`` or ``dS^T``: both go through shared memory, :func:`p_in_smem`). ``dQ = dS K`` has
    the step's ``BLOCK_M`` queries: 128-query steps split its rows, each warpgroup one ``64 x
    HEAD_DIM`` product reading its half of ``dS`` (FlashAttention-4's split at d=64); 64-query
    steps its columns, each a ``64 x HEAD_DIM / 2`` product reading all of ``dS``."""
    warps = CONSUMER_WARPS.value
    if ROWS >= 16 * warps:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                         instr_shape=[16, COLS, 16])
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps // 2, 2],
                                     instr_shape=[16, COLS // 2, 16])


@gluon.constexpr_function
def p_in_smem(BLOCK_N):
    """Whether ``P^T`` goes through shared memory as the ``A`` operand of ``dV += P^T dO``
    (:func:`acc_layout`'s column split, ``BLOCK_N`` of 64), not from registers."""
    return BLOCK_N < 16 * CONSUMER_WARPS.value


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------

# Query rows per program of :func:`bwd_preprocess_kernel` (divides every BLOCK_M).
PREPROCESS_ROWS = 64


@triton.jit
def varlen_row_offset(q_off, b, BLOCK_M: tl.constexpr):
    """First row of varlen sequence ``b`` (packed rows from ``q_off``) in the per-row buffers
    (``-lse``, ``-Delta`` columns, the dQ accumulator): ``q_off`` rounded down to 4 rows (the
    columns' TMA loads need 16-byte aligned starts) plus ``b * (BLOCK_M + 4)``, so each
    sequence owns ``cdiv(seqlen, BLOCK_M) * BLOCK_M`` rows before the next one's (whole query
    blocks: a block never reads or adds into the next sequence's rows).
    :func:`~solattn.kernels.hopper.backward_plan.attn_bwd` gathers dQ back with the same
    formula."""
    return (q_off // 4) * 4 + b * (BLOCK_M + 4)


@triton.jit
def turn_counters(DQ, n_batch, num_heads, seqlen_q_pad, HEAD_DIM: tl.constexpr):
    """The deterministic mode's int32 turn counters: ``n_batch * num_heads * seqlen_q_pad / 4``
    of them right after the ``(n_batch, num_heads, seqlen_q_pad, HEAD_DIM)`` fp32 dQ
    accumulator ``DQ`` (one workspace,
    :func:`~solattn.kernels.hopper.backward_plan.fp32_workspace`); the query block whose first
    row is flat row ``r`` of the accumulator (a multiple of 4) owns counter ``r // 4``."""
    size = (n_batch * num_heads).to(tl.int64) * seqlen_q_pad * HEAD_DIM
    return (DQ + size).to(tl.pointer_type(tl.int32), bitcast=True)


# Lengths and the LSE's strides (which follow them) are not specialized: one binary per head
# dim serves every shape (and `solattn warmup` compiles it once).
@triton.jit(do_not_specialize=("seqlen_q", "seqlen_q_pad", "stride_lb", "stride_lh",
                               "stride_glb", "stride_glh"))
def bwd_preprocess_kernel(
    O, DO, LSE, DLSE, LSE_INIT, DELTA_INIT,
    DQ_ACC,                                          # (b, h, seqlen_q_pad, d) fp32: zeroed here
    CU_SEQLENS_Q,                                    # (b + 1,) int32, varlen only
    stride_ob, stride_os, stride_oh, stride_od,      # o: (b, s_q, h, d); varlen (1, t_q, h, d)
    stride_dob, stride_dos, stride_doh, stride_dod,  # do: like o
    stride_lb, stride_lh, stride_ls,                 # lse: (b, h, s_q); varlen (h, t_q), lb = 0
    stride_glb, stride_glh, stride_gls,              # dlse: like lse
    seqlen_q, seqlen_q_pad, lse_unit, delta_unit,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
    IS_VARLEN: tl.constexpr, ROW_PAD: tl.constexpr, ZERO_TURNS: tl.constexpr = False,
):
    """The initial accumulator columns of each query row, flat ``(b, h, seqlen_q_pad)``:
    ``-lse / lse_unit`` for ``S^T`` and ``-Delta * delta_unit``, ``Delta = rowsum(dO * O) -
    dLSE``, for ``dP^T`` (``delta_unit``: 1, or ``1 - dropout_p`` with dropout, see
    :func:`_softmax`).
    ``lse_unit`` is the softmax scale (``S^T`` accumulates ``q.k - lse / scale``), or ln 2 with
    softcap (the column is added to the capped score in log2 units). Rows past the sequence,
    and rows that saw no key (``lse = -inf``), get ``-inf`` and 0: their ``P`` is 0.

    The same rows of the fp32 dQ accumulator (``DQ_ACC``, which the main kernel adds into) are
    zeroed here, which saves the caller a fill launch; with ``ZERO_TURNS`` also the int32 turn
    counters of the deterministic mode that follow the accumulator (:func:`turn_counters`),
    one per 4 rows.

    Varlen: sequence ``b`` (packed rows ``cu_seqlens_q[b]:``) owns the buffer rows from
    :func:`_sequence`'s ``row_off``, ``cdiv(seqlen, ROW_PAD) * ROW_PAD`` of them (whole query
    blocks of the backward, from :func:`varlen_row_offset`); programs past them store
    nothing (the next sequence's rows)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if IS_VARLEN:
        # (index bounding, issue 39) clamped into the packed total seqlen_q
        q_off = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b), 0), seqlen_q)
        seqlen_q = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b + 1), q_off), seqlen_q) - q_off
        row_off = varlen_row_offset(q_off, b, ROW_PAD)
        b = 0
    else:
        q_off = 0
        row_off = 0
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    ok = rows < seqlen_q
    r64 = (q_off + rows).to(tl.int64)
    b64 = b.to(tl.int64)
    o = tl.load(O + b64 * stride_ob + h * stride_oh + r64[:, None] * stride_os
                + cols[None, :] * stride_od, mask=ok[:, None], other=0.0)
    do = tl.load(DO + b64 * stride_dob + h * stride_doh + r64[:, None] * stride_dos
                 + cols[None, :] * stride_dod, mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + b64 * stride_glb + h * stride_glh + r64 * stride_gls, mask=ok,
                         other=0.0)
    lse = tl.load(LSE + b64 * stride_lb + h * stride_lh + r64 * stride_ls, mask=ok,
                  other=float("-inf"))
    out = (b64 * tl.num_programs(1) + h) * seqlen_q_pad + row_off + rows
    keep = rows >= 0  # every row of the (b, h) slab
    if IS_VARLEN:
        keep = rows < tl.cdiv(seqlen_q, ROW_PAD) * ROW_PAD
    tl.store(LSE_INIT + out, tl.where(lse == float("-inf"), float("-inf"), -lse / lse_unit),
             mask=keep)
    tl.store(DELTA_INIT + out, tl.where(ok, -delta * delta_unit, 0.0), mask=keep)
    tl.store(DQ_ACC + out[:, None] * HEAD_DIM + cols[None, :],
             tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), mask=keep[:, None])
    if ZERO_TURNS:
        n_batch = 1 if IS_VARLEN else tl.num_programs(2)
        turns = turn_counters(DQ_ACC, n_batch, tl.num_programs(1), seqlen_q_pad, HEAD_DIM)
        tl.store(turns + out // 4, tl.zeros([BLOCK_M], tl.int32), mask=keep & (out % 4 == 0))


# Elements of dK (and of dV) per program of :func:`bwd_dkdv_reduce_kernel`: 16 per thread at
# 4 warps (four 16-byte loads per tensor and split).
REDUCE_ELEMENTS = 2048


@triton.jit(do_not_specialize=("n_rows", "splits", "batch", "heads_kv"))
def bwd_dkdv_reduce_kernel(
    PK, PV,          # (n_rows, splits, d) float32: the splits' partial dK (times the scale), dV
    DK, DV,          # (n_rows, d) in K's and V's dtype, contiguous
    CU_SEQLENS_K,    # (batch + 1,) int32, varlen only
    n_rows, splits, batch, heads_kv,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """dK and dV of a split GQA group in one pass: rows ``(b, s_k, h_kv)`` flattened, each the
    sum of its ``splits`` fp32 partials (adjacent in memory: the kernel's head ``j = h *
    splits + r``) in split order (no atomics: bitwise the same result for the same partials),
    rounded once to the output dtype, as the unsplit kernel rounds its register sums.

    Varlen: ``n_rows = t_k * h_kv`` packed rows; those past ``cu_seqlens_k[batch]`` belong to no
    sequence (the kernel never wrote their partials): zeros, as the unsplit path's dK/dV."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HEAD_DIM)
    in_bounds = rows < n_rows
    valid = in_bounds
    if IS_VARLEN:
        valid = in_bounds & (rows < tl.load(CU_SEQLENS_K + batch) * heads_kv)  # (issue 39)
    r64 = rows.to(tl.int64)
    src = r64[:, None] * (splits * HEAD_DIM) + cols[None, :]
    load_ok = valid[:, None]
    dk = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for s in range(0, splits):
        dk += tl.load(PK + src + s * HEAD_DIM, mask=load_ok, other=0.0,
                      eviction_policy="evict_first")
        dv += tl.load(PV + src + s * HEAD_DIM, mask=load_ok, other=0.0,
                      eviction_policy="evict_first")
    dst = r64[:, None] * HEAD_DIM + cols[None, :]
    tl.store(DK + dst, dk.to(DK.dtype.element_ty), mask=in_bounds[:, None])
    tl.store(DV + dst, dv.to(DV.dtype.element_ty), mask=in_bounds[:, None])


# Query rows per program of :func:`bwd_dq_convert_kernel` (at d=128 over 4 warps: sixteen
# 16-byte loads a thread).
CONVERT_ROWS = 64


@triton.jit(do_not_specialize=("seqlen_q", "seqlen_q_pad"))
def bwd_dq_convert_kernel(
    DQ_ACC,  # (b, h, seqlen_q_pad, d) fp32: the main kernel's sums of dQ * scale
    DQ,      # (b, seqlen_q, h, d) in q's dtype, contiguous
    seqlen_q, seqlen_q_pad,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dQ in its output dtype and layout from the accumulator: ``BLOCK_M`` rows of one head
    a program, read from the head's contiguous slab and written ``h * d`` elements apart.
    Every access is a whole row (16-byte vectors), where torch's strided ``.to()`` of the
    transposed view moves 4 bytes a thread."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    ok = rows < seqlen_q
    src = ((b * tl.num_programs(1) + h).to(tl.int64) * seqlen_q_pad + rows) * HEAD_DIM
    dq = tl.load(DQ_ACC + src[:, None] + cols[None, :], mask=ok[:, None],
                 eviction_policy="evict_first")
    dst = ((b.to(tl.int64) * seqlen_q + rows) * tl.num_programs(1) + h) * HEAD_DIM
    tl.store(DQ + dst[:, None] + cols[None, :], dq.to(DQ.dtype.element_ty), mask=ok[:, None])


@bundle
class BwdStep:
    """What the consumer's step loop (:func:`steps_ss`, :func:`_steps_rs`) reads besides the
    carried ``dK`` and ``dV``: the CTA's K and V tiles, the rings and their barriers, the dQ
    staging buffer, the CTA's (batch, KV head, sequence) and its walk over the group's query
    heads and blocks (:func:`_step_coords`), its keys and their band, the scales and ALiBi
    (``alibi = (slopes of the sequence, stride between heads, units)``, else 0)."""
    k_tile: gl.shared_memory_descriptor   # [BLOCK_N, HEAD_DIM]
    v_tile: gl.shared_memory_descriptor
    q_smem: gl.shared_memory_descriptor   # [STAGES, 1, 1, BLOCK_M, HEAD_DIM]
    do_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor  # [BLOCK_N, BLOCK_M]: dS^T (p_in_smem: then P^T)
    lse_smem: gl.shared_memory_descriptor
    delta_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    qdo_empty: gl.shared_memory_descriptor
    dq_ready: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor
    DQ: Value                             # (b, h, seqlen_q_pad, d) float32 accumulator
    b: Value
    h_kv: Value
    group_size: Value
    num_heads: Value
    seqlen_q_pad: Value
    row_off: Value                        # the sequence's first row in DQ (varlen)
    n_blk: Value                          # query blocks a head
    lo: Value                             # the first query block's row
    rot: Value                            # STAGGER: the first block of each head's walk
    total: Value                          # steps: group_size * n_blk
    keys: gl.tensor
    key_bias: gl.tensor
    full_lo: Value
    full_hi: Value
    t_lower: Value
    t_upper: Value
    qk_scale: Value
    softcap_prescale: Value
    sm_scale: Value                       # (with dropout: times 1 / (1 - dropout_p))
    alibi: Value
    diag: Value
    drop: Value                           # dropout's (seed, b, 0, threshold, scale), else 0
    start_n: Value                        # keys[0]

    # The step interface :func:`steps_ss` and :func:`_steps_rs` walk (the flex backward's
    # step bundle has the same methods: its walker is a BlockMask's list, its score transform
    # the traced mods). ``where`` is what :meth:`at` returns for a step, ``xf`` what
    # :meth:`score_args` loads for it.

    @gluon.jit
    def at(self, t, cfg):
        """Step ``t`` of the band walk -> ``(query head, first query row)``
        (:func:`_step_coords`)."""
        return _step_coords(t, self.n_blk, self.lo, self.h_kv, self.group_size, self.rot,
                            cfg.BLOCK_M, cfg.STAGGER, cfg.DETERMINISTIC)

    @gluon.jit
    def score_args(self, where, cfg):
        """What the score transform of step ``where`` loads: its query head's ALiBi slope
        (:func:`_alibi_slope`; 0 without ALiBi)."""
        h, _ = where
        return _alibi_slope(self, h, cfg)

    @gluon.jit
    def issue_s(self, t, where, xf, cfg):
        """Issue step ``t``'s ``S^T = K Q^T`` (:func:`_issue_s`) -> its token."""
        _, start_m = where
        return _issue_s(self, t, start_m, xf, cfg)

    @gluon.jit
    def draw(self, where, cfg):
        """Dropout's draws for step ``where`` (:func:`~solattn.kernels.hopper.dropout.draw_t`),
        drawn by the loop one step ahead where fewer accumulators are live; 0 without
        dropout."""
        bits = 0
        if cfg.HAS_DROPOUT:
            h, start_m = where
            seed, b, _, threshold, scale = self.drop
            s_layout: gl.constexpr = acc_layout(cfg.BLOCK_N, cfg.BLOCK_M)
            bits = draw_t((seed, b, h, threshold, scale), self.start_n, start_m, cfg.BLOCK_N,
                          cfg.BLOCK_M, s_layout)
        return bits

    @gluon.jit
    def softmax(self, s_t, dp_t, slot, bits, where, xf, cfg):
        """``(P^T, dS^T)`` of the waited ``S^T`` and ``dP^T`` of the step in ring slot
        ``slot`` (``bits``: its :meth:`draw`; :func:`_softmax`)."""
        return _softmax(self, s_t, dp_t, slot, bits, where, xf, cfg)

    @gluon.jit
    def finish_dq(self, dq, where, t, cfg):
        """Step ``t``'s ``dQ`` to the writer warp or the accumulator (:func:`_finish_dq`)."""
        h, start_m = where
        _finish_dq(self, dq, h, self.row_off + start_m, t, cfg)


@bundle
class BwdConsts:
    """The consumers' constexprs (:func:`attn_bwd_kernel`'s)."""
    HEAD_DIM: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    HAS_LOWER: gl.constexpr
    HAS_UPPER: gl.constexpr
    HAS_SOFTCAP: gl.constexpr
    IS_VARLEN: gl.constexpr
    LOOKAHEAD: gl.constexpr
    DQ_WRITER: gl.constexpr
    DK_FROM_REGS: gl.constexpr
    LPT: gl.constexpr
    STAGGER: gl.constexpr
    HAS_ALIBI: gl.constexpr
    TMA_EPILOGUE: gl.constexpr
    DETERMINISTIC: gl.constexpr
    LOCAL_SYNC: gl.constexpr
    HAS_DROPOUT: gl.constexpr


@bundle
class BwdSmem:
    """The CTA's shared memory and barriers (:func:`bwd_buffers`)."""
    q: gl.shared_memory_descriptor        # [STAGES, 1, 1, BLOCK_M, HEAD_DIM] ring
    k: gl.shared_memory_descriptor        # [1, 1, BLOCK_N, HEAD_DIM], loaded once
    v: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor       # ring, as q
    ds: gl.shared_memory_descriptor       # [BLOCK_N, BLOCK_M]: dS^T (p_in_smem: then P^T)
    lse: gl.shared_memory_descriptor      # ring of -lse / scale columns
    delta: gl.shared_memory_descriptor    # ring of -Delta columns
    dq: gl.shared_memory_descriptor       # dQ staging (DQ_WRITER)
    kv_ready: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    qdo_empty: gl.shared_memory_descriptor
    dq_ready: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor


@bundle
class BwdOut:
    """Where the gradients go (:func:`attn_bwd_kernel`'s comments)."""
    dk_desc: Value
    dv_desc: Value
    DQ: Value
    DK: Value
    DV: Value


@bundle
class BwdProblem:
    """The call's sequences, sizes, band, scales and ALiBi slopes (:func:`attn_bwd_kernel`'s
    comments)."""
    CU_SEQLENS_Q: Value
    CU_SEQLENS_K: Value
    ALIBI: Value
    num_heads: Value
    num_heads_kv: Value
    seqlen_q: Value
    seqlen_q_pad: Value
    seqlen_k: Value
    group_size: Value
    left: Value
    right: Value
    qk_scale: Value
    softcap_prescale: Value
    sm_scale: Value
    alibi_unit: Value
    alibi_sb: Value
    alibi_sh: Value
    SEED: Value                           # dropout's (1,) int64 seed, HAS_DROPOUT only
    dropout_threshold: Value
    dropout_scale: Value


@gluon.jit
def _sequence(b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K, BLOCK_M: gl.constexpr,
              IS_VARLEN: gl.constexpr):
    """Batch entry ``b`` -> ``(b_desc, q_off, k_off, row_off, seqlen_q, seqlen_k)``: the
    descriptors' batch index, the first packed query and key rows of the sequence, its first
    row in the per-row buffers (``-lse``, ``-Delta`` columns, the dQ accumulator) and its
    lengths. Varlen: the packed tensors are one batch entry; sequence ``b`` starts at
    ``cu_seqlens[b]`` and its buffer rows at :func:`varlen_row_offset`."""
    b_desc = b
    q_off = 0
    k_off = 0
    row_off = 0
    if IS_VARLEN:
        # (index bounding, issue 39) clamped into the packed totals seqlen_q / seqlen_k
        q_off = gl.minimum(gl.maximum(gl.load(CU_SEQLENS_Q + b), 0), seqlen_q)
        seqlen_q = gl.minimum(gl.maximum(gl.load(CU_SEQLENS_Q + b + 1), q_off), seqlen_q) - q_off
        k_off = gl.minimum(gl.maximum(gl.load(CU_SEQLENS_K + b), 0), seqlen_k)
        seqlen_k = gl.minimum(gl.maximum(gl.load(CU_SEQLENS_K + b + 1), k_off), seqlen_k) - k_off
        row_off = varlen_row_offset(q_off, b, BLOCK_M)
        b_desc = 0
    return b_desc, q_off, k_off, row_off, seqlen_q, seqlen_k


@gluon.jit
def _cta_tile(BLOCK_N: gl.constexpr, LPT: gl.constexpr):
    """The CTA's first key and (kernel) KV head. Grid (key blocks, KV heads, batch); with
    ``LPT`` (heads, key blocks, batch), so that CTAs start in key-block order across all heads:
    causal's longest key blocks (the first: every query) of every head before any shorter one
    (the GPU starts CTAs in grid order), the shortest last."""
    if LPT:
        return gl.program_id(1) * BLOCK_N, gl.program_id(0)
    return gl.program_id(0) * BLOCK_N, gl.program_id(1)


@gluon.jit
def _query_range(start_n, seqlen_q, seqlen_k, left, right,
                 BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, HAS_LOWER: gl.constexpr,
                 HAS_UPPER: gl.constexpr, IS_VARLEN: gl.constexpr):
    """Query blocks of the CTA's keys ``[start_n, start_n + BLOCK_N)``: ``(t_lower, t_upper,
    lo, full_lo, full_hi, hi)`` of the transposed band (every partition calls this). Varlen:
    a CTA past its sequence's keys (the grid covers the longest) gets no query block."""
    lower, upper = band_offsets(seqlen_q, seqlen_k, left, right)
    t_lower, t_upper = transposed_band(lower, upper)
    lo, full_lo, full_hi, hi = block_range(start_n, seqlen_k, seqlen_q, t_lower, t_upper,
                                           BLOCK_N, BLOCK_M, HAS_UPPER, HAS_LOWER)
    if IS_VARLEN:
        hi = lo + (hi - lo) * (start_n < seqlen_k).to(gl.int32)
    return t_lower, t_upper, lo, full_lo, full_hi, hi


@gluon.jit
def _step_coords(t, n_blk, lo, h_kv, group_size, rot, BLOCK_M: gl.constexpr,
                 STAGGER: gl.constexpr, ORDERED: gl.constexpr = False):
    """Step ``t`` of the CTA's flattened loop (query heads of the group, then query blocks of
    ``[lo, hi)``) -> ``(query head, first query row)``. ``STAGGER``: each head's blocks start at
    block ``rot`` (:func:`_stagger`) and wrap around. ``ORDERED`` (the deterministic mode): query
    blocks from the last down, the group's heads inside each block, so that the CTAs of
    neighbouring key blocks reach a shared (head, block) in step (module docstring)."""
    if ORDERED:
        i = t // group_size
        g = t - i * group_size
        i = n_blk - 1 - i
    else:
        g = t // n_blk
        i = t - g * n_blk
        if STAGGER:
            i = i + rot
            i = gl.where(i >= n_blk, i - n_blk, i)
    return h_kv * group_size + g, lo + i * BLOCK_M


@gluon.jit
def _stagger(start_n, n_blk, BLOCK_N: gl.constexpr, STAGGER: gl.constexpr):
    """The CTA's first query block (of ``n_blk``) with ``STAGGER``: its key block's index modulo
    ``n_blk``. The CTAs that run together (neighbouring key blocks of one head) then add their
    dQ into different rows at any time, rather than all into the same block at once."""
    rot = 0
    if STAGGER:
        rot = (start_n // BLOCK_N) % gl.maximum(n_blk, 1)
    return rot


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, smem, prob, kv_splits,
              cfg):
    """One warp: TMA the CTA's K and V once (KV head ``h_kv // kv_splits``: a split group's
    CTAs read the same K, V in place); then per step, Q_i with its ``-lse / scale``
    column (on ``q_ready``) and dO_i with its ``-Delta`` column (on ``do_ready``) into the
    ring. (TMA only: a lane-distributed load here kept the lane id across the register
    reallocation, spilled.) Varlen: a tile's rows past its sequence are the next sequence's
    (their columns are ``-inf`` and 0 in the padded buffers: ``P = 0``)."""
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    start_n, h_kv = _cta_tile(BLOCK_N, cfg.LPT)
    b, q_off, k_off, row_off, seqlen_q, seqlen_k = _sequence(
        gl.program_id(2), prob.seqlen_q, prob.seqlen_k, prob.CU_SEQLENS_Q, prob.CU_SEQLENS_K,
        BLOCK_M, cfg.IS_VARLEN)
    kv_head = h_kv // kv_splits
    expect_load2(k_desc, [b, kv_head, k_off + start_n, 0], smem.k,
                 v_desc, [b, kv_head, k_off + start_n, 0], smem.v, smem.kv_ready)
    _, _, lo, _, _, hi = _query_range(start_n, seqlen_q, seqlen_k, prob.left, prob.right,
                                      BLOCK_N, BLOCK_M, cfg.HAS_LOWER, cfg.HAS_UPPER,
                                      cfg.IS_VARLEN)
    n_blk = gl.cdiv(hi - lo, BLOCK_M)
    rot = _stagger(start_n, n_blk, BLOCK_N, cfg.STAGGER)
    group_size = prob.group_size
    for t in range(0, group_size * n_blk):
        h, start_m = _step_coords(t, n_blk, lo, h_kv, group_size, rot, BLOCK_M, cfg.STAGGER,
                                  cfg.DETERMINISTIC)
        row = (b * prob.num_heads + h) * prob.seqlen_q_pad + row_off + start_m
        slot, parity = ring_slot(t, cfg.STAGES)
        wait_empty(smem.qdo_empty, slot, parity)
        ring_load2(q_desc, [b, h, q_off + start_m, 0], smem.q, lse_desc, [row], smem.lse,
                   smem.q_ready, slot)
        ring_load2(do_desc, [b, h, q_off + start_m, 0], smem.do, delta_desc, [row], smem.delta,
                   smem.do_ready, slot)


@gluon.jit
def _issue_s(st, t, start_m, slope, cfg):
    """Issue ``S^T = K Q^T`` of step ``t`` (async) -> its token.

    The accumulator starts at ``-lse / scale`` (the producer staged it), so no column vector
    stays live across the wgmma wait. Masked-out scores (keys past the sequence; the band's
    edge outside the unmasked interior ``[full_lo, full_hi)``) start at -inf, so ``P = 0``
    there with no mask live either. ALiBi's bias (:func:`_alibi_bias`, ``slope`` in ``q.k``
    units) starts it too. With softcap none can go in before the ``tanh`` (``tanh(-inf) =
    -1``): ``S^T`` starts at 0 and :func:`_softmax` applies them.
    """
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    T_HAS_LOWER: gl.constexpr = cfg.HAS_UPPER  # the transposed band (_consumer)
    T_HAS_UPPER: gl.constexpr = cfg.HAS_LOWER
    k_tile = step_view(st.k_tile, t)
    keys = st.keys
    s_layout: gl.constexpr = acc_layout(BLOCK_N, BLOCK_M)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    slot, parity = ring_slot(t, cfg.STAGES)
    wait_ready(st.q_ready, slot, parity)
    q_tile = st.q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    if cfg.HAS_SOFTCAP:
        return warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_init, use_acc=False,
                             is_async=True)
    s_init = s_init + (st.lse_smem.index(slot).load(col_layout)[None, :] + st.key_bias[:, None])
    if cfg.HAS_ALIBI:
        s_init = s_init - _alibi_bias(slope, keys, start_m, st.diag, BLOCK_M, s_layout)
    if T_HAS_LOWER or T_HAS_UPPER:
        if (start_m < st.full_lo) | (start_m >= st.full_hi):
            s_init = gl.where(_edge_mask(st, start_m, s_layout, cfg), s_init, float("-inf"))
    return warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_init, is_async=True)


# Whether the varlen and deterministic softcap builds take _edge_mask's split columns too: with
# triton 3.6 the split makes the d=128 varlen + window + softcap build and the deterministic
# causal + softcap one compile without a loop spill (24 B with 2 and 1 local accesses in the
# loop before); triton 3.9's ptxas compiled those spill-free before, and with the split spills
# 16 B outside the loops of causal + softcap (`solattn aot --arch 90`, 2026-11-28). The plain
# softcap builds keep the column vector with either (their SASS unchanged, not re-timed).
_SPLIT_SOFTCAP = gl.constexpr(triton_version() < (3, 9))


@gluon.jit
def _edge_mask(st, start_m, layout: gl.constexpr, cfg):
    """The band's mask over a step's ``[keys, queries]`` tile at query ``start_m`` (its edge
    blocks only). ALiBi builds, and with :data:`_SPLIT_SOFTCAP` the varlen and deterministic
    softcap builds, compare with the columns split into the lane's and the register's part
    (:func:`~solattn.kernels.hopper.columns.split_cols`): ``c >= r + lower`` as ``(c & ~6) >= (r
    + lower - (c & 6))``, so no column vector is live beside the bias (`solattn aot --arch 90`,
    triton 3.9, 2026-11-28: causal + ALiBi at d=128 40 B of local memory with 4 accesses in the
    loop with a column vector; 8 B, none in the loop, split). The other builds keep the column
    vector (their SASS as measured before the split)."""
    T_HAS_LOWER: gl.constexpr = cfg.HAS_UPPER  # the transposed band (_consumer)
    T_HAS_UPPER: gl.constexpr = cfg.HAS_LOWER
    if cfg.HAS_ALIBI or (cfg.HAS_SOFTCAP and _SPLIT_SOFTCAP
                         and (cfg.IS_VARLEN or cfg.DETERMINISTIC)):
        lane_part, reg_part = split_cols(cfg.BLOCK_M, layout)
        return band_mask(st.keys - start_m, reg_part, 0, (st.t_lower - lane_part)[None, :],
                         (st.t_upper - lane_part)[None, :], T_HAS_LOWER, T_HAS_UPPER, False)
    cols = start_m + gl.arange(0, cfg.BLOCK_M, layout=gl.SliceLayout(0, layout))
    return band_mask(st.keys, cols, 0, st.t_lower, st.t_upper, T_HAS_LOWER, T_HAS_UPPER, False)


@gluon.jit
def _alibi_slope(st, h, cfg):
    """Query head ``h``'s ALiBi slope in the units of ``S^T`` (``q.k``, or ``tanh`` with
    softcap): ``st.alibi = (slopes of the CTA's sequence, stride between heads, units)``; 0
    without ALiBi."""
    slope = 0.0
    if cfg.HAS_ALIBI:
        base, stride_h, unit = st.alibi
        slope = gl.load(base + h * stride_h) * unit
    return slope


@gluon.jit
def _alibi_bias(slope, keys, start_m, diag, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """``slope * |i + diag - j|`` over a step's ``[keys j, queries i]`` tile (``diag = seqlen_k
    - seqlen_q``: flash-attn's bottom-right aligned distance), which the forward subtracted
    from each score after the softcap (:func:`solattn.kernels.common.score_transform`)."""
    return alibi_bias(slope, (keys - (start_m + diag)).to(gl.float32), BLOCK_M, layout)


@gluon.jit
def _softmax(st, s_t, dp_t, slot, bits, where, slope, cfg):
    """``(P^T, dS^T)`` in fp32 from the waited ``S^T`` and ``dP^T`` (``dS`` is the gradient of
    ``q.k * scale``: the caller scales dK and dQ).

    Without softcap ``S^T`` already holds ``q.k - lse / scale`` (-inf where masked): ``P^T =
    exp2(S^T * scale * log2 e)``. With softcap ``S^T`` holds ``q.k``: ``t = tanh(q.k * scale /
    softcap)``, ``P^T = exp2(t * softcap * log2 e - lse * log2 e)`` with the step's column
    (``-lse * log2 e``, still in its ring slot) and the keys' -inf bias added to the exponent,
    the band's edge zeroed in the edge blocks only; the chain rule through the cap multiplies
    ``dS`` by ``1 - t^2`` (as the portable backward); ALiBi's bias (``slope`` in ``tanh``
    units) comes off ``t`` after that factor. (A select on ``S^T == -inf`` instead kept ``S^T``
    live beside ``P^T``: it spilled at d=128.)

    Dropout (``HAS_DROPOUT``, the keep mask ``Z`` dealt from the step's draws ``bits``
    (:func:`~solattn.kernels.hopper.dropout.keep_t`), ``r = 1 / (1 -
    dropout_p)``): ``dS = P (r Z dP - Delta)`` and ``dV = (r Z P)^T dO``. ``dP^T`` started at
    ``-Delta / r`` (the preprocess's column, :func:`bwd_preprocess_kernel`'s ``delta_unit``),
    so ``dS / r = P * (Z ? dP^T : -Delta / r)`` with the column read again from its ring slot,
    and ``P^T`` is zeroed where dropped; the factor ``r`` is in ``sm_scale`` (dK, dQ) and the
    dV epilogue."""
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    T_HAS_LOWER: gl.constexpr = cfg.HAS_UPPER  # the transposed band (_consumer)
    T_HAS_UPPER: gl.constexpr = cfg.HAS_LOWER
    s_layout: gl.constexpr = s_t.type.layout
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    _, start_m = where
    keys = st.keys
    qk_scale = st.qk_scale
    if cfg.HAS_SOFTCAP:
        if cfg.HAS_DROPOUT:  # (before dP^T takes the chain rule's factor)
            keep = keep_t(bits, cfg.BLOCK_N, BLOCK_M, s_layout)
            dp_t = gl.where(keep, dp_t, st.delta_smem.index(slot).load(col_layout)[None, :])
        lse_tile = st.lse_smem.index(slot)
        # In this order two [BLOCK_N, BLOCK_M] tiles are live at a time, not three: dP^T takes
        # the chain rule's factor before t turns into the exponent.
        tc = tanh_f32(s_t * st.softcap_prescale)
        dp_t = dp_t * (1.0 - tc * tc)
        if cfg.HAS_ALIBI:
            tc = tc - _alibi_bias(slope, keys, start_m, st.diag, BLOCK_M, s_layout)
        e_t = tc * qk_scale + (lse_tile.load(col_layout)[None, :] + st.key_bias[:, None])
        if T_HAS_LOWER or T_HAS_UPPER:
            if (start_m < st.full_lo) | (start_m >= st.full_hi):
                e_t = gl.where(_edge_mask(st, start_m, s_layout, cfg), e_t, float("-inf"))
        p_t = gl.exp2(e_t)
        ds_t = p_t * dp_t
        if cfg.HAS_DROPOUT:
            p_t = gl.where(keep, p_t, 0.0)
    else:
        p_t = gl.exp2(s_t * qk_scale)
        if cfg.HAS_DROPOUT:  # (after S^T is dead: the mask is used at once)
            keep = keep_t(bits, cfg.BLOCK_N, BLOCK_M, s_layout)
            ds_t = p_t * gl.where(keep, dp_t,
                                  st.delta_smem.index(slot).load(col_layout)[None, :])
            p_t = gl.where(keep, p_t, 0.0)
        else:
            ds_t = p_t * dp_t
    return p_t, ds_t


@gluon.jit
def issue_dp(v_tile, do_smem, delta_smem, do_ready, t, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Issue ``dP^T = V dO^T`` of step ``t`` (async), its accumulator starting at ``-Delta``
    -> its token."""
    s_layout: gl.constexpr = acc_layout(BLOCK_N, BLOCK_M)
    slot, parity = ring_slot(t, STAGES)
    wait_ready(do_ready, slot, parity)
    dp_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dp_init = dp_init + delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))[None, :]
    do_tile = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    return warpgroup_mma(step_view(v_tile, t), do_tile.permute((1, 0)), dp_init,
                         is_async=True)


@gluon.jit
def _add_dq(dq, DQ, b, h, num_heads, seqlen_q_pad, start_m, sm_scale,
            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """``dQ * scale`` of one step into the fp32 buffer ``(b, h, s_q padded to BLOCK_M, d)``
    (padded: no row mask) with ``red.global.add``."""
    dq_layout: gl.constexpr = dq.type.layout
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    base = DQ + (b * num_heads + h).to(gl.int64) * (seqlen_q_pad * HEAD_DIM)
    gl.atomic_add(base + (rows[:, None] * HEAD_DIM + cols[None, :]), dq * sm_scale,
                  sem="relaxed")


@gluon.constexpr_function
def writer_layout(HEAD_DIM):
    """The dQ writer warp's layout of its staged rows: 4 consecutive floats per thread (one
    ``red.global.add.v4``), a row across ``HEAD_DIM / 4`` lanes (d=256: across the warp
    twice)."""
    return gl.BlockedLayout(size_per_thread=[1, 4],
                            threads_per_warp=[max(128 // HEAD_DIM, 1), min(HEAD_DIM // 4, 32)],
                            warps_per_cta=[1, 1], order=[1, 0])


@gluon.jit
def writer_offsets(layout: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr):
    """Element offsets of ``ROWS`` staged dQ rows in the ``(.., d)`` accumulator, in
    ``layout``."""
    return (gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))[:, None] * HEAD_DIM
            + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))[None, :])


@gluon.jit
def add_staged_dq(dq_smem, dq_ready, dq_empty, base, offs, t, layout: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, ROWS: gl.constexpr):
    """The dQ writer's step ``t``: wait for the staged rows, add them at ``base`` (``ROWS`` at
    a time, ``red.global.add``), hand the staging buffer back."""
    mbarrier.wait(dq_ready, t & 1)
    for r in gl.static_range(0, BLOCK_M, ROWS):
        vals = dq_smem.slice(r, ROWS, dim=0).load(layout)
        gl.atomic_add(base + (r * HEAD_DIM + offs), vals, sem="relaxed")
    mbarrier.arrive(dq_empty, count=1)


@gluon.jit
def _ld_acquire(ptr):
    """``*ptr`` (int32) loaded with acquire semantics at GPU scope (every lane loads the same
    word: one transaction), so this thread's later memory operations follow the writes that
    preceded the store it reads."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _st_release(ptr, value):
    """``*ptr = value`` (int32) with release semantics at GPU scope: after every memory
    operation of this thread, and of the threads that synchronized with it before (a
    ``bar.sync``), is performed. Returns 0 (inline assembly must return a value)."""
    return gl.inline_asm_elementwise("st.release.gpu.global.b32 [$1], $2;\n\tmov.u32 $0, 0;",
                                     "=r,l,r", [ptr, value], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def add_staged_dq_in_turn(dq_smem, dq_ready, phase, dq_empty, base, offs, counter, turn,
                          layout: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                          ROWS: gl.constexpr, WAIT: gl.constexpr):
    """A deterministic writer's step: as :func:`add_staged_dq` (the staged rows awaited on
    ``dq_ready`` with parity ``phase``), but the adds wait (``WAIT``: this key block is not
    the first to add this tile) until the tile's ``counter`` reads ``turn`` (this key block's
    index), and are followed by ``counter = turn + 1`` once they are performed (every lane's:
    the barrier, then the cumulative release).

    Only the adds stand between the staged rows' arrival and the buffer's return, as in
    :func:`add_staged_dq`: the turn is awaited before the rows are (the counter's round trip
    through L2 overlaps the consumers' step), and the buffer goes back as soon as the adds
    are issued (their operands are in registers), before the release drains them. The drain
    (the adds reaching L2) still holds this warp: the other writer warp takes the next step."""
    if WAIT:
        seen = _ld_acquire(counter)
        while seen < turn:
            seen = _ld_acquire(counter)
    mbarrier.wait(dq_ready, phase)
    for r in gl.static_range(0, BLOCK_M, ROWS):
        vals = dq_smem.slice(r, ROWS, dim=0).load(layout)
        gl.atomic_add(base + (r * HEAD_DIM + offs), vals, sem="relaxed")
    barrier()
    mbarrier.arrive(dq_empty, count=1)
    _st_release(counter, turn + 1)


@gluon.jit
def _dq_turn(start_n, seqlen_q, seqlen_k, lo, n_blk, group_size, prob, cfg):
    """The deterministic writer's place in the dQ order -> ``(turn, t_first)``: the CTA's key
    block index ``turn`` (it adds a tile once the tile's counter reads ``turn``), and how many
    of its first steps (the ordered walk of :func:`_step_coords`: query blocks from the last
    down) add without waiting: those of the query blocks at or past the end of the key block
    below's query range (:func:`_query_range`), which that block never walks (all of them for
    key block 0). ``lo``: the CTA's first query row, ``n_blk`` its query blocks."""
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    _, _, _, _, _, prev_hi = _query_range(start_n - cfg.BLOCK_N, seqlen_q, seqlen_k, prob.left,
                                          prob.right, cfg.BLOCK_N, BLOCK_M, cfg.HAS_LOWER,
                                          cfg.HAS_UPPER, cfg.IS_VARLEN)
    prev_hi = gl.where(start_n > 0, prev_hi, 0)
    # Blocks lo + i * BLOCK_M with i >= shared start at or past prev_hi.
    shared = gl.minimum(gl.cdiv(gl.maximum(prev_hi - lo, 0), BLOCK_M), n_blk)
    return start_n // cfg.BLOCK_N, group_size * (n_blk - shared)


@gluon.jit
def _dq_writer_ordered(smem, DQ, counters, t_lo, t_hi, n_blk, lo_row, b, h_kv, turn, prob,
                       cfg, offs, ROWS: gl.constexpr, WAIT: gl.constexpr, PARITY: gl.constexpr):
    """The steps ``t`` of ``[t_lo, t_hi)`` with ``t % 2 == PARITY`` of the deterministic
    writers (:func:`add_staged_dq_in_turn`): writer ``PARITY`` waits on ``dq_ready[PARITY]``,
    its ``u``-th use, step ``t = 2 u + PARITY``, with parity ``u & 1 = (t >> 1) & 1``. The
    tile's first row in the buffer, ``flat``, is an int32 (``covers``: fewer than 2**31 rows
    over all heads); one per-step value fewer than an int64 product (40 registers)."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    layout: gl.constexpr = writer_layout(HEAD_DIM)
    group_size = prob.group_size
    ready = smem.dq_ready.index(PARITY)
    for t in range(t_lo + ((t_lo ^ PARITY) & 1), t_hi, 2):
        h, row = _step_coords(t, n_blk, lo_row, h_kv, group_size, 0, BLOCK_M, False, True)
        flat = (b * prob.num_heads + h) * prob.seqlen_q_pad + row
        add_staged_dq_in_turn(smem.dq, ready, (t >> 1) & 1, smem.dq_empty,
                              DQ + flat.to(gl.int64) * HEAD_DIM, offs, counters + flat // 4,
                              turn, layout, HEAD_DIM, BLOCK_M, ROWS, WAIT)


@gluon.jit
def _dq_writer(smem, out, prob, cfg, ROWS: gl.constexpr, PARITY: gl.constexpr = 0):
    """One warp: per step, the consumers' ``dQ * scale`` (staged in shared memory) into the
    fp32 buffer ``(b, h, s_q padded to BLOCK_M, d)`` with ``red.global.add`` of 4 floats, a
    few rows at a time, so the atomics never stall the warpgroups that run the products.
    ``DETERMINISTIC``: two such warps, writer ``PARITY`` taking the steps of that parity
    (:func:`_dq_writer_ordered`)."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    layout: gl.constexpr = writer_layout(HEAD_DIM)
    start_n, h_kv = _cta_tile(BLOCK_N, cfg.LPT)
    b, _, _, row_off, seqlen_q, seqlen_k = _sequence(
        gl.program_id(2), prob.seqlen_q, prob.seqlen_k, prob.CU_SEQLENS_Q, prob.CU_SEQLENS_K,
        BLOCK_M, cfg.IS_VARLEN)
    _, _, lo, _, _, hi = _query_range(start_n, seqlen_q, seqlen_k, prob.left, prob.right,
                                      BLOCK_N, BLOCK_M, cfg.HAS_LOWER, cfg.HAS_UPPER,
                                      cfg.IS_VARLEN)
    n_blk = gl.cdiv(hi - lo, BLOCK_M)
    rot = _stagger(start_n, n_blk, BLOCK_N, cfg.STAGGER)
    offs = writer_offsets(layout, HEAD_DIM, ROWS)
    # Varlen: the sequence's first buffer row folds into the first block's (one value fewer
    # live in the loop: the writer warp has 40 registers at d=128).
    lo_row = row_off + lo
    group_size = prob.group_size
    if cfg.DETERMINISTIC:
        turn, t_first = _dq_turn(start_n, seqlen_q, seqlen_k, lo, n_blk, group_size, prob, cfg)
        n_batch = 1 if cfg.IS_VARLEN else gl.num_programs(2)
        counters = turn_counters(out.DQ, n_batch, prob.num_heads, prob.seqlen_q_pad, HEAD_DIM)
        # The steps that add first, then those that wait: two loops, so that no per-step test
        # keeps a bound live (40 registers).
        _dq_writer_ordered(smem, out.DQ, counters, 0, t_first, n_blk, lo_row, b, h_kv, turn,
                           prob, cfg, offs, ROWS, False, PARITY)
        _dq_writer_ordered(smem, out.DQ, counters, t_first, group_size * n_blk, n_blk, lo_row,
                           b, h_kv, turn, prob, cfg, offs, ROWS, True, PARITY)
    else:
        for t in range(0, group_size * n_blk):
            h, row = _step_coords(t, n_blk, lo_row, h_kv, group_size, rot, BLOCK_M,
                                  cfg.STAGGER)
            base = out.DQ + ((b * prob.num_heads + h).to(gl.int64) * prob.seqlen_q_pad
                             + row) * HEAD_DIM
            add_staged_dq(smem.dq, smem.dq_ready, smem.dq_empty, base, offs, t, layout,
                          HEAD_DIM, BLOCK_M, ROWS)


@gluon.jit
def consumer_arrive(bar, LOCAL_SYNC: gl.constexpr):
    """The consumers' arrival on ``bar``: one per warp (``LOCAL_SYNC``, barrier count
    ``CONSUMER_WARPS``), else Gluon's one-thread arrive after a partition-wide ``bar.sync``."""
    if LOCAL_SYNC:
        warp_arrive(bar)
    else:
        mbarrier.arrive(bar, count=1)


@gluon.jit
def stage_dq(dq, dq_smem, dq_ready, dq_empty, t, sm_scale, LOCAL_SYNC: gl.constexpr = False):
    """Step ``t``'s ``dQ * scale`` into the writer warp's staging buffer (once the writer
    handed it back)."""
    mbarrier.wait(dq_empty, (t & 1) ^ 1)
    dq_smem.store(dq * sm_scale)
    consumer_arrive(dq_ready, LOCAL_SYNC)


@gluon.jit
def _finish_dq(st, dq, h, start_m, t, cfg):
    """Step ``t``'s ``dQ`` (query head ``h``, rows from ``start_m`` of the padded buffer):
    staged for the writer warp (``DQ_WRITER``), or added here."""
    if cfg.DQ_WRITER:
        if cfg.DETERMINISTIC:  # one ready barrier per writer warp (_dq_writer_ordered)
            stage_dq(dq, st.dq_smem, st.dq_ready.index(t & 1), st.dq_empty, t, st.sm_scale,
                     cfg.LOCAL_SYNC)
        else:
            stage_dq(dq, st.dq_smem, st.dq_ready, st.dq_empty, t, st.sm_scale, cfg.LOCAL_SYNC)
    else:
        _add_dq(dq, st.DQ, st.b, h, st.num_heads, st.seqlen_q_pad, start_m, st.sm_scale,
                cfg.HEAD_DIM, cfg.BLOCK_M)


@gluon.jit
def issue_grads_ss(p_t, ds_t, k_tile, q_tile, do_tile, ds_smem, dk, dv, op_layout: gl.constexpr,
                   dq_layout: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr):
    """One step's gradient products from ``P^T`` and ``dS^T`` (fp32), issued async in the
    order dV, dQ, dK -> their tokens: ``dV += P^T dO`` with ``P^T`` from registers; ``dS^T``
    through shared memory (one buffer: the previous step's readers finished at its wait), the
    ``A`` operand of ``dK += dS^T Q`` and, as a transposed view, of ``dQ = dS K``. With
    :func:`p_in_smem` (64 keys, d=256) ``P^T`` goes through shared memory too, in the rows
    of ``ds_smem`` after ``dS^T``'s (:func:`bwd_buffers`), stored beside it before the one
    ``bar.sync``."""
    dtype: gl.constexpr = k_tile.dtype
    ds_t = ds_t.to(dtype)
    if p_in_smem(BLOCK_N):
        p_smem = ds_smem.slice(BLOCK_N, BLOCK_N)
        ds_smem = ds_smem.slice(0, BLOCK_N)
        p_smem.store(p_t.to(dtype))
        ds_smem.store(ds_t)
        fence_async_shared()
        barrier()
        dv_tok = warpgroup_mma(p_smem, do_tile, dv, is_async=True)
    else:
        p_op = gl.convert_layout(p_t.to(dtype), op_layout, assert_trivial=True)
        dv_tok = warpgroup_mma(p_op, do_tile, dv, is_async=True)
        ds_smem.store(ds_t)
        fence_async_shared()
        barrier()
    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_tile,
                           gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
    dk_tok = warpgroup_mma(ds_smem, q_tile, dk, is_async=True)
    return dv_tok, dq_tok, dk_tok


@gluon.jit
def steps_ss(st, dk, dv, cfg):
    """The step loop with ``dK += dS^T Q`` read from shared memory (after ``dQ`` in the queue)
    -> ``(dk, dv)``.

    One step body for the dense and the flex backward (public: both kernels' consumers call
    it, :func:`solattn.kernels.hopper.flex_backward._consumer` at ``LOOKAHEAD`` 1): ``st`` is
    the kernel's step bundle (:class:`BwdStep`, or
    :class:`solattn.kernels.hopper.flex_backward.FlexBwdStep`), whose methods are the walker
    (``at``: which query block a step runs; band range or BlockMask list) and the score
    transform (``score_args``, ``issue_s``, ``softmax``; dense: softcap, ALiBi, the band; flex:
    the traced mods), and ``finish_dq``; the rings and tiles it reads are its fields. ``cfg``
    gives ``HEAD_DIM``, ``BLOCK_M``, ``BLOCK_N``, ``STAGES`` and ``LOOKAHEAD``."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    STAGES: gl.constexpr = cfg.STAGES
    LOOKAHEAD: gl.constexpr = cfg.LOOKAHEAD
    s_layout: gl.constexpr = acc_layout(BLOCK_N, BLOCK_M)
    kv_layout: gl.constexpr = acc_layout(BLOCK_N, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dq_layout: gl.constexpr = acc_layout(BLOCK_M, HEAD_DIM)
    s_t = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dp_t = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    # (the step's dropout draws, drawn one step ahead: st.draw; 0 without dropout)
    bits = st.draw(st.at(0, cfg), cfg)
    if st.total > 0:
        where = st.at(0, cfg)
        s_tok = st.issue_s(0, where, st.score_args(where, cfg), cfg)
        dp_tok = issue_dp(st.v_tile, st.do_smem, st.delta_smem, st.do_ready, 0, HEAD_DIM, BLOCK_M,
                           BLOCK_N, STAGES)
        s_t, dp_t = mma_wait(0, (s_tok, dp_tok), cfg.LOCAL_SYNC)
    for t in range(0, st.total):
        where = st.at(t, cfg)
        slot, _ = ring_slot(t, STAGES)
        q_tile = st.q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do_tile = st.do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        p_t, ds_t = st.softmax(s_t, dp_t, slot, bits, where, st.score_args(where, cfg), cfg)
        # dQ before dK: LOOKAHEAD 1 waits for dV and dQ, stages dQ, then issues S^T under dK.
        dv_tok, dq_tok, dk_tok = issue_grads_ss(p_t, ds_t, st.k_tile, q_tile, do_tile, st.ds_smem,
                                                dk, dv, op_layout, dq_layout, HEAD_DIM, BLOCK_M,
                                                BLOCK_N)
        if t + 1 < st.total:
            # LOOKAHEAD: how much of step t + 1 runs under this step's dK and dQ epilogue.
            # 2: S^T and dP^T issued before the wait (their accumulators beside dQ's, dK's and
            # dV's: spills at d=128); 1: S^T issued once dQ is staged, under dK; 0: none.
            nxt = st.at(t + 1, cfg)
            next_xf = st.score_args(nxt, cfg)
            if LOOKAHEAD == 2:
                s_tok = st.issue_s(t + 1, nxt, next_xf, cfg)
                dp_tok = issue_dp(st.v_tile, st.do_smem, st.delta_smem, st.do_ready, t + 1,
                                   HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)
                dv, dq, dk = mma_wait(2, (dv_tok, dq_tok, dk_tok), cfg.LOCAL_SYNC)
                consumer_arrive(st.qdo_empty.index(slot), cfg.LOCAL_SYNC)
                st.finish_dq(dq, where, t, cfg)
                bits = st.draw(nxt, cfg)
                s_t, dp_t = mma_wait(0, (s_tok, dp_tok), cfg.LOCAL_SYNC)
            elif LOOKAHEAD == 1:
                dv, dq = mma_wait(1, (dv_tok, dq_tok), cfg.LOCAL_SYNC)
                st.finish_dq(dq, where, t, cfg)
                # (here only dK and dV hold registers)
                bits = st.draw(nxt, cfg)
                s_tok = st.issue_s(t + 1, nxt, next_xf, cfg)
                dk = mma_wait(1, (dk_tok,), cfg.LOCAL_SYNC)
                consumer_arrive(st.qdo_empty.index(slot), cfg.LOCAL_SYNC)
                dp_tok = issue_dp(st.v_tile, st.do_smem, st.delta_smem, st.do_ready, t + 1,
                                   HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)
                s_t, dp_t = mma_wait(0, (s_tok, dp_tok), cfg.LOCAL_SYNC)
            else:
                dv, dq, dk = mma_wait(0, (dv_tok, dq_tok, dk_tok), cfg.LOCAL_SYNC)
                consumer_arrive(st.qdo_empty.index(slot), cfg.LOCAL_SYNC)
                st.finish_dq(dq, where, t, cfg)
                bits = st.draw(nxt, cfg)
                s_tok = st.issue_s(t + 1, nxt, next_xf, cfg)
                dp_tok = issue_dp(st.v_tile, st.do_smem, st.delta_smem, st.do_ready, t + 1,
                                   HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)
                s_t, dp_t = mma_wait(0, (s_tok, dp_tok), cfg.LOCAL_SYNC)
        else:
            dv, dq, dk = mma_wait(0, (dv_tok, dq_tok, dk_tok), cfg.LOCAL_SYNC)
            consumer_arrive(st.qdo_empty.index(slot), cfg.LOCAL_SYNC)
            st.finish_dq(dq, where, t, cfg)
            # Fresh values, not this step's: yielding those would keep them live all along.
            s_t = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
            dp_t = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
            bits = bits * 0

    return dk, dv


@gluon.jit
def _steps_rs(st, dk, dv, cfg):
    """The step loop with ``dK += dS^T Q`` from registers -> ``(dk, dv)`` (``st``, ``cfg``:
    :func:`steps_ss`).

    Per step the queue is ``dV``, ``dK`` (both ``A`` from registers, issued before ``dS^T``
    goes to shared memory, so the store, fence and ``bar.sync`` run under them), then
    ``dQ = dS K`` (``A`` = the transposed view of ``dS^T`` in shared memory). Step ``t + 1``'s
    ``S^T`` and ``dP^T`` are issued at the end of step ``t`` and waited at the top of ``t + 1``
    (their tokens are carried across the iteration). Not with :func:`p_in_smem`: ``dS^T``
    and ``P^T`` are then no warpgroup's whole rows.
    """
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    STAGES: gl.constexpr = cfg.STAGES
    LOOKAHEAD: gl.constexpr = cfg.LOOKAHEAD
    gl.static_assert(not p_in_smem(BLOCK_N), "dK from registers needs 128 keys")
    s_layout: gl.constexpr = acc_layout(BLOCK_N, BLOCK_M)
    kv_layout: gl.constexpr = acc_layout(BLOCK_N, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dq_layout: gl.constexpr = acc_layout(BLOCK_M, HEAD_DIM)
    dtype: gl.constexpr = st.k_tile.dtype
    s_tok = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout))
    dp_tok = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout))
    bits = st.draw(st.at(0, cfg), cfg)  # (as steps_ss')
    if st.total > 0:
        where = st.at(0, cfg)
        s_tok = st.issue_s(0, where, st.score_args(where, cfg), cfg)
        dp_tok = issue_dp(st.v_tile, st.do_smem, st.delta_smem, st.do_ready, 0, HEAD_DIM, BLOCK_M,
                           BLOCK_N, STAGES)
    for t in range(0, st.total):
        where = st.at(t, cfg)
        slot, _ = ring_slot(t, STAGES)
        q_tile = st.q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do_tile = st.do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        s_t, dp_t = mma_wait(0, (s_tok, dp_tok), cfg.LOCAL_SYNC)
        p_f, ds_f = st.softmax(s_t, dp_t, slot, bits, where, st.score_args(where, cfg), cfg)
        ds_t = ds_f.to(dtype)
        p_op = gl.convert_layout(p_f.to(dtype), op_layout, assert_trivial=True)
        dv_tok = warpgroup_mma(p_op, do_tile, dv, is_async=True)
        ds_op = gl.convert_layout(ds_t, op_layout, assert_trivial=True)
        dk_tok = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        # dS^T through shared memory for dQ = dS K only (its transposed view; the warpgroups
        # split dQ's rows or columns, acc_layout, and each reads both warpgroups' keys:
        # bar.sync). One buffer: the previous step's dQ finished at its wait.
        st.ds_smem.store(ds_t)
        fence_async_shared()
        barrier()
        dq_tok = warpgroup_mma(st.ds_smem.permute((1, 0)), st.k_tile,
                               gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout),
                               use_acc=False, is_async=True)
        if t + 1 < st.total:
            # LOOKAHEAD: 2: S^T, dP^T of t + 1 issued behind dQ, before any wait; 1: S^T
            # issued once dV and dK are done (beside dQ in flight), dP^T once dQ is staged;
            # 0: both after dQ is staged.
            nxt = st.at(t + 1, cfg)
            next_xf = st.score_args(nxt, cfg)
            if LOOKAHEAD == 2:
                s_tok = st.issue_s(t + 1, nxt, next_xf, cfg)
                dp_tok = issue_dp(st.v_tile, st.do_smem, st.delta_smem, st.do_ready, t + 1,
                                   HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)
                dv, dk, dq, p_op, ds_op = mma_wait(
                    2, (dv_tok, dk_tok, dq_tok, p_op, ds_op), cfg.LOCAL_SYNC)
                consumer_arrive(st.qdo_empty.index(slot), cfg.LOCAL_SYNC)
                st.finish_dq(dq, where, t, cfg)
                bits = st.draw(nxt, cfg)
            elif LOOKAHEAD == 1:
                dv, dk, p_op, ds_op = mma_wait(1, (dv_tok, dk_tok, p_op, ds_op), cfg.LOCAL_SYNC)
                consumer_arrive(st.qdo_empty.index(slot), cfg.LOCAL_SYNC)
                s_tok = st.issue_s(t + 1, nxt, next_xf, cfg)
                dq = mma_wait(1, (dq_tok,), cfg.LOCAL_SYNC)
                st.finish_dq(dq, where, t, cfg)
                bits = st.draw(nxt, cfg)
                dp_tok = issue_dp(st.v_tile, st.do_smem, st.delta_smem, st.do_ready, t + 1,
                                   HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)
            else:
                dv, dk, dq, p_op, ds_op = mma_wait(
                    0, (dv_tok, dk_tok, dq_tok, p_op, ds_op), cfg.LOCAL_SYNC)
                consumer_arrive(st.qdo_empty.index(slot), cfg.LOCAL_SYNC)
                st.finish_dq(dq, where, t, cfg)
                bits = st.draw(nxt, cfg)
                s_tok = st.issue_s(t + 1, nxt, next_xf, cfg)
                dp_tok = issue_dp(st.v_tile, st.do_smem, st.delta_smem, st.do_ready, t + 1,
                                   HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)
        else:
            dv, dk, dq, p_op, ds_op = mma_wait(
                0, (dv_tok, dk_tok, dq_tok, p_op, ds_op), cfg.LOCAL_SYNC)
            consumer_arrive(st.qdo_empty.index(slot), cfg.LOCAL_SYNC)
            st.finish_dq(dq, where, t, cfg)
            s_tok = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout))
            dp_tok = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout))
            bits = bits * 0
    return dk, dv


@gluon.jit
def store_dkdv(dk, dv, sm_scale, k_smem, v_smem, dk_desc, dv_desc, b, h, start_n):
    """The TMA epilogue of a CTA's key block: K's and V's buffers are dead once the last step
    waited for its products, so ``dK * scale`` and ``dV`` are staged there (the inputs' dtype)
    and leave by two TMA stores at ``[b, h, start_n, 0]`` of the outputs' ``(b, h, s, d)``
    views (128-byte writes; the descriptors clip the rows past the keys)."""
    k_smem.reshape(dk.shape).store((dk * sm_scale).to(k_smem.dtype))
    v_smem.reshape(dv.shape).store(dv.to(v_smem.dtype))
    fence_async_shared()
    tma_store(dk_desc, [b, h, start_n, 0], k_smem)
    tma_store(dv_desc, [b, h, start_n, 0], v_smem)
    tma.store_wait(0)


@gluon.jit
def _consumer(smem, out, prob, cfg):
    """Two warpgroups: the CTA's keys against every query block of every query head of the
    group, software-pipelined by one product pair (:func:`steps_ss` or :func:`_steps_rs`);
    then ``dK``, ``dV`` to global: by TMA (:func:`store_dkdv`; ``TMA_EPILOGUE``: unsplit, not
    varlen), else from registers. The transposed band's
    flags: an upper bound on the keys (causal) bounds the queries from below (``T_HAS_LOWER =
    HAS_UPPER``). ALiBi: the slopes of the CTA's batch entry (or sequence) at ``ALIBI + entry *
    alibi_sb + head * alibi_sh``.
    """
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    seqlen_q = prob.seqlen_q
    seqlen_k = prob.seqlen_k
    s_layout: gl.constexpr = acc_layout(BLOCK_N, BLOCK_M)
    kv_layout: gl.constexpr = acc_layout(BLOCK_N, HEAD_DIM)
    start_n, h_kv = _cta_tile(BLOCK_N, cfg.LPT)
    b, _, k_off, row_off, seqlen_q, seqlen_k = _sequence(
        gl.program_id(2), seqlen_q, seqlen_k, prob.CU_SEQLENS_Q, prob.CU_SEQLENS_K, BLOCK_M,
        cfg.IS_VARLEN)
    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    # Keys past the sequence (zeros in the TMA tile; varlen: the next sequence's keys) start
    # S^T at -inf: P = 0 there, in every block, with no mask (their P = exp(-lse) could
    # otherwise overflow).
    key_bias = gl.where(keys < seqlen_k, 0.0, float("-inf"))
    t_lower, t_upper, lo, full_lo, full_hi, hi = _query_range(
        start_n, seqlen_q, seqlen_k, prob.left, prob.right, BLOCK_N, BLOCK_M, cfg.HAS_LOWER,
        cfg.HAS_UPPER, cfg.IS_VARLEN)
    n_blk = gl.cdiv(hi - lo, BLOCK_M)
    rot = _stagger(start_n, n_blk, BLOCK_N, cfg.STAGGER)
    total = prob.group_size * n_blk
    alibi = 0
    if cfg.HAS_ALIBI:
        alibi = (prob.ALIBI + gl.program_id(2) * prob.alibi_sb, prob.alibi_sh, prob.alibi_unit)
    diag = seqlen_k - seqlen_q
    drop = 0
    sm_scale = prob.sm_scale
    if cfg.HAS_DROPOUT:  # (solattn.kernels.common.dropout_params' tuple, the head per step)
        drop = (gl.load(prob.SEED), gl.program_id(2), 0, prob.dropout_threshold,
                prob.dropout_scale)
        sm_scale = sm_scale * prob.dropout_scale
    k_tile = smem.k.reshape([BLOCK_N, HEAD_DIM])
    v_tile = smem.v.reshape([BLOCK_N, HEAD_DIM])

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(smem.kv_ready, 0)
    st = BwdStep(k_tile, v_tile, smem.q, smem.do, smem.ds, smem.lse, smem.delta, smem.dq,
                 smem.q_ready, smem.do_ready, smem.qdo_empty, smem.dq_ready, smem.dq_empty,
                 out.DQ, b, h_kv, prob.group_size, prob.num_heads, prob.seqlen_q_pad, row_off,
                 n_blk, lo, rot, total, keys, key_bias, full_lo, full_hi, t_lower, t_upper,
                 prob.qk_scale, prob.softcap_prescale, sm_scale, alibi, diag, drop, start_n)
    if cfg.DK_FROM_REGS:
        dk, dv = _steps_rs(st, dk, dv, cfg)
    else:
        dk, dv = steps_ss(st, dk, dv, cfg)
    if cfg.HAS_DROPOUT:
        dv = dv * prob.dropout_scale

    if cfg.TMA_EPILOGUE:
        store_dkdv(dk, dv, sm_scale, smem.k, smem.v, out.dk_desc, out.dv_desc, b, h_kv,
                   start_n)
    else:
        rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        offs = ((b * seqlen_k + k_off + rows) * prob.num_heads_kv + h_kv).to(gl.int64) * HEAD_DIM
        offs = offs[:, None] + cols[None, :]
        row_ok = (rows < seqlen_k)[:, None]
        DK = out.DK
        DV = out.DV
        gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=row_ok)
        gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=row_ok)


@gluon.jit
def bwd_buffers(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, HEAD_DIM: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                DQ_ROWS: gl.constexpr, DQ_PAD: gl.constexpr, DQ_VEC: gl.constexpr,
                WRITER_ROWS: gl.constexpr, ARRIVALS: gl.constexpr = 1,
                WRITERS: gl.constexpr = 1):
    """The shared memory and barriers of :func:`attn_bwd_kernel` (and of the flex backward's
    kernel, :mod:`solattn.kernels.hopper.flex_backward`), initialised -> ``(q, dO, K, V, dS^T,
    -lse column, -Delta column, dQ staging, kv_ready, dq_ready, dq_empty, q_ready, do_ready,
    qdo_empty)``. ``ARRIVALS``: the arrivals that complete a phase of ``dq_ready`` and
    ``qdo_empty`` (1, or one per consumer warp). ``WRITERS`` 2 (deterministic dQ): ``dq_ready``
    is a pair of barriers, one per writer warp."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                   rank=2)
    # dS^T (with p_in_smem: then P^T, in the rows after it)
    DS_ROWS: gl.constexpr = 2 * BLOCK_N if p_in_smem(BLOCK_N) else BLOCK_N
    ds_smem = gl.allocate_shared_memory(dtype, [DS_ROWS, BLOCK_M], ds_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape,
                                         lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape,
                                           delta_desc.layout)
    # dQ staging for the writer warp (fp32, DQ_ROWS = BLOCK_M rows of HEAD_DIM; a 1-row dummy
    # without it). The consumers store their accumulator with STS.64, one instruction covering
    # 8 rows x 32 bytes. DQ_PAD: each row padded by 32 bytes, so those 8 rows fall on 4 bank
    # groups (2
    # wavefronts, the minimum for 256 bytes) and the writer's rows stay contiguous (d=64: the
    # writer's 32 per-slice addresses do not fold into immediates, are hoisted and spill).
    # Else swizzled, DQ_VEC elements together, with a period of the writer's WRITER_ROWS (a
    # slice may not split it): DQ_VEC 2 permutes 8-byte groups inside 32 bytes, which leaves the
    # 8 rows on one bank group (ncu, H100: ~12-way conflicts, half of all shared-store
    # wavefronts); DQ_VEC 8 with 4 rows permutes 32-byte chunks: 4 bank groups, as DQ_PAD.
    if DQ_PAD:
        dq_layout: gl.constexpr = gl.PaddedSharedLayout.with_identity_for(
            [[HEAD_DIM, 8]], [DQ_ROWS, HEAD_DIM], [1, 0])
    else:
        dq_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=DQ_VEC, per_phase=1,
                                                          max_phase=WRITER_ROWS, order=[1, 0])
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_ROWS, HEAD_DIM], dq_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    kv_ready = kv_bar.index(0)
    dq_ready = kv_bar.index(1)
    dq_empty = kv_bar.index(2)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    if WRITERS == 2:  # (kv_bar's slot 1 then unused: the other builds' layout unchanged)
        dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(dq_ready.index(0), count=ARRIVALS)
        mbarrier.init(dq_ready.index(1), count=ARRIVALS)
    else:
        mbarrier.init(dq_ready, count=ARRIVALS)
    mbarrier.init(dq_empty, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=ARRIVALS)
    fence_async_shared()
    return (q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, dq_smem, kv_ready,
            dq_ready, dq_empty, q_ready, do_ready, qdo_empty)


# Lengths and counts are not specialized (divisibility by 16, == 1): one binary per config
# serves every shape. kv_splits is specialized on == 1 only (Triton turns an int argument equal
# to 1 into a constant): the unsplit build folds `h // 1` away, every split count shares the
# other binary.
@gluon.jit(do_not_specialize=["num_heads", "num_heads_kv", "seqlen_q", "seqlen_q_pad", "seqlen_k",
                              "group_size", "left", "right", "alibi_sb", "alibi_sh",
                              "dropout_threshold"],
           do_not_specialize_on_alignment=["kv_splits"])
def attn_bwd_kernel(
    q_desc, k_desc, v_desc, do_desc,  # rank-4 TMA descriptors over (b, h, s, d) views of BSHD
    lse_desc, delta_desc,             # rank-1 over (b, h, seqlen_q_pad) fp32: -lse/scale, -Delta
    dk_desc, dv_desc,                 # TMA_EPILOGUE: rank-4 over the (b, h_kv, s_k, d) views of
                                      # DK and DV (else K's and V's, unused)
    DQ,                               # (b, h, seqlen_q_pad, d) float32 accumulator, zeroed;
                                      # DETERMINISTIC: then b * h * seqlen_q_pad / 4 int32
                                      # turn counters, zeroed (turn_counters)
    DK, DV,                           # (b, s_k, num_heads_kv, d) contiguous (split: fp32)
    CU_SEQLENS_Q, CU_SEQLENS_K,       # (b + 1,) int32, varlen only: sequence starts
    ALIBI,                            # float32 slopes (HAS_ALIBI only), (h,) or (b, h)
    SEED,                             # dropout's (1,) int64 seed (HAS_DROPOUT only)
    # varlen: seqlen_q / seqlen_k are the packed totals (b = 1 in the descriptors and DK/DV),
    # seqlen_q_pad = t_q + batch * (BLOCK_M + 4) rounded up to 4 (each sequence's buffer rows
    # padded: varlen_row_offset).
    # GQA split (kv_splits > 1): the grid's head index j runs over num_heads_kv = h_kv *
    # kv_splits; CTA j reads K/V head j // kv_splits, runs the query heads j * group_size + i
    # (group_size = the group's size / kv_splits: part j % kv_splits of the group) and writes
    # its partial dK/dV at head j (fp32, summed by bwd_dkdv_reduce_kernel).
    num_heads, num_heads_kv, seqlen_q, seqlen_q_pad, seqlen_k, group_size, kv_splits, left,
    right, qk_scale, softcap_prescale, sm_scale,
    alibi_unit, alibi_sb, alibi_sh,   # ALiBi: slopes' units (LOG2E / qk_scale) and strides
    dropout_threshold, dropout_scale,  # round(dropout_p * 2**31), 1 / (1 - dropout_p)
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    IS_VARLEN: gl.constexpr, LOOKAHEAD: gl.constexpr, DQ_WRITER: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, DK_FROM_REGS: gl.constexpr, DQ_PAD: gl.constexpr,
    DQ_VEC: gl.constexpr, WRITER_ROWS: gl.constexpr, LPT: gl.constexpr,
    STAGGER: gl.constexpr = False, HAS_ALIBI: gl.constexpr = False,
    TMA_EPILOGUE: gl.constexpr = False, DETERMINISTIC: gl.constexpr = False,
    LOCAL_SYNC: gl.constexpr = False, HAS_DROPOUT: gl.constexpr = False,
):
    # Grid: (key blocks of BLOCK_N, num_heads_kv, batch), LPT: (num_heads_kv, key blocks,
    # batch) (varlen: of the longest key sequence). With a causal band the first key blocks see
    # the most queries and start first (LPT: those of every head). The consumers (the default
    # partition) get the registers the producer's setmaxnreg leaves.
    # DETERMINISTIC: the writer warp adds dQ in key-block order (module docstring), in the
    # walk order of _step_coords(ORDERED) that keeps the CTAs of a head in step.
    # LOCAL_SYNC (Triton >= 3.9): the consumers arrive on dq_ready and qdo_empty once per warp
    # (their count: CONSUMER_WARPS) and wait for their own warpgroup's wgmmas only (compat:
    # warp_arrive, mma_wait), without a 256-thread bar.sync after either.
    gl.static_assert(DQ_WRITER or not DETERMINISTIC, "deterministic dQ needs the writer warp")
    gl.static_assert(not (STAGGER and DETERMINISTIC), "deterministic dQ walks unstaggered")
    gl.static_assert(STAGES > 1 or LOOKAHEAD == 0, "one stage: step t + 1's tiles load into "
                     "the slot step t frees at its end (LOOKAHEAD 0)")
    DQ_ROWS: gl.constexpr = BLOCK_M if DQ_WRITER else 1
    (q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, dq_smem, kv_ready,
     dq_ready, dq_empty, q_ready, do_ready, qdo_empty) = bwd_buffers(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, HEAD_DIM, BLOCK_M, BLOCK_N,
        STAGES, DQ_ROWS, DQ_PAD, DQ_VEC, WRITER_ROWS, CONSUMER_WARPS if LOCAL_SYNC else 1,
        2 if DETERMINISTIC else 1)

    smem = BwdSmem(q_smem, k_smem, v_smem, do_smem, ds_smem, lse_smem, delta_smem, dq_smem,
                   kv_ready, q_ready, do_ready, qdo_empty, dq_ready, dq_empty)
    out = BwdOut(dk_desc, dv_desc, DQ, DK, DV)
    prob = BwdProblem(CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI, num_heads, num_heads_kv, seqlen_q,
                      seqlen_q_pad, seqlen_k, group_size, left, right, qk_scale, softcap_prescale,
                      sm_scale, alibi_unit, alibi_sb, alibi_sh, SEED, dropout_threshold,
                      dropout_scale)
    cfg = BwdConsts(HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP,
                    IS_VARLEN, LOOKAHEAD, DQ_WRITER, DK_FROM_REGS, LPT, STAGGER, HAS_ALIBI,
                    TMA_EPILOGUE, DETERMINISTIC, LOCAL_SYNC, HAS_DROPOUT)
    # (Partition lists are written out in full: Gluon takes no tuple built in the kernel.)
    if DETERMINISTIC:  # two writer warps: steps of even and odd t (_dq_writer_ordered)
        warp_specialize([
            (_consumer, (smem, out, prob, cfg)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, smem, prob,
                         kv_splits, cfg)),
            (_dq_writer, (smem, out, prob, cfg, WRITER_ROWS, 0)),
            (_dq_writer, (smem, out, prob, cfg, WRITER_ROWS, 1)),
        ], [1, 1, 1], [PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    elif DQ_WRITER:
        warp_specialize([
            (_consumer, (smem, out, prob, cfg)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, smem, prob,
                         kv_splits, cfg)),
            (_dq_writer, (smem, out, prob, cfg, WRITER_ROWS)),
        ], [1, 1], [PRODUCER_REGS, PRODUCER_REGS])
    else:
        warp_specialize([
            (_consumer, (smem, out, prob, cfg)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, smem, prob,
                         kv_splits, cfg)),
        ], [1], [PRODUCER_REGS])
