"""Host side of the Hopper flex forward (:mod:`solattn.kernels.hopper.flex_forward`): which
calls it covers, the plans (128- or 64-key tiles, full- or half-block CTAs) and the check that a
mod's compiled kernel does not spill in its loops, the launcher, and the mods `solattn aot`
compiles."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from solattn.configs.hopper_flex_forward import (
    HALF_CTA_MAX_BLOCKS,
    HALF_CTA_MAXNREG,
    SPARSE_BLOCK,
    SUPPORTED_HEAD_DIMS,
    flex_config,
)
from solattn.kernels.common import LOG2E
from solattn.kernels.hopper.flex_forward import attn_fwd_flex_kernel
from solattn.kernels.hopper.pipeline import descriptors, kept_decision, unsupported_operands
from solattn.launch import Launch, PlanCache


def covers(q, k, v, fp) -> tuple[bool, str]:
    """Whether this kernel runs the flex call (``(b, s, h, d)`` views, :class:`FlexParams`
    ``fp``), and why not (the portable flex kernel runs it then). The caller checks the device
    (sm_90, not the interpreter)."""
    why = unsupported_operands(q, v, SUPPORTED_HEAD_DIMS)
    if why:
        return False, why
    if tuple(fp.block_size) != (SPARSE_BLOCK, SPARSE_BLOCK):
        return False, (f"BlockMask BLOCK_SIZE {tuple(fp.block_size)}: the kernel's query block "
                       f"(2 x 64 rows) and key block are {SPARSE_BLOCK}")
    for role, fns in (("score_mod", fp.score), ("mask_mod", fp.mask)):
        if fns is not None and not fns.noop and fns.fwd_gluon is None:
            return False, f"{role} is a @triton.jit function (runs on the portable kernel only)"
    if fp.has_dropout:
        return False, "dropout not implemented"
    if max(q.shape[0] * q.shape[2] * q.shape[1], k.shape[0] * k.shape[2] * k.shape[1]) >= 2**31:
        return False, "batch * heads * seqlen >= 2**31 (int32 row offsets)"
    return True, "covered"


@dataclass(frozen=True)
class _Plan:
    q_desc: object
    k_desc: object
    v_desc: object
    o_desc: object
    grid: tuple
    args: tuple
    constexprs: dict
    spill_bytes: int  # local memory used in the loops (a mod's registers did not fit)
    # the kernel's Launch (solattn.launch: no Triton dispatch a call); None until compiled
    # (_full_plan: a 64-key plan whose half-block twin was compiled first)
    launch: object = None
    # 64-key tiles: the same call's half-block plan, once built (_half_plan: [plan or None])
    half: list = dataclasses.field(default_factory=list, compare=False)
    # an uncompiled plan: itself compiled, once built (_full_plan: [plan])
    full: list = dataclasses.field(default_factory=list, compare=False)


_PLANS = PlanCache()


def _plan(q, k, v, fp) -> _Plan:
    """The launch of this call with 128-key tiles, or 64-key ones where the 128-key kernel
    spills in its loops (``spill_bytes`` > 0: both did).

    A 64-key call that will run half-block CTAs (:func:`_runs_half`) compiles that kernel
    first: where it fits, its full-block twin is kept uncompiled (``launch`` None), built by
    the first call that needs it (:func:`_full_plan`), so a short-list mask's first call
    compiles one kernel, not two."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
           fp.score_fwd, fp.mask_fwd, fp.scale, fp.group_size)
    plan = _PLANS.get(key)
    if plan is None:
        for block_n in first_block_ns(q.shape[-1], fp):
            cfg = flex_config(q.shape[-1], block_n)
            half = None
            if block_n < SPARSE_BLOCK and _runs_half(fp):
                half = _make_plan(q, k, v, fp, flex_config(q.shape[-1], block_n, 1))
                if not half.spill_bytes:
                    plan = _make_plan(q, k, v, fp, cfg, compile=False)
                    plan.half.append(half)
                    break
            plan = _make_plan(q, k, v, fp, cfg)
            if half is not None:
                plan.half.append(None)  # (it spilled: _half_plan would build it again)
            if not plan.spill_bytes:
                break
        plan = _PLANS.put(key, plan)
    return plan


def _runs_half(fp) -> bool:
    """Whether a call with 64-key tiles runs half-block CTAs: its BlockMask lists at most
    :data:`HALF_CTA_MAX_BLOCKS` key blocks a query block (``FlexParams.mean_kv_blocks``: None,
    and so full-block CTAs, where that cannot be read)."""
    mean = fp.mean_kv_blocks()
    return mean is not None and mean <= HALF_CTA_MAX_BLOCKS


