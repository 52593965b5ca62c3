"""Host side of the Hopper forward (:mod:`solattn.kernels.hopper.forward`): which calls it covers
and prefers, the FP8 V operand, the launch plans and launcher, and the flag sets `solattn aot`
compiles."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from solattn.arch import arch_limits
from solattn.configs.hopper_forward import (
    _FP8_CONFIGS,
    _FP8_KEY_GROUP,
    _FP8_STAGED_CAUSAL_MAX_KEYS,
    _STAGED_CAUSAL_MAX_KEYS,
    _STAGED_LPT_CAUSAL_MAX_KEYS,
    DROPOUT_HEAD_DIMS,
    FP8_DTYPE,
    FP8_OUT_DTYPE,
    LPT_ALL_HEADS,
    few_tiles_config,
    fp8_band_only_head_dims,
    hopper_fwd_config,
    lpt_all_heads,
)
from solattn.configs.hopper_forward import (
    HopperFwdConfig as HopperFwdConfig,  # re-exported: a launcher's config type
)
from solattn.device import num_sms
from solattn.kernels.hopper.forward import (
    _SCHED_SLOTS,
    HEAD_DIM_TILES,
    attn_fwd_fp8_kernel,
    attn_fwd_kernel,
    fp8_v_transpose_kernel,
    fp8_v_transpose_varlen_kernel,
)
from solattn.kernels.hopper.pipeline import (
    descriptors,
    tma_ready,
    tma_strides_ok,
    unsupported_operands,
)
from solattn.kernels.keys import primed
from solattn.kernels.triton.decode import keeps_workspaces
from solattn.launch import DescriptorCache, Launch, PlanCache, contiguous_strides


def fp8_unsupported(q, v, p) -> str:
    """Why the FP8 forward cannot run this call ("" when it can); FP8 has no other kernel, so
    the caller raises ``NotImplementedError`` with this reason."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if head_dim != head_dim_v:
        return f"FP8 needs head_dim == head_dim_v, got {head_dim} and {head_dim_v}"
    if head_dim not in _FP8_CONFIGS:
        return f"FP8 head_dim must be one of {tuple(_FP8_CONFIGS)}, got {head_dim}"
    for feature, used in (("ALiBi (alibi_slopes)", p.has_alibi), ("dropout", p.has_dropout),
                          ("paged K/V (block_table)", p.paged),
                          ("seqused_k", p.seqused_k is not None)):
        if used:
            return f"{feature} is not supported with FP8 inputs"
    if head_dim in fp8_band_only_head_dims() and (p.has_softcap or p.has_left):
        return (f"softcap and left-bounded windows with FP8 inputs at head_dim {head_dim} are "
                "not supported")
    if p.out_dtype not in (None, FP8_OUT_DTYPE):
        return f"FP8 output dtype is {FP8_OUT_DTYPE}, got out_dtype={p.out_dtype}"
    if q.shape[:-1].numel() >= 2**31:
        return "batch * seqlen_q * heads >= 2**31 (the epilogue's row offsets are int32)"
    return ""


# The largest dynamic shared memory a CTA may use on sm_90 (the arch table's opt-in maximum),
# and a bound on what the barriers take beside the tiles.
_SMEM_LIMIT = arch_limits(90).smem_per_block
_SMEM_BARRIERS = 1024


def check_shared_memory(cfg: HopperFwdConfig, d_tile: int, dv_tile: int, elt: int,
                        o_tile: bool) -> None:
    """ValueError unless the shared memory of the forward under ``cfg`` (tiles ``d_tile`` /
    ``dv_tile`` wide, ``elt``-byte inputs) fits a CTA: Q's tile per consumer, the K and V rings,
    and, when ``o_tile``, O's own 16-bit staging tiles (the kernel's allocation condition: O
    staged on a persistent grid, or the FP8 kernel's bf16 O unless stored from registers)."""
    q = cfg.consumers * cfg.block_m * d_tile * elt
    kv = cfg.stages * cfg.block_n * (d_tile + dv_tile) * elt
    o = cfg.consumers * cfg.block_m * dv_tile * 2 if o_tile else 0
    if q + kv + o + _SMEM_BARRIERS > _SMEM_LIMIT:
        raise ValueError(
            f"config: stages={cfg.stages}, block_n={cfg.block_n}, o_staging={cfg.o_staging} at "
            f"head dims {d_tile}/{dv_tile} needs {q + kv + o} bytes of shared memory (Q {q}, "
            f"K/V {kv}, O {o}), expected at most {_SMEM_LIMIT - _SMEM_BARRIERS} "
            f"({_SMEM_LIMIT} less the barriers')")


