"""FlexAttention backward on Hopper (sm_90a): the warp-specialized pipeline of
:mod:`solattn.kernels.hopper.backward` walking a BlockMask's q-major lists, with the traced
``mask_mod`` and ``score_mod`` and the score_mod's derivative (:mod:`solattn.flex.codegen`, their
Gluon twins) inlined into the consumers.

One CTA owns one BlockMask key block (``BLOCK_N = 128`` keys, 64 per consumer warpgroup) of one
*query* head (the grid is key blocks x query heads x batch: a BlockMask may differ per query
head); its steps are the query blocks the BlockMask lists for that key block, partial blocks
first, each ``SPARSE_M // BLOCK_M`` steps of ``BLOCK_M`` queries::

    producer (1 warp)              consumers (2 warpgroups)           dQ writer (1 warp)
    TMA K, V once                  per step (S^T = K Q^T, keys as rows):
    per step: TMA Q_i, -lse col,     mask_mod on partial blocks only;  per step: red.global.add
      dO_i, -Delta col               score_mod and its derivative      of the staged dQ_i rows
                                     on every block;
                                     dV += P^T dO, dK += dS^T Q, dQ_i = dS K
                                   dK * scale, dV -> K's, V's buffers -> TMA stores (GQA: fp32
                                   partials per query head from registers, summed by
                                   backward.bwd_dkdv_reduce_kernel)

The step body is the dense kernel's, :func:`solattn.kernels.hopper.backward._steps_ss` at
``LOOKAHEAD`` 1 (dK from shared memory: the shape both head dims measured within 5% of their best
dense variant), walking :class:`FlexBwdStep`: the BlockMask's lists instead of the band's block
range, and the mods instead of the band's masks:

- without a score_mod, ``S^T`` starts at the query's ``-lse / scale`` column plus the keys' bias
  (-inf past ``seqlen_k``) and, on partial blocks, -inf where ``mask_mod`` is False, so ``P^T =
  exp2(S^T * scale * log2 e)`` as in the dense kernel;
- with one, ``S^T`` starts at 0 (``q.k``): ``x = q.k * scale``, ``P^T = exp2(score_mod(x) * log2 e
  - lse * log2 e)`` (the column is staged in log2 units: the preprocess's ``lse_unit`` is ln 2,
  as for the dense kernel's softcap) with the keys' bias and the mask in the exponent, and ``dS^T
  = P^T * score_mod_bwd(x, grad = dP^T - Delta)`` (the same: the derivative is linear in
  ``grad``); where the score_mod's captured tensors require grad, ``score_mod_bwd(x, grad = P^T
  * (dP^T - Delta))`` also adds their gradients with fp32 atomics (as the portable kernels:
  not bitwise reproducible).

The mods see query and key indices clamped to the sequences (the portable kernels' rule); rows
past ``seqlen_q`` have ``lse = -inf`` from the preprocess kernel (``P = 0``). Dropout and
``@triton.jit`` mods run on the portable flex backward (:func:`covers`), as do mods whose code
does not fit the consumers' registers (:func:`prepare`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
)

from solattn.kernels.common import LOG2E, sparse_blocks, sparse_index
from solattn.kernels.hopper.backward import (
    CONSUMER_WARPS,
    PREPROCESS_ROWS,
    BwdSmem,
    _steps_ss,
    add_staged_dq,
    bwd_buffers,
    bwd_preprocess_kernel,
    cols_desc,
    dkdv_reduce_launch,
    fp32_workspace,
    hopper_bwd_config,
    rows_desc,
    stage_dq,
    store_dkdv,
    writer_layout,
    writer_offsets,
)
from solattn.kernels.hopper.compat import Value, bundle, warp_specialize
from solattn.kernels.hopper.flex_forward import hot_spill_bytes
from solattn.kernels.hopper.pipeline import (
    expect_load2,
    kept_decision,
    ring_load2,
    ring_slot,
    unsupported_operands,
    wait_empty,
    wait_ready,
)
from solattn.launch import Launch, PlanCache

SUPPORTED_HEAD_DIMS = (64, 128)
SPARSE_BLOCK = 128  # the BlockMask block this kernel walks: BLOCK_N keys, SPARSE_M // BLOCK_M steps
# setmaxnreg of the TMA and dQ-writer warps: their block-list walk (two 64-bit index pointers,
# the counts) needs more than the dense kernel's 40. The consumers keep 232 either way (the
# workers' warpgroup frees 4 x 32 x (168 - WORKER_REGS) registers, rounded to 8 per thread).
WORKER_REGS = 40
# Local-memory accesses inside the step loop that a mod may add and still run here (else the
# portable kernels run it): the gathered document ids at d=128 reload 6 values per step
# (`solattn aot`, triton 3.6), against ~1500 instructions a step.
HOT_RELOADS_ACCEPTED = 8


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------

@bundle
class FlexBwdProblem:
    """The call: the BlockMask's lists, the mods' captured tensors (and the gradients of the
    score_mod's), sizes, dK/dV strides and scales (:func:`attn_bwd_flex_kernel`'s comments)."""
    Q_LIST: Value
    FULL_Q_LIST: Value
    SCORE_ARGS: Value
    MASK_ARGS: Value
    GRADS: Value
    num_heads: Value
    seqlen_q: Value
    seqlen_q_pad: Value
    seqlen_k: Value
    group_size: Value
    stride_kb: Value
    stride_ks: Value
    stride_kh: Value
    qk_scale: Value
    sm_scale: Value


@bundle
class FlexBwdConsts:
    """The kernel's constexprs (:func:`attn_bwd_flex_kernel`'s comments)."""
    HEAD_DIM: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    SUB: gl.constexpr
    SCORE_MOD: gl.constexpr
    SCORE_BWD: gl.constexpr
    MASK_MOD: gl.constexpr
    ACCUMULATE: gl.constexpr
    TMA_EPILOGUE: gl.constexpr
    LOOKAHEAD: gl.constexpr               # backward._steps_ss's schedule: 1


@bundle
class FlexBwdStep:
    """The consumers' step bundle, walked by the dense backward's step loop
    (:func:`solattn.kernels.hopper.backward._steps_ss`): K's and V's tiles, the rings, their
    barriers and the dQ staging buffer; the walker's BlockMask lists (:meth:`at`); what the
    score transform reads (:func:`_issue_s`, :func:`_softmax`): the CTA's (batch, head), its
    keys (clamped for the mods) and their bias, the query length, the scales and the mods'
    tensors."""
    k_tile: gl.shared_memory_descriptor   # [BLOCK_N, HEAD_DIM]
    v_tile: gl.shared_memory_descriptor
    q_smem: gl.shared_memory_descriptor   # [STAGES, 1, 1, BLOCK_M, HEAD_DIM]
    do_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor  # [BLOCK_N, BLOCK_M]: dS^T
    lse_smem: gl.shared_memory_descriptor
    delta_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    qdo_empty: gl.shared_memory_descriptor
    dq_ready: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor
    total: Value                          # steps: SUB per listed query block
    n_part_t: Value                       # steps of the partial blocks (listed first)
    idx_part: Value                       # the key block's row of the BlockMask lists
    idx_full: Value
    n_blocks: Value                       # the sequence's query blocks (the lists' bound)
    b: Value
    h: Value
    mod_keys: gl.tensor
    key_bias: gl.tensor
    seqlen_q: Value
    sm_scale: Value
    qk_scale: Value
    SCORE_ARGS: Value
    MASK_ARGS: Value
    GRADS: Value

    # The step interface of backward._steps_ss (backward.BwdStep's methods).

    @gluon.jit
    def at(self, t, cfg):
        """Step ``t`` of the list walk -> ``(first query row, masked)``: partial blocks (the
        mask_mod applies) first, then full ones (:func:`_step_start`)."""
        start_m = _step_start(t, self.n_part_t, self.idx_part, self.idx_full, self.n_blocks,
                              cfg.SUB, cfg.BLOCK_M)
        return start_m, t < self.n_part_t

    @gluon.jit
    def score_args(self, where, cfg):
        """Nothing: the mods load what they read themselves."""
        return 0

    @gluon.jit
    def issue_s(self, t, where, xf, cfg):
        """Issue step ``t``'s ``S^T = K Q^T`` (:func:`_issue_s`) -> its token."""
        start_m, masked = where
        return _issue_s(self, t, start_m, masked, cfg)

    @gluon.jit
    def softmax(self, s_t, dp_t, lse_tile, where, xf, cfg):
        """``(P^T, dS^T)`` of the waited ``S^T`` and ``dP^T`` (:func:`_softmax`)."""
        start_m, masked = where
        return _softmax(self, s_t, dp_t, lse_tile, start_m, masked, cfg)

    @gluon.jit
    def finish_dq(self, dq, where, t, cfg):
        """Step ``t``'s ``dQ * scale`` to the writer warp's staging buffer."""
        stage_dq(dq, self.dq_smem, self.dq_ready, self.dq_empty, t, self.sm_scale)