def first_block_ns(head_dim: int, fp) -> tuple:
    """The key tiles :func:`_plan` compiles, in order, until one does not spill: 128 then 64,
    or only 64 for a heavy mod at d=128 (``ModFns.heavy``), which spills with 128-key tiles:
    `solattn aot` on every catalogue mod, triton 3.6, 2026-11-26 -- the heavy ones (document
    masks, dilated, tree, softcap, the bias tables) spilled 14-480 loop accesses at d=128, the
    light ones (causal, windows, prefix-LM, global tokens, ALiBi) none. A new mod's first call
    then compiles once instead of twice (about 5 s of the forward's 10 s)."""
    heavy = any(f is not None and f.heavy for f in (fp.score, fp.mask))
    if head_dim == 128 and heavy:
        return (SPARSE_BLOCK // 2,)
    return (SPARSE_BLOCK, SPARSE_BLOCK // 2)


def _half_plan(q, k, v, fp, plan) -> _Plan | None:
    """The half-block CTAs' launch of a 64-key ``plan``'s call (kept in ``plan.half``), or None
    where that kernel spills in its loops."""
    if not plan.half:
        half = _make_plan(q, k, v, fp, flex_config(q.shape[-1], plan.constexprs["BLOCK_N"], 1))
        plan.half.append(None if half.spill_bytes else half)
    return plan.half[0]


def _full_plan(q, k, v, fp, plan) -> _Plan:
    """The compiled form of a plan :func:`_plan` kept uncompiled (kept in ``plan.full``); its
    half-block twin where the full-block kernel spills (the twin does not: :func:`_plan`)."""
    if not plan.full:
        cfg = flex_config(q.shape[-1], plan.constexprs["BLOCK_N"])
        full = _make_plan(q, k, v, fp, cfg)
        plan.full.append(plan.half[0] if full.spill_bytes else full)
    return plan.full[0]


def _make_plan(q, k, v, fp, cfg, compile: bool = True) -> _Plan:
    b, seqlen_q, h, d = q.shape
    n_t = triton.cdiv(seqlen_q, cfg.consumers * cfg.block_m)
    # flex's contiguous (B, H, L, E) output, seen as (b, s, h, d)
    o_strides = (h * seqlen_q * d, d, seqlen_q * d, 1)
    score, mask = fp.score, fp.mask
    has_score = score is not None
    plan = _Plan(
        q_desc=descriptors(q.shape, q.stride(), q.dtype, cfg.block_m, d),
        k_desc=descriptors(k.shape, k.stride(), q.dtype, cfg.block_n, d),
        v_desc=descriptors(v.shape, v.stride(), q.dtype, cfg.block_n, d),
        o_desc=descriptors((b, seqlen_q, h, d), o_strides, q.dtype, cfg.block_m, d),
        grid=(n_t * h * b,),
        args=(n_t, h, seqlen_q, k.shape[1], fp.group_size, fp.scale,
              LOG2E if has_score else fp.qk_scale),
        constexprs=dict(
            HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
            SPARSE_N=SPARSE_BLOCK, SCORE_MOD=score.fwd_gluon if has_score else None,
            MASK_MOD=None if mask is None or mask.noop else mask.fwd_gluon,
            CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
            CONSUMERS=cfg.consumers, num_warps=4,
            **(dict(maxnreg=HALF_CTA_MAXNREG) if cfg.consumers == 1 else {})),
        spill_bytes=0)
    if not compile:
        return plan
    # The output and the LSE as calls pass them (the kernel is specialized on their dtypes, so
    # the first call launches this binary instead of compiling another), on the meta device:
    # no memory taken.
    out = torch.empty((b, h, seqlen_q, d), dtype=q.dtype, device="meta")
    lse = torch.empty((b, h, seqlen_q), dtype=torch.float32, device="meta")
    kernel = attn_fwd_flex_kernel.warmup(*_call_args(plan, q, k, v, out, lse, fp), *plan.args,
                                         grid=plan.grid, **plan.constexprs)
    return dataclasses.replace(
        plan, spill_bytes=hot_spill_bytes(kernel),
        launch=Launch(attn_fwd_flex_kernel, plan.grid, plan.args, descriptors=4, tuples=4,
                      **plan.constexprs))


def hot_spill_bytes(kernel, allowed: int = 0) -> int:
    """Local memory of a compiled kernel whose SASS reads or writes it more than ``allowed``
    times inside innermost loops (a few values saved around the loops cost nothing
    measurable: 0 then), by :func:`solattn.kernels.sass.hot_local_accesses` on
    ``cuobjdump -sass``."""
    import os
    import subprocess
    import tempfile

    from solattn.kernels.sass import bin_dir as _bin_dir
    from solattn.kernels.sass import hot_local_accesses

    kernel._init_handles()
    if not kernel.n_spills:
        return 0
    cuobjdump = os.path.join(_bin_dir(), "cuobjdump")
    if not os.path.exists(cuobjdump):  # cannot look: every spill counts
        return int(kernel.n_spills)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
    return int(kernel.n_spills) if not sass or hot_local_accesses(sass) > allowed else 0


def _call_args(plan, q, k, v, out, lse, fp) -> tuple:
    """The kernel's arguments that change from call to call (``plan.args`` follow them): the
    descriptors, the LSE, and the BlockMask lists and mods' captured tensors (tuples)."""
    return (plan.q_desc(q), plan.k_desc(k), plan.v_desc(v), plan.o_desc(out.transpose(1, 2)),
            lse, fp.kv_list(), fp.full_kv_list(), fp.score_args(), fp.mask_args())


_DECISIONS = PlanCache()  # prepare()'s outcomes (kept_decision)


def prepare(q, k, v, fp):
    """``((q, k, v, plan), "covered")`` where this kernel runs the call (``q, k, v`` made
    TMA-readable), else ``(None, why not)``: :func:`covers`, and the compiled kernel must not
    spill in its loops, with 128- or else 64-key tiles -- a mod heavy enough to push the
    consumers past their 240 registers even then (a captured table gathered per element,
    ``table[h, q_idx - kv_idx]``, needs a 64-bit address per score) runs on the portable kernel
    instead (checked per mod, once per shape; the outcome kept per signature:
    :func:`~solattn.kernels.hopper.pipeline.kept_decision`)."""
    return kept_decision(_DECISIONS, (q, k, v),
                         (fp.score_fwd, fp.mask_fwd, fp.scale, fp.group_size, fp.block_size,
                          fp.has_dropout),
                         lambda: covers(q, k, v, fp), lambda q, k, v: _plan(q, k, v, fp),
                         "kernel")


def attn_fwd_flex(prepared, fp):
    """Launch the Hopper flex forward on what :func:`prepare` returned (validated, non-empty
    ``(b, s, h, d)`` views) -> ``(out (B, H, L, d), lse (B, H, L) fp32)``, contiguous in flex's
    layout (the contract of :func:`solattn.kernels.triton.forward.attn_fwd_flex`)."""
    q, k, v, plan = prepared
    if plan.constexprs["BLOCK_N"] < SPARSE_BLOCK and _runs_half(fp):
        plan = _half_plan(q, k, v, fp, plan) or plan
    if plan.launch is None:
        plan = _full_plan(q, k, v, fp, plan)
    b, seqlen_q, h, d = q.shape
    out = q.new_empty(b, h, seqlen_q, d)
    lse = q.new_empty(b, h, seqlen_q, dtype=torch.float32)
    plan.launch(*_call_args(plan, q, k, v, out, lse, fp))
    return out, lse


# Mods `solattn aot` compiles into attn_fwd_flex_kernel (data only: aot_calls.py replays them):
# (score_mod, mask_mod) of solattn.flex.examples by name, and the key tile prepare() picks for
# them (the 128-key kernel spills in its loops for the gathers and for tanh at d=128): a plain
# mask; ALiBi (a captured per-head slope) with causal; a gathered mask (document ids); a
# gathered bias table; softcap's tanh with an and_masks window; the document mask again in
# half-block CTAs (the fourth field: consumer warpgroups a CTA). (relative_bias with
# document_causal together spill at d=128 even with 64-key tiles: the portable kernel runs it.)
AOT_VARIANTS = {
    "causal": (None, "causal", 128, 2),
    "alibi+causal": ("alibi_causal", "alibi_causal", 128, 2),
    "document": (None, "document_causal", 64, 2),
    "document-half": (None, "document_causal", 64, 1),
    "relbias": ("relative_bias", None, 64, 2),
    "softcap+window": ("softcap_window_and", "softcap_window_and", 64, 2),
}