def covers(q, v, p) -> tuple[bool, str]:
    """Whether this kernel runs the call (:class:`solattn.params.AttnParams` ``p``), and why not
    (the portable kernel runs it then)."""
    if q.dtype == FP8_DTYPE:
        why = fp8_unsupported(q, v, p)
        return (False, why) if why else (True, "covered (FP8)")
    head_dims = (q.shape[-1], v.shape[-1])
    if head_dims not in HEAD_DIM_TILES:
        return False, (f"(head_dim, head_dim_v) = {head_dims} not in "
                       f"{tuple(HEAD_DIM_TILES)}")
    why = unsupported_operands(q, v, (q.shape[-1],), same_dims=False)
    if why:
        return False, why
    if p.has_alibi and not p.alibi_slopes.is_contiguous():
        # The kernel indexes (h,) / (b, h) slopes without strides (fewer scalar arguments:
        # with strides the ALiBi + left-window build spilled).
        return False, "ALiBi slopes not contiguous"
    if p.has_alibi and p.qk_scale == 0:
        # The slope is converted to the scores' raw units (slope * log2(e) / qk_scale).
        return False, "ALiBi with softmax_scale 0"
    if p.paged:
        return False, "paged K/V (block_table): the TMA loads address contiguous sequences"
    if p.seqused_k is not None:
        # The TMA tile at a sequence's end reads the rows past seqused_k with P = 0: unused
        # cache slots, which may hold NaN (uninitialized memory), would reach the output.
        return False, "seqused_k: the tail tile would read the unused cache slots past it"
    d_tile, dv_tile = HEAD_DIM_TILES[head_dims]
    if p.has_dropout and (d_tile != dv_tile or d_tile not in DROPOUT_HEAD_DIMS):
        return False, (f"dropout at head_dim {head_dims[0]} with head_dim_v {head_dims[1]} "
                       f"(not built)")
    if p.has_dropout and p.has_alibi and d_tile == 256:
        # (the keep mask's draws spill the varlen build in a loop: configs/hopper_forward.py)
        return False, "dropout with ALiBi at head_dim 256"
    if q.shape[:-1].numel() >= 2**31:
        return False, "batch * seqlen_q * heads >= 2**31 (the epilogue's row offsets are int32)"
    return True, "covered"


