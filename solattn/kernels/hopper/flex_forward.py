"""FlexAttention forward on Hopper (sm_90a): the warp-specialized pipeline of
:mod:`solattn.kernels.hopper.forward` walking a BlockMask's key-block lists, with the traced
``score_mod`` / ``mask_mod`` (:mod:`solattn.flex.codegen`) inlined into the consumers' softmax.

One CTA owns one BlockMask query block (``2 * BLOCK_M = 128`` rows, one per consumer warpgroup
half) of one (batch, head); its key blocks are the BlockMask's, one ``BLOCK_N = 128`` ring slot
each::

    producer (1 warp)                     consumer WG0 / WG1 (4 warps each, BLOCK_M rows)
    TMA Q0, Q1                            for t in partial blocks, then full blocks:
    for t in partial, then full blocks:     S = Q K^T; score_mod(S * scale) on every block;
      TMA K_t, V_t into ring slot t % S      mask_mod and the key bounds on partial blocks only;
                                             online softmax; O += P V (overlapped as forward.py)
                                          O / l -> Q's smem tile -> TMA store; LSE -> global

Calls with 64-key tiles whose BlockMask lists few key blocks a query block (short tiles: packed
documents) run half-block CTAs instead: one consumer warpgroup, 64 rows, two CTAs an SM, so one
CTA's set-up and epilogue overlap the other's products (``CONSUMERS = 1``,
:data:`solattn.configs.hopper_flex_forward.HALF_CTA_MAX_BLOCKS`).

Both roles read the same lists (``kv_num_blocks`` / ``kv_indices``, then ``full_kv_*``), so
ring use ``kv_it + t`` is block ``t`` for both. The first block of a tile (the pipeline's
prologue) always runs masked; where the tile has no partial block that is a full block, on which
``mask_mod`` is True everywhere, so the result is the same. Rows are the query indices clamped to
the sequence (a ragged last query block's padding rows are never stored), keys of partial blocks
the key indices clamped likewise and masked past ``seqlen_k``; full blocks lie inside both
sequences (:func:`solattn.flex.block_mask.kernel_lists`).

Partial blocks without a score_mod carry their mask in ``S``'s accumulator: it starts at 0 where
the key is seen and -inf elsewhere (:meth:`FlexStep.s_init`, evaluated before the step waits for
its operands, so a mask_mod's loads of captured tensors land under the wgmmas), and the wgmma
adds ``Q K^T`` to it. With a score_mod the mask applies after it, to the modified scores.

Softmax units: without a score_mod, ``m`` is kept in raw ``q.k`` units and ``qk_scale = scale *
log2(e)`` (as forward.py); with one, the consumer computes ``score_mod(q.k * scale)`` and
``qk_scale = log2(e)``. A row whose scores are all ``-inf`` so far (masked, or a score_mod's
``-inf``) keeps ``m = -inf`` and subtracts 0, so ``p = alpha = 0`` rather than NaN.

Each key block is the forwards' shared step (:func:`solattn.kernels.hopper.step.kv_step`) with
this module's score transform (:class:`FlexStep`); the rings are
:mod:`solattn.kernels.hopper.pipeline`'s.

This module holds the device code only: the host side (coverage, plans, the mod-spill check,
launch) is :mod:`solattn.kernels.hopper.flex_forward_plan`, the tiles and half-block thresholds
:mod:`solattn.configs.hopper_flex_forward`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)

from solattn.kernels.common import LN2, sparse_blocks, sparse_index
from solattn.kernels.hopper.compat import Value, bundle, tma_store, warp_specialize
from solattn.kernels.hopper.pipeline import (
    release,
    ring_load,
    ring_slot,
    wait_empty,
    wait_ready,
)
from solattn.kernels.hopper.step import kv_step, p_operand

# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------

@bundle
class FlexSmem:
    """One CTA's shared memory and barriers: Q, one slot per consumer warpgroup (loaded once:
    the CTA's only tile), and the ``STAGES``-deep K and V rings (:mod:`pipeline`)."""
    q: gl.shared_memory_descriptor        # [CONSUMERS, 1, 1, BLOCK_M, HEAD_DIM]
    k: gl.shared_memory_descriptor        # [STAGES, 1, 1, BLOCK_N, HEAD_DIM]
    v: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor


@bundle
class FlexProblem:
    """The call: the BlockMask's lists, the mods' captured tensors, sizes and scales."""
    KV_LIST: Value                        # BlockMask lists, kv-major (common.sparse_blocks)
    FULL_KV_LIST: Value
    SCORE_ARGS: Value                     # the mods' captured tensors (flex/codegen.py)
    MASK_ARGS: Value
    n_t: gl.tensor                        # tiles a head
    num_heads: gl.tensor
    group_size: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    sm_scale: gl.tensor
    qk_scale: Value                       # LOG2E (a constexpr) with a score_mod


@bundle
class FlexConsts:
    """The kernel's constexprs (:func:`attn_fwd_flex_kernel`'s comments); ``HEAD_DIM_V`` and
    ``FP8`` as :func:`solattn.kernels.hopper.step.kv_step` reads them."""
    HEAD_DIM: gl.constexpr
    HEAD_DIM_V: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    SPARSE_N: gl.constexpr
    SCORE_MOD: gl.constexpr
    MASK_MOD: gl.constexpr
    CONSUMERS: gl.constexpr
    FP8: gl.constexpr


@bundle
class FlexStep:
    """The flex consumer's step bundle (:func:`solattn.kernels.hopper.step.kv_step`): its Q
    tile, the K / V rings, its rows (clamped to the sequence), the (batch, head) the mods see,
    the scales and the mods' captured tensors. Its score transform: the traced ``score_mod`` and
    ``mask_mod`` (``cfg.SCORE_MOD`` / ``cfg.MASK_MOD``) and the key bounds; without a score_mod
    a partial block's mask is carried in ``S`` (``MASK_IN_S``: :meth:`s_init`)."""
    q_tile: gl.shared_memory_descriptor   # [BLOCK_M, HEAD_DIM]
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    rows: gl.tensor
    seqlen_k: gl.tensor
    b: gl.tensor
    h: gl.tensor
    sm_scale: gl.tensor
    qk_scale: Value
    SCORE_ARGS: Value
    MASK_ARGS: Value
    MASK_IN_S: gl.constexpr               # no score_mod: S starts from a partial block's mask

    @gluon.jit
    def s_init(self, start_n, s_layout: gl.constexpr, cfg, MASKED: gl.constexpr):
        """``S``'s starting accumulator (the wgmma adds ``Q K^T`` to it where ``MASKED and
        MASK_IN_S``, else ignores it). For a partial block without a score_mod: 0 where the row
        sees the key (inside the sequence and, with a mask_mod, where it is True), -inf
        elsewhere, so the softmax after the product applies no mask, and the mask_mod -- with
        its loads of captured tensors -- runs before the step waits for its operands rather
        than between the product and the softmax. Otherwise zeros (a score_mod sees the
        unmasked score)."""
        BLOCK_M: gl.constexpr = cfg.BLOCK_M
        BLOCK_N: gl.constexpr = cfg.BLOCK_N
        MASK_MOD: gl.constexpr = cfg.MASK_MOD
        if not MASKED or cfg.SCORE_MOD is not None:
            return gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        seqlen_k = self.seqlen_k
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        col_bias = gl.where(cols < seqlen_k, 0.0, float("-inf"))[None, :]
        if MASK_MOD is not None:
            keep = MASK_MOD(self.b, self.h, self.rows[:, None],
                            gl.minimum(cols, seqlen_k - 1)[None, :], self.MASK_ARGS)
            col_bias = gl.where(keep, col_bias, float("-inf"))
        # a mask_mod may vary over one axis only: broadcast to the tile (no instructions)
        return gl.broadcast(col_bias, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout))[0]

    @gluon.jit
    def softmax(self, qk, m_i, l_i, start_n, cfg, MASKED: gl.constexpr):
        """Online softmax of one ``[BLOCK_M, BLOCK_N]`` tile with the mods -> ``(p, alpha, m,
        l)`` (``m`` in score units: raw ``q.k`` without a score_mod, else the score_mod's)."""
        SCORE_MOD: gl.constexpr = cfg.SCORE_MOD
        MASK_MOD: gl.constexpr = cfg.MASK_MOD
        seqlen_k = self.seqlen_k
        qk_scale = self.qk_scale
        cols = start_n + gl.arange(0, cfg.BLOCK_N, layout=gl.SliceLayout(0, qk.type.layout))
        if MASKED:
            mod_cols = gl.minimum(cols, seqlen_k - 1)
        else:
            mod_cols = cols
        if SCORE_MOD is not None:
            qk = SCORE_MOD(qk * self.sm_scale, self.b, self.h, self.rows[:, None],
                           mod_cols[None, :], self.SCORE_ARGS)
        if MASKED and SCORE_MOD is not None:  # (without a score_mod S holds the mask: s_init)
            mask = cols[None, :] < seqlen_k
            if MASK_MOD is not None:
                mask = mask & MASK_MOD(self.b, self.h, self.rows[:, None], mod_cols[None, :],
                                       self.MASK_ARGS)
            qk = gl.where(mask, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        m_scaled = m_new * qk_scale
        if MASKED or SCORE_MOD is not None:
            m_scaled = gl.where(m_new == float("-inf"), 0.0, m_scaled)
        p = gl.exp2(qk * qk_scale - m_scaled[:, None])
        alpha = gl.exp2(m_i * qk_scale - m_scaled)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i


@gluon.jit
def _tile_coords(tile, prob, cfg):
    """``(b, h, h_kv, pid_m, q_row)`` of tile ``tile`` (one CTA each, ``CONSUMERS * BLOCK_M``
    query rows from ``q_row``, ``n_t`` tiles a head): rows fastest, in reverse (the last query
    blocks of causal-like masks list the most key blocks: longest first). ``pid_m`` is the
    BlockMask query block (``2 * BLOCK_M`` rows) holding the tile."""
    n_t = prob.n_t
    pid_t = n_t - 1 - tile % n_t
    hb = tile // n_t
    h = hb % prob.num_heads
    q_row = pid_t * cfg.CONSUMERS * cfg.BLOCK_M
    return hb // prob.num_heads, h, h // prob.group_size, (pid_t * cfg.CONSUMERS) // 2, q_row


@gluon.jit
def _flex_producer(q_desc, k_desc, v_desc, smem, prob, cfg):
    """One warp: the tile's Q tiles (one per consumer, each loaded once: the CTA's only tile),
    then K_t and V_t of every listed key block (partial blocks, then full ones) into the ring
    as slots free up."""
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    SPARSE_N: gl.constexpr = cfg.SPARSE_N
    b, h, h_kv, pid_m, q_row = _tile_coords(gl.program_id(0), prob, cfg)
    for wg in gl.static_range(cfg.CONSUMERS):
        ring_load(q_desc, [b, h, q_row + wg * cfg.BLOCK_M, 0], smem.q, smem.q_ready, wg)
    n_part, idx_part = sparse_blocks(prob.KV_LIST, b, h, pid_m)
    n_full, idx_full = sparse_blocks(prob.FULL_KV_LIST, b, h, pid_m)
    SUB: gl.constexpr = SPARSE_N // BLOCK_N
    n_blocks = gl.cdiv(prob.seqlen_k, SPARSE_N)  # the lists' indices clamped into these
    for t in range(0, (n_part + n_full) * SUB):
        u = t // SUB
        if u < n_part:
            start_n = sparse_index(idx_part, u, n_blocks) * SPARSE_N + (t % SUB) * BLOCK_N
        else:
            start_n = (sparse_index(idx_full, u - n_part, n_blocks) * SPARSE_N
                       + (t % SUB) * BLOCK_N)
        slot, parity = ring_slot(t, cfg.STAGES)
        wait_empty(smem.k_empty, slot, parity)
        ring_load(k_desc, [b, h_kv, start_n, 0], smem.k, smem.k_ready, slot)
        wait_empty(smem.v_empty, slot, parity)
        ring_load(v_desc, [b, h_kv, start_n, 0], smem.v, smem.v_ready, slot)


@gluon.jit
def _flex_consumer(WG: gl.constexpr, smem, o_desc, LSE, prob, cfg):
    """One warpgroup: rows ``[WG * BLOCK_M, (WG + 1) * BLOCK_M)`` of the CTA's tile against
    the listed key blocks of its BlockMask query block (partial blocks masked, then full ones,
    each a :func:`solattn.kernels.hopper.step.kv_step`); then ``O / l`` through Q's buffer and
    a TMA store, and the LSE (natural log; rows that saw no key: O = 0, LSE = -inf)."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    SPARSE_N: gl.constexpr = cfg.SPARSE_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    seqlen_q = prob.seqlen_q
    qk_scale = prob.qk_scale

    b, h, _, pid_m, q_row = _tile_coords(gl.program_id(0), prob, cfg)
    row_start = q_row + WG * BLOCK_M
    rows_raw = row_start + gl.arange(0, BLOCK_M, layout=row_layout)
    rows = gl.minimum(rows_raw, seqlen_q - 1)  # the mods see padded rows as the last row
    n_part, idx_part = sparse_blocks(prob.KV_LIST, b, h, pid_m)
    n_full, idx_full = sparse_blocks(prob.FULL_KV_LIST, b, h, pid_m)
    SUB: gl.constexpr = SPARSE_N // BLOCK_N  # ring uses (key tiles) per listed block
    # Each listed index is clamped into the sequence's key blocks (common.sparse_index, issue
    # 39), as the producer's: the mods' key indices stay inside their tensors.
    n_blocks = gl.cdiv(prob.seqlen_k, SPARSE_N)
    n_part_t = n_part * SUB
    total = (n_part + n_full) * SUB
    q_tile = smem.q.index(WG).reshape([BLOCK_M, HEAD_DIM])
    st = FlexStep(q_tile, smem.k, smem.v, smem.k_ready, smem.k_empty, smem.v_ready, smem.v_empty,
                  rows, prob.seqlen_k, b, h, prob.sm_scale, qk_scale, prob.SCORE_ARGS,
                  prob.MASK_ARGS, cfg.SCORE_MOD is None)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    wait_ready(smem.q_ready, WG, 0)
    if total > 0:
        # Prologue: block 0, no P V to overlap yet (masked: see the module docstring).
        if n_part > 0:
            start_n = sparse_index(idx_part, 0, n_blocks) * SPARSE_N
        else:
            start_n = sparse_index(idx_full, 0, n_blocks) * SPARSE_N
        s_acc = st.s_init(start_n, s_layout, cfg, True)
        wait_ready(smem.k_ready, 0, 0)
        k_t = smem.k.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        qk = warpgroup_mma(q_tile, k_t, s_acc, use_acc=st.MASK_IN_S)
        release(smem.k_empty, 0)
        p_f32, alpha, m_i, l_i = st.softmax(qk, m_i, l_i, start_n, cfg, True)
        p_dtype: gl.constexpr = q_tile.dtype
        p = p_operand(p_f32, p_dtype, p_layout, BLOCK_M, BLOCK_N, False)
        for t in range(1, n_part_t):
            o, p, alpha, m_i, l_i = kv_step(
                st, o, p, alpha, m_i, l_i, t,
                sparse_index(idx_part, t // SUB, n_blocks) * SPARSE_N + (t % SUB) * BLOCK_N,
                cfg, True)
        for t in range(gl.maximum(n_part_t, 1), total):
            o, p, alpha, m_i, l_i = kv_step(
                st, o, p, alpha, m_i, l_i, t,
                sparse_index(idx_full, t // SUB - n_part, n_blocks) * SPARSE_N
                + (t % SUB) * BLOCK_N, cfg, False)
        # Tail: P V of the last block.
        last, last_parity = ring_slot(total - 1, cfg.STAGES)
        o = o * gl.convert_layout(alpha, o_rows_layout, assert_trivial=True)[:, None]
        wait_ready(smem.v_ready, last, last_parity)
        o = warpgroup_mma(p, smem.v.index(last).reshape([BLOCK_N, HEAD_DIM]), o)
        release(smem.v_empty, last)

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    o = o / gl.convert_layout(l_safe, o_rows_layout, assert_trivial=True)[:, None]
    lse = gl.where(empty, float("-inf"), (m_i * qk_scale + gl.log2(l_safe)) * LN2)
    gl.store(LSE + ((b * prob.num_heads + h) * seqlen_q + rows_raw), lse,
             mask=rows_raw < seqlen_q)
    # The CTA's only tile: Q's buffer is dead, stage O there for one TMA store (rows past the
    # sequence fall outside the descriptor and are not written).
    q_tile.store(o.to(q_tile.dtype))
    fence_async_shared()
    tma_store(o_desc, [b, h, row_start, 0], smem.q.index(WG))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["n_m", "num_heads", "seqlen_q", "seqlen_k", "group_size"])
def attn_fwd_flex_kernel(
    q_desc, k_desc, v_desc, o_desc,   # rank-4 TMA descriptors over (b, h, s, d) views
    LSE,                              # (b, h, s_q) float32 contiguous
    KV_LIST, FULL_KV_LIST,            # BlockMask lists, kv-major (common.sparse_blocks)
    SCORE_ARGS, MASK_ARGS,            # the mods' captured tensors (flex/codegen.py)
    n_t, num_heads, seqlen_q, seqlen_k, group_size, sm_scale, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    SPARSE_N: gl.constexpr,           # the BlockMask's key block: SPARSE_N // BLOCK_N tiles each
    SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr,  # generated Gluon-callable mods, or None
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMERS: gl.constexpr,          # 2: a CTA per BlockMask query block; 1: per half of one
):
    """One CTA per tile (``CONSUMERS * BLOCK_M`` query rows) of each (head, batch): shared
    memory, barriers, and the warp-specialized partitions (module docstring)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape,
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    fence_async_shared()
    smem = FlexSmem(q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty)
    prob = FlexProblem(KV_LIST, FULL_KV_LIST, SCORE_ARGS, MASK_ARGS, n_t, num_heads, group_size,
                       seqlen_q, seqlen_k, sm_scale, qk_scale)
    cfg = FlexConsts(HEAD_DIM, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, SPARSE_N, SCORE_MOD, MASK_MOD,
                     CONSUMERS, False)
    if CONSUMERS == 2:
        warp_specialize([
            (_flex_consumer, (0, smem, o_desc, LSE, prob, cfg)),
            (_flex_consumer, (1, smem, o_desc, LSE, prob, cfg)),
            (_flex_producer, (q_desc, k_desc, v_desc, smem, prob, cfg)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        # Half a query block a CTA, two CTAs an SM (the launch's maxnreg, the ring's depth):
        # one CTA's tile set-up and epilogue run under the other's products.
        warp_specialize([
            (_flex_consumer, (0, smem, o_desc, LSE, prob, cfg)),
            (_flex_producer, (q_desc, k_desc, v_desc, smem, prob, cfg)),
        ], [1], [PRODUCER_REGS])