@gluon.jit
def _step_start(t, n_part_t, idx_part, idx_full, n_blocks, SUB: gl.constexpr,
                BLOCK_M: gl.constexpr):
    """First query row of step ``t``: partial blocks' steps first (``t < n_part_t``), then the
    full blocks', ``SUB`` steps of ``BLOCK_M`` rows per listed block. Each listed index is
    clamped into the sequence's ``n_blocks`` query blocks (:func:`sparse_index`; issue 39):
    whatever the BlockMask holds, Q / dO / -lse / -Delta loads, the dQ atomics and the mods'
    query indices stay inside their tensors."""
    u = t // SUB
    if t < n_part_t:
        blk = sparse_index(idx_part, u, n_blocks)
    else:
        blk = sparse_index(idx_full, u - n_part_t // SUB, n_blocks)
    return blk * (SUB * BLOCK_M) + (t % SUB) * BLOCK_M


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, smem, prob, cfg):
    """One warp: K and V of the CTA's key block (KV head ``h // group_size``) once, then per
    step Q_i with its ``-lse`` column and dO_i with its ``-Delta`` column into the ring."""
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    SUB: gl.constexpr = cfg.SUB
    group_size = prob.group_size
    pid_n = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    expect_load2(k_desc, [b, h // group_size, pid_n * BLOCK_N, 0], smem.k,
                 v_desc, [b, h // group_size, pid_n * BLOCK_N, 0], smem.v, smem.kv_ready)
    n_part, idx_part = sparse_blocks(prob.Q_LIST, b, h, pid_n)
    n_full, idx_full = sparse_blocks(prob.FULL_Q_LIST, b, h, pid_n)
    n_blocks = gl.cdiv(prob.seqlen_q, SUB * BLOCK_M)
    head_row = (b * prob.num_heads + h) * prob.seqlen_q_pad
    for t in range(0, (n_part + n_full) * SUB):
        start_m = _step_start(t, n_part * SUB, idx_part, idx_full, n_blocks, SUB, BLOCK_M)
        slot, parity = ring_slot(t, cfg.STAGES)
        wait_empty(smem.qdo_empty, slot, parity)
        ring_load2(q_desc, [b, h, start_m, 0], smem.q, lse_desc, [head_row + start_m],
                   smem.lse, smem.q_ready, slot)
        ring_load2(do_desc, [b, h, start_m, 0], smem.do, delta_desc, [head_row + start_m],
                   smem.delta, smem.do_ready, slot)


@gluon.jit
def _dq_writer(smem, DQ, prob, cfg, ROWS: gl.constexpr):
    """One warp: per step, the consumers' staged ``dQ_i * scale`` into the fp32 accumulator
    ``(b, h, seqlen_q_pad, d)`` with ``red.global.add`` of 4 floats, ``ROWS`` rows at a time
    (backward.py's ``_dq_writer`` over the listed steps)."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    SUB: gl.constexpr = cfg.SUB
    layout: gl.constexpr = writer_layout(HEAD_DIM)
    pid_n = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    n_part, idx_part = sparse_blocks(prob.Q_LIST, b, h, pid_n)
    n_full, idx_full = sparse_blocks(prob.FULL_Q_LIST, b, h, pid_n)
    n_blocks = gl.cdiv(prob.seqlen_q, SUB * BLOCK_M)
    offs = writer_offsets(layout, HEAD_DIM, ROWS)
    head = DQ + (b * prob.num_heads + h).to(gl.int64) * prob.seqlen_q_pad * HEAD_DIM
    for t in range(0, (n_part + n_full) * SUB):
        start_m = _step_start(t, n_part * SUB, idx_part, idx_full, n_blocks, SUB, BLOCK_M)
        add_staged_dq(smem.dq, smem.dq_ready, smem.dq_empty, head + start_m * HEAD_DIM, offs, t,
                      layout, HEAD_DIM, BLOCK_M, ROWS)


@gluon.jit
def _issue_s(st, t, start_m, masked, cfg):
    """Issue ``S^T = K Q^T`` of step ``t`` (async) -> its token. Without a score_mod the
    accumulator starts at ``-lse / scale`` plus the keys' bias, and -inf where the mask_mod
    is False (partial blocks: ``masked``); with one it starts at 0 (:func:`_softmax`)."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    MASK_MOD: gl.constexpr = cfg.MASK_MOD
    k_tile = st.k_tile
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, BLOCK_M, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    slot, parity = ring_slot(t, cfg.STAGES)
    wait_ready(st.q_ready, slot, parity)
    q_tile = st.q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    if cfg.SCORE_MOD is not None:
        return warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_init, use_acc=False,
                             is_async=True)
    s_init = s_init + (st.lse_smem.index(slot).load(col_layout)[None, :] + st.key_bias[:, None])
    if MASK_MOD is not None:
        if masked:
            cols = gl.minimum(start_m + gl.arange(0, BLOCK_M, layout=col_layout),
                              st.seqlen_q - 1)
            s_init = gl.where(MASK_MOD(st.b, st.h, cols[None, :], st.mod_keys[:, None],
                                       st.MASK_ARGS), s_init, float("-inf"))
    return warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_init, is_async=True)


@gluon.jit
def _softmax(st, s_t, dp_t, lse_tile, start_m, masked, cfg):
    """``(P^T, dS^T)`` in fp32 from the waited ``S^T`` and ``dP^T`` (``dP^T`` holds ``dP -
    Delta``; ``dS`` is the gradient of ``x = q.k * scale``: the caller scales dK and dQ).
    ``ACCUMULATE``: the derivative also adds the gradients of the score_mod's captured tensors
    into ``GRADS`` (atomics; keys as rows: ``KV_AXIS`` 0)."""
    SCORE_MOD: gl.constexpr = cfg.SCORE_MOD
    SCORE_BWD: gl.constexpr = cfg.SCORE_BWD
    MASK_MOD: gl.constexpr = cfg.MASK_MOD
    ACCUMULATE: gl.constexpr = cfg.ACCUMULATE
    b = st.b
    h = st.h
    mod_keys = st.mod_keys
    SCORE_ARGS = st.SCORE_ARGS
    if SCORE_MOD is not None:
        col_layout: gl.constexpr = gl.SliceLayout(0, s_t.type.layout)
        cols = gl.minimum(start_m + gl.arange(0, cfg.BLOCK_M, layout=col_layout),
                          st.seqlen_q - 1)
        x = s_t * st.sm_scale
        if not ACCUMULATE:
            # The derivative is linear in its incoming gradient (an elementwise chain rule):
            # dP^T takes it first, so two tiles are live at a time (x and dP^T, then the
            # exponent and dP^T), not three. (The captured tensors' atomics need the
            # gradient itself, P^T * dP^T: below.)
            dp_t = SCORE_BWD(x, b, h, cols[None, :], mod_keys[:, None], SCORE_ARGS, dp_t, (),
                             0, False)
        e_t = SCORE_MOD(x, b, h, cols[None, :], mod_keys[:, None], SCORE_ARGS) * LOG2E + (
            lse_tile.load(col_layout)[None, :] + st.key_bias[:, None])
        if MASK_MOD is not None:
            if masked:
                e_t = gl.where(MASK_MOD(b, h, cols[None, :], mod_keys[:, None], st.MASK_ARGS),
                               e_t, float("-inf"))
        p_t = gl.exp2(e_t)
        if ACCUMULATE:
            ds_t = SCORE_BWD(x, b, h, cols[None, :], mod_keys[:, None], SCORE_ARGS,
                             p_t * dp_t, st.GRADS, 0, True)
        else:
            ds_t = p_t * dp_t
    else:
        p_t = gl.exp2(s_t * st.qk_scale)
        ds_t = p_t * dp_t
    return p_t, ds_t


@gluon.jit
def _consumer(smem, dk_desc, dv_desc, DK, DV, prob, cfg):
    """Two warpgroups: the CTA's keys against its listed query blocks, in the dense
    backward's step loop (:func:`~solattn.kernels.hopper.backward._steps_ss` at ``LOOKAHEAD``
    1: ``S^T`` of step ``t + 1`` issued under ``dK`` of step ``t``) over :class:`FlexBwdStep`,
    then ``dK * scale`` and ``dV`` to global: by TMA
    (:func:`~solattn.kernels.hopper.backward.store_dkdv`; ``TMA_EPILOGUE``: MHA, the inputs'
    dtype), or from registers at the strides given (GQA's fp32 partials)."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    SUB: gl.constexpr = cfg.SUB
    seqlen_k = prob.seqlen_k
    sm_scale = prob.sm_scale
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, HEAD_DIM, 16])
    pid_n = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    keys = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    # Keys past the sequence (zeros in the TMA tile) get P = 0 in every block.
    key_bias = gl.where(keys < seqlen_k, 0.0, float("-inf"))
    mod_keys = gl.minimum(keys, seqlen_k - 1)
    n_part, idx_part = sparse_blocks(prob.Q_LIST, b, h, pid_n)
    n_full, idx_full = sparse_blocks(prob.FULL_Q_LIST, b, h, pid_n)
    k_tile = smem.k.reshape([BLOCK_N, HEAD_DIM])
    v_tile = smem.v.reshape([BLOCK_N, HEAD_DIM])
    st = FlexBwdStep(k_tile, v_tile, smem.q, smem.do, smem.ds, smem.lse, smem.delta, smem.dq,
                     smem.q_ready, smem.do_ready, smem.qdo_empty, smem.dq_ready, smem.dq_empty,
                     (n_part + n_full) * SUB, n_part * SUB, idx_part, idx_full,
                     gl.cdiv(prob.seqlen_q, SUB * BLOCK_M), b, h, mod_keys, key_bias,
                     prob.seqlen_q, sm_scale, prob.qk_scale, prob.SCORE_ARGS,
                     prob.MASK_ARGS, prob.GRADS)

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(smem.kv_ready, 0)
    dk, dv = _steps_ss(st, dk, dv, cfg)

    if cfg.TMA_EPILOGUE:
        store_dkdv(dk, dv, sm_scale, smem.k, smem.v, dk_desc, dv_desc, b, h, pid_n * BLOCK_N)
    else:
        rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        # Strides in rows of HEAD_DIM elements: the offsets' divisibility lets the stores
        # write each thread's adjacent column pair at once (with element strides, unknown at
        # compile time, they were 16-bit stores, each pair behind a branch).
        offs = (b.to(gl.int64) * prob.stride_kb + h * prob.stride_kh
                + rows.to(gl.int64) * prob.stride_ks) * HEAD_DIM
        offs = offs[:, None] + cols[None, :]
        row_ok = (rows < seqlen_k)[:, None]
        gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=row_ok)
        gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=row_ok)


@gluon.jit(do_not_specialize=["num_heads", "seqlen_q", "seqlen_q_pad", "seqlen_k", "group_size",
                              "stride_kb", "stride_ks", "stride_kh"])
def attn_bwd_flex_kernel(
    q_desc, k_desc, v_desc, do_desc,  # rank-4 TMA descriptors over (b, h, s, d) views
    lse_desc, delta_desc,             # rank-1 over (b, h, seqlen_q_pad) fp32: -lse/unit, -Delta
    dk_desc, dv_desc,                 # TMA_EPILOGUE: rank-4 descriptors of the outputs' (b, h,
                                      # s, d) views (else K's and V's, unused)
    DQ,                               # (b, h, seqlen_q_pad, d) float32 accumulator, zeroed
    DK, DV,                           # dK, dV at (b, key, query head h) strides below: the
                                      # outputs (MHA) or fp32 per-query-head partials (GQA)
    Q_LIST, FULL_Q_LIST,              # BlockMask lists, q-major (common.sparse_blocks)
    SCORE_ARGS, MASK_ARGS,            # the mods' captured tensors (flex/codegen.py)
    GRADS,                            # fp32 gradients of the score_mod's captured tensors
    num_heads, seqlen_q, seqlen_q_pad, seqlen_k, group_size,
    stride_kb, stride_ks, stride_kh,  # of DK and DV in units of HEAD_DIM (last dim contiguous)
    qk_scale, sm_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    SUB: gl.constexpr,                # steps per listed query block: SPARSE_M // BLOCK_M
    SCORE_MOD: gl.constexpr, SCORE_BWD: gl.constexpr, MASK_MOD: gl.constexpr,
    ACCUMULATE: gl.constexpr,         # the score_mod's captured tensors require grad: GRADS
    PRODUCER_REGS: gl.constexpr, DQ_PAD: gl.constexpr, DQ_VEC: gl.constexpr,
    WRITER_ROWS: gl.constexpr,
    TMA_EPILOGUE: gl.constexpr,       # dK/dV in the inputs' dtype (MHA): stored by TMA
):
    """Grid (key blocks of BLOCK_N, query heads, batch): shared memory, barriers and the
    warp-specialized partitions (module docstring). Shared memory and barriers: those of
    backward.py's ``attn_bwd_kernel`` with its dQ writer (:func:`backward.bwd_buffers`)."""
    (q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, dq_smem, kv_ready,
     dq_ready, dq_empty, q_ready, do_ready, qdo_empty) = bwd_buffers(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, HEAD_DIM, BLOCK_M, BLOCK_N,
        STAGES, BLOCK_M, DQ_PAD, DQ_VEC, WRITER_ROWS)

    smem = BwdSmem(q_smem, k_smem, v_smem, do_smem, ds_smem, lse_smem, delta_smem, dq_smem,
                   kv_ready, q_ready, do_ready, qdo_empty, dq_ready, dq_empty)
    prob = FlexBwdProblem(Q_LIST, FULL_Q_LIST, SCORE_ARGS, MASK_ARGS, GRADS, num_heads, seqlen_q,
                          seqlen_q_pad, seqlen_k, group_size, stride_kb, stride_ks, stride_kh,
                          qk_scale, sm_scale)
    cfg = FlexBwdConsts(HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, SUB, SCORE_MOD, SCORE_BWD, MASK_MOD,
                        ACCUMULATE, TMA_EPILOGUE, 1)
    warp_specialize([
        (_consumer, (smem, dk_desc, dv_desc, DK, DV, prob, cfg)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, smem, prob, cfg)),
        (_dq_writer, (smem, DQ, prob, cfg, WRITER_ROWS)),
    ], [1, 1], [PRODUCER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------

def covers(q, k, v, fp) -> tuple[bool, str]:
    """Whether this kernel runs the flex backward of the call (``(b, s, h, d)`` views,
    :class:`solattn.flex.ops.FlexParams` ``fp``), and why not (the portable flex backward runs
    it then). The caller checks the device (sm_90, not the interpreter)."""
    why = unsupported_operands(q, v, SUPPORTED_HEAD_DIMS)
    if why:
        return False, why
    if tuple(fp.block_size) != (SPARSE_BLOCK, SPARSE_BLOCK):
        return False, (f"BlockMask BLOCK_SIZE {tuple(fp.block_size)}: the kernel's key block "
                       f"and query blocks are {SPARSE_BLOCK}")
    if fp.score is not None:
        if fp.score.bwd_gluon is None:
            return False, "score_mod is a @triton.jit function (runs on the portable kernel only)"
    if fp.mask is not None and not fp.mask.noop and fp.mask.fwd_gluon is None:
        return False, "mask_mod is a @triton.jit function (runs on the portable kernel only)"
    if fp.has_dropout:
        return False, "dropout not implemented"
    if fp.scale <= 0:
        return False, f"scale {fp.scale} <= 0 (masked scores start at -inf, times the scale)"
    b, s_q, h, _ = q.shape
    if b * h * triton.cdiv(s_q, SPARSE_BLOCK) * SPARSE_BLOCK >= 2**31 or (
            k.shape[:-1].numel() >= 2**31):
        return False, "batch * heads * seqlen >= 2**31 (int32 row offsets)"
    return True, "covered"


@dataclass(frozen=True)
class _Plan:
    seqlen_q_pad: int      # query rows per head of the per-row buffers: whole 128-row blocks
    grid: tuple
    preprocess_grid: tuple
    q_desc: object
    k_desc: object
    v_desc: object
    do_desc: object
    lse_desc: object
    delta_desc: object
    dkv_desc: object       # MHA: descriptors of the dK / dV outputs (TMA_EPILOGUE), else None
    constexprs: dict
    reduce: object         # GQA: backward.bwd_dkdv_reduce_kernel's Launch (else None)
    spill_bytes: int       # local memory used in the loops (the mods did not fit the registers)
    launch: object = None  # the kernel's Launch (solattn.launch: no Triton dispatch a call)
    # the preprocess kernel's Launch per (out, lse, dlse) strides and dlse's presence
    preprocess: dict = dataclasses.field(default_factory=dict)


_PLANS = PlanCache()


def _plan(q, k, v, do, fp) -> _Plan:
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), q.dtype, q.device,
           fp.score_fwd, fp.mask_fwd, fp.scale, fp.group_size)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _make_plan(q, k, v, do, fp))
    return plan