# Features covers() accepts whose default was decided by measuring both kernels, and the result:
# (default on?, why). H100, bf16, Hopper vs portable forward TFLOP/s (scripts/bench_coverage.py,
# B4 H16 L4096; varlen: 8 packed sequences of ~2k tokens, H16; BENCHMARKS.md, 2026-11-23 fourth
# session, and 2026-11-26 on an H200 for ALiBi at d=64/256). SOLATTN_BACKEND=hopper runs the
# "off" ones here.
_MEASURED_DEFAULTS = {
    # 323 vs 374 full, 241 vs 288 causal (2026-11-22 with 12 sequences at H32: 371 vs 394, 298
    # vs 341); at d=128 the Hopper kernel wins (485 vs 395, causal 377 vs 321). With dynamic
    # tile claiming (H100, 2026-11-26, scripts/bench_coverage.py --only varlen, H16): 8
    # sequences of ~2k 361 vs 383 full, 270 vs 290 causal; 40 documents of 64-1024 242 vs 289,
    # 139 vs 187 (d=128: 508 vs 405, 404 vs 323; 347 vs 275, 218 vs 194).
    "varlen64": (False, "varlen at head_dim 64: the portable kernel measured faster "
                        "(0.74-0.94x)"),
    # d=128: 479 vs 420 full (1.14x), 447 vs 361 causal (1.24x); the same ratios on an H200
    # (2026-11-26: 483 vs 425, 447 vs 361). H200, 2026-11-26: d=64 368 vs 361 full (1.02x),
    # 291 vs 315 causal (0.92x); d=256 581 vs 187 full (3.11x), 548 vs 179 causal (3.06x).
    ("alibi", 64): (False, "ALiBi at head_dim 64: 0.92-1.02x the portable kernel"),
    ("alibi", 128): (True, "ALiBi at head_dim 128: 1.14x the portable kernel, causal 1.24x"),
    ("alibi", 256): (True, "ALiBi at head_dim 256: 3.1x the portable kernel"),
    # d96 460 vs 346 (1.33x), causal 394 vs 303; d192 522 vs 160 (3.25x), causal 478 vs 151;
    # 192/128 512 vs 178 (2.88x), causal 460 vs 164.
    "head_dims": (True, "padded head dims 96/192 and 192/128: 1.30-3.25x the portable kernel"),
    # Dropout 0.1 (the keep mask's Philox draws bound both kernels), H200, 2026-11-28, `solattn
    # bench --suite dropout` against the tree without it (portable), B4 L4096, triton 3.6:
    # d=128 H16 254 vs 243, causal 232 vs 221; d=64 H32 160 vs 157, causal 145 vs 147 (SDPA's
    # FLASH backend, i.e. FA2: 278 / 250 / 226 / 217).
    ("dropout", 64): (False, "dropout at head_dim 64: 0.99-1.02x the portable kernel"),
    ("dropout", 128): (True, "dropout at head_dim 128: 1.05x the portable kernel"),
    # d=256 (H200, 2026-11-29, the same suite at B2 H8 L4096 with --trees against the tree
    # before, whose d=256 dropout ran the portable forward; 3 interleaved rounds): 391 vs 143,
    # causal 331 vs 131 (triton 3.9: 386 vs 145, 339 vs 129; SDPA's FLASH backend 305 / 251).
    ("dropout", 256): (True, "dropout at head_dim 256: 2.5-2.7x the portable kernel"),
    # Dropout 0.1 beside softcap 30 under a causal band without a left bound, d=128 (H200,
    # 2026-11-29, B4 H16 L4096, Hopper vs portable forward in one process, 3 rounds,
    # docs/runs/2026-11-29-h200-s30.txt): 145 vs 191 TFLOP/s (triton 3.9: 168 vs 192), where the
    # same build without the band measured 222 vs 204 (225 vs 208), with a window (1024, 0) 409
    # vs 339 (390 vs 343) and d=256 causal 269 vs 120 (284 vs 116); no local memory in any of
    # them. The causal build waits for instructions (ncu: "no instruction" stalls 2.39 warps
    # per issue vs 0.40 full): a causal tile runs its masked and unmasked key loops, ~1,300
    # instructions each, in both warpgroups (decisions/045); one masked loop for the whole range
    # did not help (141 vs 145: decisions/047).
    "dropout-causal-softcap128": (False, "dropout with softcap under a causal band at head_dim "
                                         "128: 0.76-0.88x the portable kernel"),
}


def preferred(q, v, p) -> tuple[bool, str]:
    """Whether a call :func:`covers` accepts runs here by default (else the portable kernel),
    and why (or why not), from :data:`_MEASURED_DEFAULTS`. FP8 has no other kernel."""
    if q.dtype == FP8_DTYPE:
        return True, "default: FP8 (no other kernel)"
    d, d_v = q.shape[-1], v.shape[-1]
    d_tile = HEAD_DIM_TILES.get((d, d_v), (d, d_v))[0]
    reasons = []
    for key, on in (("varlen64", p.varlen and d_tile < 128), (("alibi", d_tile), p.has_alibi),
                    (("dropout", d_tile), p.has_dropout),
                    ("dropout-causal-softcap128", p.has_dropout and p.has_softcap and p.causal
                     and not p.has_left and d_tile == 128),
                    ("head_dims", HEAD_DIM_TILES.get((d, d_v), (d, d_v)) != (d, d_v))):
        if on:
            ok, why = _MEASURED_DEFAULTS[key]
            if not ok:
                return False, "not the default: " + why
            reasons.append(why)
    return True, "default" + "".join(f"; {why}" for why in reasons)


