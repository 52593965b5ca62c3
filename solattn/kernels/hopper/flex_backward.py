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

The step body is the dense kernel's, :func:`solattn.kernels.hopper.backward.steps_ss` at
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
``@triton.jit`` mods run on the portable flex backward (``flex_backward_plan.covers``), as do
mods whose code does not fit the consumers' registers (``flex_backward_plan.prepare``).

This module holds the device code only: the host side (coverage, plans, workspaces, launch) is
:mod:`solattn.kernels.hopper.flex_backward_plan`, the worker registers and accepted spills
:mod:`solattn.configs.hopper_flex_backward` (the tiles are the dense backward's,
:mod:`solattn.configs.hopper_backward`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
)

from solattn.kernels.common import LOG2E, sparse_blocks, sparse_index
from solattn.kernels.hopper.backward import (
    CONSUMER_WARPS,
    BwdSmem,
    add_staged_dq,
    bwd_buffers,
    stage_dq,
    steps_ss,
    store_dkdv,
    writer_layout,
    writer_offsets,
)
from solattn.kernels.hopper.columns import split_cols
from solattn.kernels.hopper.compat import Value, bundle, warp_specialize
from solattn.kernels.hopper.pipeline import (
    expect_load2,
    ring_load2,
    ring_slot,
    wait_empty,
    wait_ready,
)

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
    LOOKAHEAD: gl.constexpr               # backward.steps_ss's schedule: 1
    # backward.steps_ss's per-warpgroup sync: off (with triton 3.9 the d=128 builds already
    # spill in their loops; with it, document + GQA went from 6 to 24 loop accesses)
    LOCAL_SYNC: gl.constexpr


@bundle
class FlexBwdStep:
    """The consumers' step bundle, walked by the dense backward's step loop
    (:func:`solattn.kernels.hopper.backward.steps_ss`): K's and V's tiles, the rings, their
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

    # The step interface of backward.steps_ss (backward.BwdStep's methods).

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
    def draw(self, where, cfg):
        """Dropout's draws (the dense step's :meth:`BwdStep.draw`): none here (0)."""
        return 0

    @gluon.jit
    def softmax(self, s_t, dp_t, slot, bits, where, xf, cfg):
        """``(P^T, dS^T)`` of the waited ``S^T`` and ``dP^T`` of the step in ring slot
        ``slot`` (``bits``: unused, :meth:`draw`; :func:`_softmax`)."""
        start_m, masked = where
        return _softmax(self, s_t, dp_t, self.lse_smem.index(slot), start_m, masked, cfg)

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
            cols = _mod_queries(st, start_m, BLOCK_M, s_layout)
            s_init = gl.where(MASK_MOD(st.b, st.h, cols[None, :], st.mod_keys[:, None],
                                       st.MASK_ARGS), s_init, float("-inf"))
    return warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_init, is_async=True)


@gluon.jit
def _mod_queries(st, start_m, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """The query index the mods see for the columns of a step's ``[keys, queries]`` tile at
    ``start_m`` (clamped to the sequence's last query), built from the index split into the
    lane's part and a per-register constant
    (:func:`~solattn.kernels.hopper.columns.split_cols`): no per-column vector stays live
    (the loop spills it saves: :mod:`solattn.configs.hopper_flex_backward`)."""
    lane_part, reg_part = split_cols(BLOCK_M, layout)
    return gl.minimum((start_m + lane_part) + reg_part, st.seqlen_q - 1)


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
        s_layout: gl.constexpr = s_t.type.layout
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        cols = _mod_queries(st, start_m, cfg.BLOCK_M, s_layout)
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
    backward's step loop (:func:`~solattn.kernels.hopper.backward.steps_ss` at ``LOOKAHEAD``
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
    dk, dv = steps_ss(st, dk, dv, cfg)

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
                        ACCUMULATE, TMA_EPILOGUE, 1, False)
    warp_specialize([
        (_consumer, (smem, dk_desc, dv_desc, DK, DV, prob, cfg)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, smem, prob, cfg)),
        (_dq_writer, (smem, DQ, prob, cfg, WRITER_ROWS)),
    ], [1, 1], [PRODUCER_REGS, PRODUCER_REGS])