def _make_plan(q, k, v, do, fp) -> _Plan:
    b, seqlen_q, h, d = q.shape
    cfg = hopper_bwd_config(d)
    # Whole BlockMask query blocks: a listed block's last step may start past seqlen_q rounded
    # to BLOCK_M, and must read (-inf) rows of its own head.
    seqlen_q_pad = triton.cdiv(seqlen_q, SPARSE_BLOCK) * SPARSE_BLOCK
    n_cols = b * h * seqlen_q_pad
    score, mask = fp.score, fp.mask
    plan = _Plan(
        seqlen_q_pad=seqlen_q_pad,
        grid=(triton.cdiv(k.shape[1], cfg.block_n), h, b),
        preprocess_grid=(seqlen_q_pad // PREPROCESS_ROWS, h, b),
        q_desc=rows_desc(q, cfg.block_m), k_desc=rows_desc(k, cfg.block_n),
        v_desc=rows_desc(v, cfg.block_n), do_desc=rows_desc(do, cfg.block_m),
        lse_desc=cols_desc(n_cols, cfg.block_m), delta_desc=cols_desc(n_cols, cfg.block_m),
        # (dK / dV as _buffers allocates them for MHA: (b, h, s_k, d), seen as (b, s_k, h, d))
        dkv_desc=(rows_desc(torch.empty((b, h, k.shape[1], d), dtype=k.dtype,
                                         device="meta").transpose(1, 2), cfg.block_n)
                  if fp.group_size == 1 else None),
        constexprs=dict(
            HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
            SUB=SPARSE_BLOCK // cfg.block_m,
            SCORE_MOD=score.fwd_gluon if score is not None else None,
            SCORE_BWD=score.bwd_gluon if score is not None else None,
            MASK_MOD=None if mask is None or mask.noop else mask.fwd_gluon,
            ACCUMULATE=bool(score is not None and score.grad_captures),
            PRODUCER_REGS=WORKER_REGS, DQ_PAD=cfg.dq_pad, DQ_VEC=cfg.dq_vec,
            WRITER_ROWS=cfg.writer_rows, TMA_EPILOGUE=fp.group_size == 1,
            num_warps=CONSUMER_WARPS.value),
        reduce=(dkdv_reduce_launch((b, k.shape[1], k.shape[2], d), fp.group_size, b, False)
                if fp.group_size > 1 else None),
        spill_bytes=0)
    # Compiled with stand-ins of the buffers on the meta device: their dtypes and strides are
    # the call's, and no memory is taken (the dQ accumulator alone is 4 bytes an element of Q).
    buffers = _buffers(q, k, plan, torch.device("meta"))
    scalars = _scalars(plan, q, k, buffers[3], fp)
    kernel = attn_bwd_flex_kernel.warmup(*_call_args(plan, q, k, v, do, *buffers,
                                                     fp.grad_buffers(), fp), *scalars,
                                         grid=plan.grid, **plan.constexprs)
    return dataclasses.replace(
        plan, spill_bytes=hot_spill_bytes(kernel, HOT_RELOADS_ACCEPTED),
        launch=Launch(attn_bwd_flex_kernel, plan.grid, scalars, descriptors=8, tuples=5,
                      **plan.constexprs))


def _buffers(q, k, plan, device=None):
    """``(lse column, -Delta column, dQ accumulator, dK, dV)`` of a call (on ``device``, default
    q's): dK/dV in K's dtype ``(b, h_kv, s_k, d)`` contiguous (flex's layout; the kernel writes
    them through their ``(b, s_k, h_kv, d)`` view) for MHA, fp32 per-query-head partials
    ``(b, s_k, h, d)`` for GQA (summed per group by the reduce kernel)."""
    b, _, h, d = q.shape
    device = q.device if device is None else device
    n_cols = b * h * plan.seqlen_q_pad
    lse_col, delta_col, dq_acc = fp32_workspace(n_cols, (b, h, plan.seqlen_q_pad, d), device)
    if k.shape[2] == h:
        dk = torch.empty((b, h, k.shape[1], d), dtype=k.dtype, device=device).transpose(1, 2)
        dv = torch.empty((b, h, k.shape[1], d), dtype=k.dtype, device=device).transpose(1, 2)
    else:
        dk = torch.empty((b, k.shape[1], h, d), dtype=torch.float32, device=device)
        dv = torch.empty_like(dk)
    return lse_col, delta_col, dq_acc, dk, dv


def _call_args(plan, q, k, v, do, lse_col, delta_col, dq_acc, dk, dv, grads, fp) -> tuple:
    """The kernel's arguments that change from call to call (:func:`_scalars` follow them): the
    descriptors, the buffers, and the BlockMask lists, the mods' captured tensors and their
    gradient buffers (tuples)."""
    k_desc, v_desc = plan.k_desc(k), plan.v_desc(v)
    dk_desc, dv_desc = ((plan.dkv_desc(dk), plan.dkv_desc(dv)) if plan.dkv_desc is not None
                        else (k_desc, v_desc))
    return (plan.q_desc(q), k_desc, v_desc, plan.do_desc(do),
            plan.lse_desc(lse_col), plan.delta_desc(delta_col), dk_desc, dv_desc, dq_acc, dk, dv,
            fp.q_list(), fp.full_q_list(), fp.score_args(), fp.mask_args(), fp.grad_args(grads))


def _scalars(plan, q, k, dk, fp) -> tuple:
    """The kernel's scalar arguments (fixed by the plan: dK's strides by :func:`_buffers`)."""
    d = q.shape[-1]  # (dK/dV's strides are multiples of it: _buffers)
    return (q.shape[2], q.shape[1], plan.seqlen_q_pad, k.shape[1], fp.group_size,
            dk.stride(0) // d, dk.stride(1) // d, dk.stride(2) // d,
            LOG2E if fp.score is not None else fp.qk_scale, fp.scale)


_DECISIONS = PlanCache()  # prepare()'s outcomes (kept_decision)


def prepare(q, k, v, do, fp):
    """``((q, k, v, do, plan), "covered")`` where this kernel runs the call (operands made
    TMA-readable), else ``(None, why not)``: :func:`covers`, and the compiled kernel must not
    spill in its loops (a mod heavy enough to push the consumers past their registers runs on
    the portable kernel; checked per mod, once per shape; the outcome kept per signature:
    :func:`~solattn.kernels.hopper.pipeline.kept_decision`)."""
    return kept_decision(_DECISIONS, (q, k, v, do),
                         (fp.score_fwd, fp.mask_fwd, fp.scale, fp.group_size, fp.block_size,
                          fp.has_dropout),
                         lambda: covers(q, k, v, fp),
                         lambda q, k, v, do: _plan(q, k, v, do, fp), "backward")


def attn_bwd_flex(prepared, out, lse, fp, *, dlse=None):
    """Gradients on what :func:`prepare` returned: ``(dq, dk, dv, [fp32 gradients of the
    score_mod's captured tensors that require grad])``, the first three in flex's ``(B, H, L,
    E)`` layout, contiguous (the contract of
    :func:`solattn.kernels.triton.backward.attn_bwd_flex`). ``out`` is a ``(b, s, h, d)`` view,
    ``lse`` (and ``dlse``) ``(B, H, L)``."""
    q, k, v, do, plan = prepared
    b, seqlen_q, h, d = q.shape
    lse_col, delta_col, dq_acc, dk, dv = _buffers(q, k, plan)
    grads = fp.grad_buffers()
    dlse_stride = dlse.stride() if dlse is not None else (0, 0, 0)
    # (the plan fixes do's strides; out's and lse's are the forward's, kept per plan)
    pre_key = (out.stride(), lse.stride(), dlse_stride, dlse is not None)
    preprocess = plan.preprocess.get(pre_key)
    if preprocess is None:
        preprocess = plan.preprocess[pre_key] = Launch(
            bwd_preprocess_kernel, plan.preprocess_grid,
            (*out.stride(), *do.stride(), *lse.stride(), *dlse_stride, seqlen_q,
             plan.seqlen_q_pad, math.log(2.0) if fp.score is not None else fp.scale),
            HEAD_DIM=d, BLOCK_M=PREPROCESS_ROWS, HAS_DLSE=dlse is not None, IS_VARLEN=False,
            ROW_PAD=PREPROCESS_ROWS, num_warps=8)
    preprocess(out, do, lse, dlse if dlse is not None else lse, lse_col, delta_col, dq_acc, lse)
    plan.launch(*_call_args(plan, q, k, v, do, lse_col, delta_col, dq_acc, dk, dv, grads, fp))
    dq = dq_acc[:, :, :seqlen_q].to(q.dtype, memory_format=torch.contiguous_format)
    if fp.group_size > 1:
        h_kv = k.shape[2]
        dk_out = k.new_empty(b, k.shape[1], h_kv, d)
        dv_out = k.new_empty(b, k.shape[1], h_kv, d)
        plan.reduce(dk, dv, dk_out, dv_out, dk)  # (the last: the unused cu_seqlens_k)
        return (dq, dk_out.transpose(1, 2).contiguous(), dv_out.transpose(1, 2).contiguous(),
                grads)
    return dq, dk.transpose(1, 2), dv.transpose(1, 2), grads


# Mods `solattn aot` compiles into attn_bwd_flex_kernel (data only: aot_calls.py replays them):
# (score_mod, mask_mod) of solattn.flex.examples by name, their captured tensors requiring grad
# (the catalogue's): a plain mask; ALiBi (a captured per-head slope, its gradient summed per
# tile) with causal; a gathered mask (document ids); softcap's tanh with an and_masks window.
# (Gradients summed per row or column, or an atomic per score, spill with triton 3.6: learnable
# per-query/per-key biases 71 loop reloads at d=64, a relative-bias table 9 at d=64 and 418 at
# d=128; prepare() leaves those to the portable kernels.)
AOT_VARIANTS = {
    "causal": (None, "causal"),
    "alibi+causal": ("alibi_causal", "alibi_causal"),
    "document": (None, "document_causal"),
    "softcap+window": ("softcap_window_and", "softcap_window_and"),
}

# (head dim, AOT variant) -> why `solattn aot` may report a spill there. Triton 3.6: the
# document mask's loop reloads stay within HOT_RELOADS_ACCEPTED, which prepare() accepts too.
# Triton 3.9 (its CUDA 13 ptxas, 2026-11-26) spills every d=128 variant: causal 8 bytes outside
# the loop, document / softcap / ALiBi 12-17 reloads in it, so prepare() runs those three on the
# portable kernels there.
# With the block lists and captured tensors specialized as a call launches them (their row
# stride 1 a constexpr), the dQ writer warp reloads one or two 4-byte words a key block in its
# loop of 32 (d=64) / 64 (d=128) fp32x4 atomic adds; the consumers' step loop spills nothing.
# These are the binaries real calls get (prepare() accepts them: within HOT_RELOADS_ACCEPTED);
# `solattn aot --arch 90`, triton 3.6, 2026-11-28; not timed against a spill-free build.
_WRITER_RELOADS = "8 B: 1-2 reloads a key block in the dQ writer warp's atomic loop, triton 3.6"
_ACCEPTED_SPILL = {
    (128, "document"): f"<= {HOT_RELOADS_ACCEPTED} reloads a step of the gathered document ids",
    # Since the partitions take bundles (2026-11-28): a few scalars saved before the step loop
    # and reloaded after it, none inside it; not yet timed against the spill-free build.
    (128, "softcap+window"): "16 B outside the step loop (0 loop reloads), triton 3.6",
    (64, "causal"): _WRITER_RELOADS,
    (128, "causal"): _WRITER_RELOADS,
    (128, "alibi+causal"): _WRITER_RELOADS,
    (64, "softcap+window"): _WRITER_RELOADS,
}


def accepted_spill(head_dim: int, variant: str) -> str:
    """Why AOT variant ``variant`` (a key of :data:`AOT_VARIANTS`) may spill with the installed
    Triton ("" where it may not)."""
    from solattn.device import triton_version

    if head_dim == 128 and triton_version() >= (3, 9):
        return ("triton 3.9's ptxas spills the d=128 consumers; prepare() sends calls with more "
                f"than {HOT_RELOADS_ACCEPTED} loop reloads to the portable kernels")
    if triton_version() >= (3, 9):
        # With the lists specialized as launched, every d=64 variant: 8-16 B, 2-4 local accesses
        # in loops (`solattn aot --arch 90`, 2026-11-28; not timed).
        return (f"triton 3.9: 8-16 B, 2-4 loop reloads at d=64, within the {HOT_RELOADS_ACCEPTED}"
                " prepare() accepts")
    return _ACCEPTED_SPILL.get((head_dim, variant), "")