def _fp8_layout(row_bytes: int):
    """Swizzled layout of an 8-bit rank-4 tile whose rows are ``row_bytes`` long."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, row_bytes), element_bitwidth=8,
                                rank=4)


def _fp8_descriptors(shape, strides, block) -> DescriptorCache:
    """Rank-4 e4m3 descriptors over a ``(b, h, rows, cols)`` view given by ``shape`` and
    ``strides`` (``cols`` contiguous), tiles of ``block``, by base address."""
    layout = _fp8_layout(block[-1])
    return DescriptorCache(lambda base: TensorDescriptor(base, list(shape), list(strides),
                                                         list(block), layout))


_FP8_TRANSPOSE_BLOCK = 128  # keys per program of fp8_v_transpose_kernel (128-byte rows)


def fp8_v_operand(v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 kernel's V: ``(b, s_k, h_kv, d)`` e4m3 -> ``(b, h_kv, d, s_k')``, keys contiguous
    (8-bit wgmma reads its B operand K-major only) and ``s_k'`` = ``s_k`` rounded up to 32 (the
    padding is zero). Within each group of 32 keys, key ``16h + 8j + 2q + e`` moves to position
    ``16h + 4q + 2j + e``: the permutation :func:`_p_operand` applies to P's columns. One copy
    of V per call, by :func:`fp8_v_transpose_kernel` (its cost: docs/hopper-forward.md);
    ``out`` (optional) receives it."""
    b, s_k, h_kv, d = v.shape
    s_pad = triton.cdiv(s_k, _FP8_KEY_GROUP) * _FP8_KEY_GROUP
    if v.stride(-1) != 1:
        v = v.contiguous()
    if out is None:
        out = torch.empty((b, h_kv, d, s_pad), dtype=v.dtype, device=v.device)
    src, dst = v.view(torch.uint8), out.view(torch.uint8)
    grid = (triton.cdiv(s_pad, _FP8_TRANSPOSE_BLOCK), b * h_kv)
    fp8_v_transpose_kernel[grid](src, dst, s_k, s_pad, h_kv, v.stride(0), v.stride(1),
                                 v.stride(2), HEAD_DIM=d, BLOCK_K=_FP8_TRANSPOSE_BLOCK,
                                 num_warps=4)
    return out


@dataclass(frozen=True)
class _Plan:
    tma_ready: bool             # q, k, v strides TMA-readable (their bases are checked per call)
    out_dtype: torch.dtype      # p.out_dtype or q's; another than q's: o_desc gets q's descriptor
    lse_shape: tuple
    q_desc: DescriptorCache
    k_desc: DescriptorCache
    v_desc: DescriptorCache
    o_desc: DescriptorCache
    launch: Launch
    dynamic: bool = False                  # the launch takes a SCHED workspace
    fp8_ones: torch.Tensor | None = None   # FP8: the descale of an argument passed as None
    vt_shape: tuple = ()                   # FP8: fp8_v_operand's (b, h_kv, d, s_k')
    v_launch: Launch | None = None         # FP8: fp8_v_transpose_kernel


_PLANS = PlanCache()


@primed
def attn_fwd(q, k, v, p, *, return_lse=True, config=None):
    """Launch the Hopper forward for :class:`solattn.params.AttnParams` ``p`` on validated,
    non-empty inputs that :func:`covers` accepts.

    ``q (b, s_q, h, d)``, ``k (b, s_k, h_kv, d)``, ``v (b, s_k, h_kv, d_v)``; fp16/bf16, or e4m3
    (``torch.float8_e4m3fn``, with ``p.q_descale/k_descale/v_descale``: see
    :func:`_attn_fwd_fp8`); ``(d, d_v)`` in :data:`HEAD_DIM_TILES` (e4m3: 64/128/256, ``d_v ==
    d``). Same contract as :func:`solattn.kernels.triton.forward.attn_fwd`: returns
    ``out (b, s_q, h, d_v)`` (dtype ``p.out_dtype`` or q's; bf16 for e4m3) and ``lse`` float32
    ``(b, h, s_q)`` (natural log; None unless ``return_lse``). Varlen (``p.cu_seqlens_q/k``,
    ``p.max_seqlen_q``; e4m3 too): ``q (t_q, h, d)``, ``k``/``v (t_k, h_kv, d[_v])`` packed;
    returns ``out (t_q, h, d_v)`` and ``lse (h, t_q)``; rows past ``cu_seqlens_q[-1]`` are left
    unwritten. The TMA tiles of a sequence's ragged end read
    the first rows of the next sequence (scores masked, ``P = 0``): inf/NaN in those rows of V
    would reach the output, finite values never do. ALiBi (``p.alibi_slopes``, contiguous
    ``(h,)`` or ``(b, h)`` float32) as the portable kernel's. ``config`` overrides the
    :class:`HopperFwdConfig` of the head dim (benchmark sweeps).
    """
    varlen = p.varlen
    if varlen:
        # The packed tensors are one batch entry of the descriptors; tiles find their sequence
        # through cu_seqlens (seqlen_q / seqlen_k below are then total rows, the LSE row stride).
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if q.dtype == FP8_DTYPE:
        out, lse = _attn_fwd_fp8(q, k, v, p, return_lse, config)
    else:
        out, lse = _attn_fwd_16(q, k, v, p, return_lse, config)
    if varlen:
        return out[0], (lse[0] if lse is not None else None)
    return out, lse


