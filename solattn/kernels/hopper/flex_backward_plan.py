"""Host side of the Hopper flex backward (:mod:`solattn.kernels.hopper.flex_backward`): which
calls it covers, the plans (compiled beside the forward's, checked for loop spills), the
workspaces and the launcher, and the mods `solattn aot` compiles."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton

from solattn.configs.hopper_backward import hopper_bwd_config
from solattn.configs.hopper_flex_backward import (
    HOT_RELOADS_ACCEPTED,
    SPARSE_BLOCK,
    SUPPORTED_HEAD_DIMS,
    WORKER_REGS,
)
from solattn.kernels.common import LOG2E
from solattn.kernels.hopper.backward import (
    CONSUMER_WARPS,
    PREPROCESS_ROWS,
    bwd_preprocess_kernel,
)
from solattn.kernels.hopper.backward_plan import (
    cols_desc,
    dkdv_reduce_launch,
    fp32_workspace,
    rows_desc,
)
from solattn.kernels.hopper.flex_backward import attn_bwd_flex_kernel
from solattn.kernels.hopper.flex_forward_plan import hot_spill_bytes
from solattn.kernels.hopper.pipeline import kept_decision, unsupported_operands
from solattn.launch import Launch, PlanCache


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
    cfg = hopper_bwd_config(d, scores=True)  # (the 64-query step: mods spill at 128)
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
             plan.seqlen_q_pad, math.log(2.0) if fp.score is not None else fp.scale, 1.0),
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