def _attn_fwd_16(q, k, v, p, return_lse, config):
    """:func:`attn_fwd` for fp16/bf16 ``(b, s, h, d)`` inputs (varlen: ``b = 1``)."""
    varlen = p.varlen
    plan = _plan(q, k, v, p, return_lse, config)
    if not plan.tma_ready or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
        plan = _plan(q, k, v, p, return_lse, config)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=plan.out_dtype, device=q.device)
    lse = (torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
           if return_lse else None)
    q_desc = plan.q_desc(q)
    plan.launch(
        q_desc, plan.k_desc(k), plan.v_desc(v),
        plan.o_desc(out) if plan.out_dtype == q.dtype else q_desc, out,
        lse if return_lse else q, p.seqused_k if p.seqused_k is not None else q,
        p.cu_seqlens_q if varlen else q, p.cu_seqlens_k if varlen else q,
        sched_workspace(q) if plan.dynamic else q, p.dropout_seed if p.has_dropout else q)
    return out, lse


_SCHED_WORKSPACES: dict = {}


def sched_workspace(q) -> torch.Tensor:
    """The int32 ``SCHED`` workspace of a dynamic launch (:data:`_SCHED_SLOTS`' comment) on
    ``q``'s device and its current stream: zeroed once and kept per (device, stream), since
    each launch leaves its counters at 0 and launches on one stream run in order (a CUDA graph
    captured with a kept one replays with it, in its stream's order). Not kept when first
    needed while the stream is being captured (its zeroing would exist only in the graph), nor
    inside :func:`~solattn.kernels.triton.decode.per_call_workspaces` (torch.compile's graphs:
    as the fused decode's workspace), where each call gets its own."""
    n = 2 + _SCHED_SLOTS.value * num_sms(q.device)
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


def _attn_fwd_fp8(q, k, v, p, return_lse, config):
    """:func:`attn_fwd` for e4m3 ``q``, ``k``, ``v`` (``(b, s, h, d)``; varlen: ``b = 1``):
    V is copied to the transposed, key-permuted operand of :func:`fp8_v_operand` (varlen:
    :func:`fp8_v_transpose_varlen_kernel`, each sequence's keys from a multiple of 32); the
    descales ``p.q_descale`` etc. are contiguous float32 ``(b, h_kv)`` arrays (varlen: (number
    of sequences, h_kv)), or None for 1. Returns bf16 ``out`` and the LSE of the dequantized
    problem."""
    plan = _plan(q, k, v, p, return_lse, config)
    if not plan.tma_ready or (q.data_ptr() | k.data_ptr()) & 15:
        q, k = tma_ready(q), tma_ready(k)
        v = v if v.stride(-1) == 1 else v.contiguous()
        plan = _plan(q, k, v, p, return_lse, config)
    vt = torch.empty(plan.vt_shape, dtype=v.dtype, device=v.device)
    if p.varlen:
        plan.v_launch(v.view(torch.uint8), vt.view(torch.uint8), p.cu_seqlens_k)
    else:
        plan.v_launch(v.view(torch.uint8), vt.view(torch.uint8))
    out = torch.empty(q.shape, dtype=plan.out_dtype, device=q.device)
    lse = (torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
           if return_lse else None)
    ones = plan.fp8_ones
    plan.launch(
        plan.q_desc(q), plan.k_desc(k), plan.v_desc(vt), plan.o_desc(out), out,
        lse if return_lse else out, out, p.cu_seqlens_q if p.varlen else out,
        p.cu_seqlens_k if p.varlen else out,
        ones if p.q_descale is None else p.q_descale,
        ones if p.k_descale is None else p.k_descale,
        ones if p.v_descale is None else p.v_descale,
        sched_workspace(q) if plan.dynamic else out)
    return out, lse


def _plan(q, k, v, p, return_lse, config) -> _Plan:
    # The ALiBi slopes are a launch argument of the plan (after the scalars): their address too.
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
           p.launch_key, return_lse, config,
           p.alibi_slopes.data_ptr() if p.has_alibi else None)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _make_plan(q, k, v, p, return_lse, config))
    return plan


def _make_plan(q, k, v, p, return_lse, config) -> _Plan:
    """Everything :func:`attn_fwd` launches with but the tensors (``q`` stands in for unused
    pointer arguments, whose constexpr flag is off). ``q/k/v`` are ``(b, s, h, d)`` (varlen:
    ``b = 1``); ``out`` is a contiguous ``(b, s_q, h, d_v)`` tensor. Head dims run in the tiles
    of :data:`HEAD_DIM_TILES` (TMA boxes wider than the tensor: zeros read, nothing stored)."""
    varlen = p.varlen
    fp8 = q.dtype == FP8_DTYPE
    b, seqlen_q, h, d = q.shape
    d_v = v.shape[-1]
    d_tile, dv_tile = HEAD_DIM_TILES.get((d, d_v), (d, d_v))
    if varlen:
        batch, n_m_rows = p.cu_seqlens_q.numel() - 1, p.max_seqlen_q
    else:
        batch, n_m_rows = b, seqlen_q
    seqlen_k = k.shape[1]
    cfg = config or hopper_fwd_config(d_tile, p.has_right, p.has_softcap, fp8, dv_tile,
                                      has_lower=p.has_left, varlen=varlen, seqlen_k=seqlen_k,
                                      dropout=p.has_dropout)
    n_m = triton.cdiv(n_m_rows, cfg.consumers * cfg.block_m)
    num_tiles = n_m * h * batch
    sms = num_sms(q.device)
    if config is None and not (fp8 or varlen):
        # (rules on the problem's tile count: few causal tiles run longest first over all
        # heads; with Triton >= 3.9 few equal tiles store O from registers)
        if lpt_all_heads(p.causal and not p.has_left, num_tiles, sms, seqlen_k, d_tile,
                         batch * k.shape[2]):
            cfg = dataclasses.replace(cfg, lpt=LPT_ALL_HEADS)
        cfg = few_tiles_config(cfg, p.has_left or p.has_right, num_tiles / sms)
    grid_size = min(num_tiles, sms) if cfg.persistent else num_tiles
    dtype = q.dtype
    dynamic = cfg.persistent and cfg.dynamic
    args = (num_tiles, n_m, h, grid_size, seqlen_q, seqlen_k, p.group_size,
            p.qk_scale, p.softcap_prescale, p.left, p.right)
    flags = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                 HAS_LOWER=p.has_left, HAS_UPPER=p.has_right, HAS_SOFTCAP=p.has_softcap,
                 STORE_LSE=return_lse, HAS_SEQUSED_K=p.seqused_k is not None, IS_VARLEN=varlen,
                 CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
                 CONSUMERS=cfg.consumers, num_warps=4,
                 # persistent grids may claim their tiles and sort them (varlen tiles are
                 # counted for the longest sequence, unsorted by length)
                 LPT=0 if varlen else cfg.lpt, DYNAMIC=dynamic)
    out_shape = (b, seqlen_q, h, d_v)
    if fp8:
        # O (bf16) leaves through its own staging tile (on a persistent grid with o_staging,
        # its TMA store left in flight across the next tile), or from registers when
        # persistent without it or varlen (a varlen tile's rows past its sequence are the next
        # one's).
        out_dtype = FP8_OUT_DTYPE
        o_staging = cfg.persistent and cfg.o_staging and not varlen
        register_epilogue = (cfg.persistent and not o_staging) or varlen
        check_shared_memory(cfg, d, d, 1, o_tile=not register_epilogue)
        launch = Launch(attn_fwd_fp8_kernel, (grid_size,), args, descriptors=4, HEAD_DIM=d,
                        REGISTER_EPILOGUE=register_epilogue, O_STAGING=o_staging, **flags)
        o_desc = descriptors(out_shape, contiguous_strides(out_shape), out_dtype, cfg.block_m,
                              d)
        h_kv = k.shape[2]
        (sqb, sqs, sqh, _), (skb, sks, skh, _) = q.stride(), k.stride()
        if varlen:
            # Sequence i's keys from column fp8_varlen_v_start(cu_seqlens_k[i], i); the
            # columns a tile past the last sequence reads (< BLOCK_N) are written 0.
            s_pad = triton.cdiv(seqlen_k, _FP8_KEY_GROUP) * _FP8_KEY_GROUP + _FP8_KEY_GROUP * batch
            tail = max(c.block_n for c in _FP8_CONFIGS.values())
            vt_shape = (1, h_kv, d, s_pad)
            v_launch = Launch(fp8_v_transpose_varlen_kernel,
                              (triton.cdiv(p.max_seqlen_k + _FP8_KEY_GROUP + tail,
                                           _FP8_TRANSPOSE_BLOCK), batch * h_kv),
                              (batch, seqlen_k, s_pad, h_kv, v.stride(1), v.stride(2)),
                              HEAD_DIM=d, BLOCK_K=_FP8_TRANSPOSE_BLOCK, TAIL=tail, num_warps=4)
        else:
            s_pad = triton.cdiv(seqlen_k, _FP8_KEY_GROUP) * _FP8_KEY_GROUP
            vt_shape = (b, h_kv, d, s_pad)
            v_launch = Launch(fp8_v_transpose_kernel,
                              (triton.cdiv(s_pad, _FP8_TRANSPOSE_BLOCK), b * h_kv),
                              (seqlen_k, s_pad, h_kv, v.stride(0), v.stride(1), v.stride(2)),
                              HEAD_DIM=d, BLOCK_K=_FP8_TRANSPOSE_BLOCK, num_warps=4)
        return _Plan(
            tma_ready=tma_strides_ok(q) and tma_strides_ok(k) and v.stride(-1) == 1,
            out_dtype=out_dtype, lse_shape=(b, h, seqlen_q),
            q_desc=_fp8_descriptors((b, h, seqlen_q, d), (sqb, sqh, sqs, 1),
                                    (1, 1, cfg.block_m, d)),
            k_desc=_fp8_descriptors((b, h_kv, seqlen_k, d), (skb, skh, sks, 1),
                                    (1, 1, cfg.block_n, d)),
            v_desc=_fp8_descriptors(vt_shape, contiguous_strides(vt_shape),
                                    (1, 1, d, cfg.block_n)),
            o_desc=o_desc, launch=launch,
            fp8_ones=torch.ones((batch, h_kv), dtype=torch.float32, device=q.device),
            vt_shape=vt_shape, v_launch=v_launch, dynamic=dynamic)
    # An output not in q's dtype is stored from registers; q's descriptor stands in for the
    # unused o_desc then (its block shape and layout are the ones the kernel expects). The ALiBi
    # slopes follow the scalars (None when there are none: a constexpr, no kernel argument).
    out_dtype = p.out_dtype or dtype
    o_staging = cfg.persistent and cfg.o_staging and out_dtype == dtype and not varlen
    check_shared_memory(cfg, d_tile, dv_tile, q.element_size(), o_tile=o_staging)
    launch = Launch(
        attn_fwd_kernel, (grid_size,),
        args + (p.dropout_threshold, p.dropout_scale,
                p.alibi_slopes if p.has_alibi else None),
        descriptors=4, HEAD_DIM=d_tile, HEAD_DIM_V=dv_tile, V_COLS=d_v, HAS_ALIBI=p.has_alibi,
        HAS_DROPOUT=p.has_dropout,
        ALIBI_BATCHED=p.has_alibi and p.alibi_slopes.dim() == 2,
        REGISTER_EPILOGUE=(cfg.persistent and not o_staging) or out_dtype != dtype,
        O_STAGING=o_staging, **flags)
    return _Plan(
        tma_ready=all(tma_strides_ok(t) for t in (q, k, v)),
        out_dtype=out_dtype,
        lse_shape=(b, h, seqlen_q),
        q_desc=descriptors(q.shape, q.stride(), dtype, cfg.block_m, d_tile),
        k_desc=descriptors(k.shape, k.stride(), dtype, cfg.block_n, d_tile),
        v_desc=descriptors(v.shape, v.stride(), dtype, cfg.block_n, dv_tile),
        o_desc=descriptors(out_shape, contiguous_strides(out_shape), dtype, cfg.block_m,
                            dv_tile),
        launch=launch, dynamic=dynamic)


# Flag sets `solattn aot` compiles per head dim (data only: aot_calls.py replays them, each with
# the config hopper_fwd_config picks for its flags).
AOT_VARIANTS = {
    "plain": dict(),
    # (short causal claims its tiles at d=64: hopper_fwd_config; compiled at every head dim)
    "dynamic-causal": dict(HAS_UPPER=True, REGISTER_EPILOGUE=True, DYNAMIC=True),
    "causal": dict(HAS_UPPER=True),
    "window-softcap-seqused": dict(HAS_LOWER=True, HAS_UPPER=True, HAS_SOFTCAP=True,
                                   HAS_SEQUSED_K=True),
    "varlen": dict(IS_VARLEN=True),
    "varlen-causal": dict(HAS_UPPER=True, IS_VARLEN=True),
    "causal-lpt": dict(HAS_UPPER=True, LPT=LPT_ALL_HEADS),  # few tiles: lpt_all_heads
    # (seqlen_k is no constexpr: the problem size that picks the config, here short causal at
    # d=128, claiming its tiles with O staged: hopper_fwd_config; at d=64 and d=256 the binary
    # of dynamic-causal and causal)
    "short-causal": dict(HAS_UPPER=True, seqlen_k=_STAGED_CAUSAL_MAX_KEYS),
    # (d=128 causal up to 8192 keys: claimed and staged, longest first in head groups, or over
    # all heads when the tiles are few: lpt_all_heads; at d=64 and d=256 the binaries of
    # causal and causal-lpt)
    "mid-causal": dict(HAS_UPPER=True, seqlen_k=_STAGED_LPT_CAUSAL_MAX_KEYS),
    "few-causal": dict(HAS_UPPER=True, seqlen_k=_STAGED_LPT_CAUSAL_MAX_KEYS, LPT=LPT_ALL_HEADS),
}

# Per (head_dim, head_dim_v) pair beyond AOT_VARIANTS' head dims: ALiBi at d=128 (with the
# window + softcap combination and varlen), and the padded head dims of HEAD_DIM_TILES.
AOT_EXTRA_VARIANTS = {
    (128, 128): {
        # (tiles_per_sm is no constexpr: few equal tiles store O from registers under Triton
        # >= 3.9, few_tiles_config; with 3.6 the binaries of plain and alibi)
        "few": dict(tiles_per_sm=1),
        "alibi": dict(HAS_ALIBI=True),
        "alibi-few": dict(HAS_ALIBI=True, tiles_per_sm=1),
        "alibi-causal": dict(HAS_ALIBI=True, HAS_UPPER=True),
        "alibi-window-softcap": dict(HAS_ALIBI=True, HAS_LOWER=True, HAS_UPPER=True,
                                     HAS_SOFTCAP=True),
        "alibi-varlen-causal": dict(HAS_ALIBI=True, HAS_UPPER=True, IS_VARLEN=True),
        "dropout": dict(HAS_DROPOUT=True),
        "dropout-causal": dict(HAS_DROPOUT=True, HAS_UPPER=True),
        "dropout-window-softcap": dict(HAS_DROPOUT=True, HAS_LOWER=True, HAS_UPPER=True,
                                       HAS_SOFTCAP=True),
        "dropout-varlen-causal-alibi": dict(HAS_DROPOUT=True, IS_VARLEN=True, HAS_UPPER=True,
                                            HAS_ALIBI=True),
    },
    (64, 64): {"alibi-causal": dict(HAS_ALIBI=True, HAS_UPPER=True),
               "dropout-causal": dict(HAS_DROPOUT=True, HAS_UPPER=True),
               "dropout-varlen": dict(HAS_DROPOUT=True, IS_VARLEN=True)},
    (256, 256): {"alibi-causal": dict(HAS_ALIBI=True, HAS_UPPER=True),
                 "dropout": dict(HAS_DROPOUT=True),
                 "dropout-causal": dict(HAS_DROPOUT=True, HAS_UPPER=True),
                 "dropout-window": dict(HAS_DROPOUT=True, HAS_LOWER=True, HAS_UPPER=True),
                 "dropout-window-softcap": dict(HAS_DROPOUT=True, HAS_LOWER=True,
                                                HAS_UPPER=True, HAS_SOFTCAP=True),
                 "dropout-varlen-causal": dict(HAS_DROPOUT=True, IS_VARLEN=True,
                                               HAS_UPPER=True)},
    (96, 96): {"plain": dict(), "causal": dict(HAS_UPPER=True),
               "varlen-causal": dict(HAS_UPPER=True, IS_VARLEN=True)},
    (192, 192): {"plain": dict(), "causal": dict(HAS_UPPER=True),
                 "varlen-causal": dict(HAS_UPPER=True, IS_VARLEN=True)},
    (192, 128): {"plain": dict(), "causal": dict(HAS_UPPER=True),
                 "varlen-causal": dict(HAS_UPPER=True, IS_VARLEN=True),
                 "alibi-causal": dict(HAS_ALIBI=True, HAS_UPPER=True)},
}

# The same for the FP8 kernel (attn_fwd_fp8_kernel): no seqused_k (at fp8_band_only_head_dims()
# neither softcap nor HAS_LOWER).
AOT_FP8_VARIANTS = {
    "plain": dict(),
    "causal": dict(HAS_UPPER=True),
    # (causal up to 8192 keys: the staged persistent grid; "causal", longer: claimed and staged,
    # longest first in head groups, at d=64/128, one CTA a tile at d=256)
    "short-causal": dict(HAS_UPPER=True, seqlen_k=_FP8_STAGED_CAUSAL_MAX_KEYS),
    "window-softcap": dict(HAS_LOWER=True, HAS_UPPER=True, HAS_SOFTCAP=True),
    "window": dict(HAS_LOWER=True, HAS_UPPER=True),
    "varlen": dict(IS_VARLEN=True),
    "varlen-causal": dict(HAS_UPPER=True, IS_VARLEN=True),
}
