"""Host side of the Hopper backward (:mod:`solattn.kernels.hopper.backward`): which calls it
covers and prefers, the GQA split of a call, the workspaces, descriptors, launch plans and
launcher, and the flag sets `solattn aot` compiles."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from solattn.configs.hopper_backward import (
    HopperBwdConfig as HopperBwdConfig,  # re-exported: a launcher's config type
)
from solattn.configs.hopper_backward import (
    default_gqa_splits,
    dropout_scores_tile,
    hopper_bwd_config,
    lpt_grid,
    stagger_of,
)
from solattn.device import triton_version
from solattn.kernels.hopper.backward import (
    CONSUMER_WARPS,
    CONVERT_ROWS,
    PREPROCESS_ROWS,
    REDUCE_ELEMENTS,
    SUPPORTED_HEAD_DIMS,
    attn_bwd_kernel,
    bwd_dkdv_reduce_kernel,
    bwd_dq_convert_kernel,
    bwd_preprocess_kernel,
)
from solattn.kernels.hopper.compat import HAS_LOCAL_SYNC
from solattn.kernels.hopper.pipeline import (
    smem_layout,
    tma_ready,
    tma_strides_ok,
    unsupported_operands,
)
from solattn.kernels.keys import primed
from solattn.launch import DescriptorCache, Launch, PlanCache
from solattn.params import LOG2E


def gqa_splits_of(q, k, p, config=None) -> int:
    """:func:`default_gqa_splits` of a call (what :func:`attn_bwd` uses by default). Varlen:
    the grid covers the longest key sequence in every sequence's row."""
    from solattn.device import num_sms

    if p.group_size == 1 or not p.causal:  # (no device query on the host path of the others)
        return 1
    cfg = config or config_of(q.shape[-1], p)
    n_seqs = p.cu_seqlens_q.numel() - 1 if p.varlen else q.shape[0]
    n_k = p.max_seqlen_k if p.varlen else k.shape[1]
    n_ctas = triton.cdiv(n_k, cfg.block_n) * k.shape[-2] * n_seqs
    return default_gqa_splits(n_ctas, p.group_size, p.causal, num_sms(q.device))


def config_of(head_dim: int, p) -> HopperBwdConfig:
    """The config a call with params ``p`` runs at ``head_dim``: ``hopper_bwd_config`` with
    ``scores`` when the call transforms scores (softcap, ALiBi) and ``dropout``."""
    return hopper_bwd_config(head_dim, p.has_softcap or p.has_alibi, p.has_dropout)


def variant_covered(head_dim: int, flags: dict) -> bool:
    """Whether calls with the constexpr flag set ``flags`` (an :data:`AOT_VARIANTS` row) run on
    this kernel at ``head_dim`` with the installed Triton (:func:`covers`' build rule,
    :func:`deterministic_covered`); the rows `solattn aot` compiles."""
    band = flags.get("HAS_LOWER", False) or flags.get("HAS_UPPER", False)
    return not flags.get("DETERMINISTIC") or deterministic_covered(
        head_dim, band, flags.get("HAS_ALIBI", False), flags.get("IS_VARLEN", False))


def deterministic_covered(head_dim: int, band: bool, alibi: bool, varlen: bool = False) -> bool:
    """Whether ``deterministic=True`` runs on this kernel for a call with a causal or window
    ``band``, ``alibi`` and ``varlen``: with triton >= 3.9 not with ALiBi under a band at
    d=128 and 256, nor varlen at d=64 and 128, whose builds with the ordered walk
    (:func:`~solattn.kernels.hopper.backward._step_coords`) its ptxas spills in the step loops
    (`solattn aot --arch 90`; d=128, 2026-11-28: causal + ALiBi 16 B, 2 local accesses in the
    loop, causal + softcap + ALiBi the same, varlen 24 B, 4 accesses; d=256, 2026-11-29: causal
    + ALiBi 40 B, 5-6 in the loop, varlen causal + ALiBi 16 B, 2; d=64, 2026-11-29, since the
    two dQ writer warps: varlen 24 B, 4 accesses in the writers' loops; the d=256 varlen builds
    without ALiBi compile spill-free). Every build compiles without a loop spill with triton
    3.6 (the band's split columns, :func:`~solattn.kernels.hopper.backward._edge_mask`)."""
    if triton_version() < (3, 9):
        return True
    if head_dim == 64:
        return not varlen
    return not (band and alibi) and not (varlen and head_dim == 128)


def covers(q, v, lse, p) -> tuple[bool, str]:
    """Whether this kernel runs the backward of the call (:class:`solattn.params.AttnParams`
    ``p``), and why not (the portable backward runs it then)."""
    why = unsupported_operands(q, v, SUPPORTED_HEAD_DIMS)
    if why:
        return False, why
    if p.paged:
        return False, "paged K/V (block_table) not implemented"
    if p.scale <= 0:
        # Masked scores start at -inf and are scaled by scale * log2(e) in the kernel.
        return False, f"softmax_scale {p.scale} <= 0"
    if p.seqused_k is not None:
        return False, "seqused_k not implemented"
    if p.deterministic and not deterministic_covered(q.shape[-1], p.has_left or p.has_right,
                                                     p.has_alibi, p.varlen):
        return False, ("deterministic=True with triton >= 3.9, with ALiBi and a causal or window "
                       "band at d=128/256, or varlen at d=64/128 (those builds spill with the "
                       "ordered walk)")
    if p.varlen:
        rows = q.shape[0] + (p.cu_seqlens_q.numel() - 1) * 132
    else:
        rows = q.shape[0] * triton.cdiv(q.shape[1], 128) * 128
    if rows * q.shape[-2] >= 2**31 or v.shape[:-1].numel() >= 2**31:
        # int32 row indices: the per-row columns' TMA coordinate, the dK/dV epilogue's rows.
        return False, "batch * seqlen * heads >= 2**31"
    return True, "covered"


# (head dim, causal) -> whether the dispatcher picks this kernel over the portable backward by
# default, and the measurement behind it (SOLATTN_BACKEND=hopper runs it wherever it covers).
_PREFERRED = {
    # H100 80GB, bf16, 2026-11-23 (docs/hopper-backward.md): TFLOP/s of this kernel vs the
    # portable backward (scripts/bench_hopper_backward.py) and, shipped config, vs cuDNN in
    # the same process (scripts/bench_hopper_bwd_variants.py).
    (64, False): (True, "measured faster (B4 H32 L4096: 386-396 vs 354 portable; cuDNN "
                        "413-453)"),
    (64, True): (True, "measured faster (B4 H32 L4096 causal: 350 vs 306 portable; cuDNN "
                       "357-372)"),
    (128, False): (True, "measured faster (B4 H16 L4096: 467-488 vs 363 portable; cuDNN "
                         "497-552)"),
    (128, True): (True, "measured faster (B4 H16 L4096 causal: 388-428 vs 324; B1 H16 L16384: "
                        "499-529 vs 391 portable; cuDNN 438-444, 511-521)"),
    # H200, triton 3.6, 2026-11-29, `solattn bench --suite backward --shapes D256`.
    (256, False): (True, "measured faster (B2 H8 L4096: 322 vs 155 portable; cuDNN 362, FA2 "
                         "252)"),
    (256, True): (True, "measured faster (B2 H8 L4096 causal: 289 vs 138 portable; cuDNN 334, "
                        "FA2 217)"),
}

# (feature, head dim) -> the same for calls with a sliding window, softcap or varlen (the first
# of them in this order decides). H100 80GB, bf16, scripts/bench_hopper_features.py,
# 2026-11-23, TFLOP/s of this kernel vs the portable backward in the same run (B4 L4096, H16
# at d=128 and H32 at d=64; varlen: 12 sequences of 256-4096 tokens).
_PREFERRED_FEATURES = {
    ("window", 128): (True, "measured faster (window (1024, 1024): 415 vs 309; causal window "
                            "1024: 322 vs 258 TFLOP/s)"),
    ("window", 64): (True, "measured faster (window (1024, 1024): 312 vs 265; causal window "
                           "1024: 251 vs 224 TFLOP/s)"),
    ("softcap", 128): (True, "measured faster (softcap 50: 431 vs 202; causal: 364 vs 188 "
                             "TFLOP/s)"),
    ("softcap", 64): (True, "measured faster (softcap 50: 298 vs 163; causal: 260 vs 144 "
                            "TFLOP/s)"),
    # (Varlen calls with softcap take the softcap row; H200, 2026-11-28, `solattn bench --suite
    # varlen`, 12 sequences of 256-4096 tokens, softcap 50: 377 vs 174, causal 300 vs 176
    # TFLOP/s at d=128 H16; 281 vs 137, 227 vs 128 at d=64 H32.)
    # 12 sequences of 256-4096 tokens (28 862 in all), H16 at d=128, H32 at d=64.
    ("varlen", 128): (True, "measured faster (12 sequences: 430 vs 347; causal: 352 vs 293 "
                            "TFLOP/s)"),
    ("varlen", 64): (True, "measured faster (12 sequences: 340 vs 310; causal: 272 vs 263 "
                           "TFLOP/s)"),
    # ALiBi slopes 2^(-8 i / H), B4 L4096; H100, 2026-11-26.
    ("alibi", 128): (True, "measured faster (H16: 489 vs 235; causal: 409 vs 212 TFLOP/s)"),
    ("alibi", 64): (True, "measured faster (H32: 369 vs 233; causal: 321 vs 181 TFLOP/s)"),
    # Dropout 0.1, H200, 2026-11-28, `solattn bench --suite dropout --trees`, forward +
    # backward against the tree without the Hopper dropout (portable backward; the forwards
    # within 2% at d=64, 4-5% at d=128), B4 L4096, triton 3.6: d=64 H32 216 vs 130, causal 197
    # vs 122 (3.9 the same within 1%); d=128 H16 342 vs 198, causal 304 vs 180 (3.9: 350 vs
    # 201, 283 vs 188; FA2's dropout through SDPA 285 / 246).
    ("dropout", 64): (True, "measured faster (forward + backward with dropout 0.1: 216 vs 130; "
                            "causal: 197 vs 122 TFLOP/s)"),
    ("dropout", 128): (True, "measured faster (forward + backward with dropout 0.1: 342 vs "
                             "198; causal: 304 vs 180 TFLOP/s)"),
    # d=256, H200, triton 3.6, 2026-11-29, backward only, B2 H8 L4096 (varlen: the varlen
    # suite's 12 sequences of 256-4096 tokens, H8), this kernel vs the portable backward in
    # one process, 3 interleaved rounds (docs/runs/2026-11-29-h200-bwd-d256.txt).
    ("window", 256): (True, "measured faster (window (1024, 1024): 325 vs 159; causal window "
                            "1024: 280 vs 132 TFLOP/s)"),
    ("softcap", 256): (True, "measured faster (causal softcap 30: 272 vs 71; varlen causal "
                             "softcap 50: 267 vs 75 TFLOP/s)"),
    ("varlen", 256): (True, "measured faster (12 sequences: 330 vs 152; causal: 271 vs 153 "
                            "TFLOP/s)"),
    ("alibi", 256): (True, "measured faster (ALiBi: 311 vs 86; causal: 282 vs 76 TFLOP/s)"),
    # Dropout 0.1 at d=256, H200, 2026-11-29, `tools/bwd_features.py --head-dim 256 --only
    # dropout` (B2 H8 L4096, backward only, triton 3.6; 3.9 within 3%): 350 vs 119, causal 306
    # vs 103, causal softcap 30 295 vs 56 (docs/runs/2026-11-29-h200-s29.txt).
    ("dropout", 256): (True, "measured faster (dropout 0.1: 350 vs 119; causal: 306 vs 103 "
                             "TFLOP/s)"),
    # Dropout 0.1 beside softcap or ALiBi on the 64-key tile (dropout_scores_tile), H200,
    # 2026-11-29, `tools/bwd_features.py --head-dim D --only dropout`, backward only, B2 H8
    # L4096, 3 rounds: d=128 triton 3.6, d=64 triton 3.9 (docs/runs/2026-11-29-h200-s30.txt).
    ("dropout with softcap or ALiBi", 128): (
        True, "measured faster (dropout 0.1: causal softcap 30 260 vs 104, causal ALiBi 282 vs "
              "116 TFLOP/s)"),
    ("dropout with softcap or ALiBi", 64): (
        True, "measured faster (dropout 0.1: causal softcap 30 170 vs 68, causal ALiBi 188 vs "
              "74 TFLOP/s)"),
}


# Packed sequences of at most this many keys (short documents) run the portable backward: this
# kernel's CTA holds one key block of one sequence, so short documents give it a few query
# blocks per CTA, each CTA paying its start and dK/dV epilogue. H100, bf16, causal, TFLOP/s
# this kernel vs the portable backward (2026-11-26, one process): 40 documents of 64-1024
# tokens 136 vs 159 (d=128, H16), 100 vs 133 (d=64, H32); 64 of 256 60 vs 83, 57 vs 82; 12
# sequences of 256-4096 293 vs 264, 266 vs 256 (this kernel ahead). Windows and ALiBi, where
# the portable backward is the slower one on long sequences (_PREFERRED_FEATURES), were not
# measured on short documents and keep this kernel.
_VARLEN_SHORT_KEYS = 1024


def preferred(q, p) -> tuple[bool, str]:
    """Whether a call :func:`covers` accepts runs here by default, and why (or why not).
    Deterministic calls follow the same rules: their dQ order cost 6-10% at d=128 (H200,
    2026-11-28, docs/hopper-backward.md) and 4-11% at d=64 with 128 queries a step (19-32% with
    64; H200, 2026-11-28, BENCHMARKS.md), against the portable backward's margins of 10-100%
    below this kernel (its deterministic dQ was not timed beside it)."""
    ok, why = _preferred(q, p)
    if p.deterministic:
        why += " (deterministic: dQ added in key-block order, 0.89-0.96x the default)"
    return ok, why


def _preferred(q, p) -> tuple[bool, str]:
    d = q.shape[-1]
    window = p.has_left or (p.has_right and not p.causal)
    if (p.varlen and p.max_seqlen_k <= _VARLEN_SHORT_KEYS and not window
            and not p.has_alibi):
        return False, (f"not the default: varlen of at most {_VARLEN_SHORT_KEYS} keys a "
                       f"sequence: the portable backward measured faster (0.70-0.86x at "
                       f"d=64/128; d=256 not measured)")
    scores_tile = dropout_scores_tile(d, p.has_softcap or p.has_alibi, p.has_dropout)
    for feature, on in (("dropout with softcap or ALiBi", scores_tile),
                        ("dropout", p.has_dropout), ("window", window),
                        ("softcap", p.has_softcap), ("varlen", p.varlen),
                        ("alibi", p.has_alibi)):
        if on:
            ok, why = _PREFERRED_FEATURES[(feature, d)]
            return ok, ("default: " if ok else "not the default: ") + f"{feature}: {why}"
    ok, why = _PREFERRED[(d, p.causal)]
    return ok, ("default: " if ok else "not the default: ") + why


COL_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


@dataclass(frozen=True)
class _Plan:
    """Everything :func:`attn_bwd` launches with but the tensors, per problem (see
    :mod:`solattn.launch`): the preprocess and main launches, descriptors by base address."""

    n_cols: int            # length of the lse / Delta columns (b, h, seqlen_q_pad), flat
    dq_shape: tuple        # the fp32 dQ accumulator (b, h, seqlen_q_pad, d)
    preprocess: Launch     # bwd_preprocess_kernel
    launch: Launch         # attn_bwd_kernel
    reduce: Launch | None  # bwd_dkdv_reduce_kernel (a split GQA group's partial dK/dV)
    convert: Launch | None  # bwd_dq_convert_kernel (not varlen: those gather dQ's rows)
    tma_ready: bool        # q, k, v, dO strides TMA-readable (their bases are checked per call)
    q_desc: DescriptorCache
    k_desc: DescriptorCache
    v_desc: DescriptorCache
    do_desc: DescriptorCache
    lse_desc: DescriptorCache
    delta_desc: DescriptorCache
    dkv_desc: DescriptorCache | None  # the dK / dV outputs' (TMA_EPILOGUE), else None


_PLANS = PlanCache()


def fp32_workspace(n_cols: int, dq_shape: tuple, device, turns: bool = False):
    """``(-lse column, -Delta column, dQ accumulator)`` of one backward call: views of one fp32
    allocation (one allocator call, not three; each view starts 16-byte aligned, ``n_cols``
    being a multiple of 4). Left uninitialized: :func:`bwd_preprocess_kernel` writes all three
    (it zeroes the accumulator's rows). ``turns``: ``n_cols / 4`` more words after the
    accumulator, the deterministic mode's int32 turn counters
    (:func:`~solattn.kernels.hopper.backward.turn_counters`; the preprocess zeroes them with
    ``ZERO_TURNS``, varlen calls with the accumulator's fill)."""
    dq_size = n_cols * dq_shape[-1]
    ws = torch.empty(2 * n_cols + dq_size + (n_cols // 4 if turns else 0), dtype=torch.float32,
                     device=device)
    return ws[:n_cols], ws[n_cols:2 * n_cols], ws[2 * n_cols:2 * n_cols + dq_size].view(dq_shape)


def rows_desc(t: torch.Tensor, rows: int) -> DescriptorCache:
    """Rank-4 descriptors over the ``(b, h, s, d)`` view of ``(b, s, h, d)`` tensors shaped and
    strided as ``t``, ``[1, 1, rows, d]`` tiles, by base address."""
    b, s, h, d = t.shape
    sb, ss, sh, _ = t.stride()
    layout = smem_layout(t.dtype)
    return DescriptorCache(lambda base: TensorDescriptor(base, [b, h, s, d], [sb, sh, ss, 1],
                                                         [1, 1, rows, d], layout))


def cols_desc(n: int, rows: int) -> DescriptorCache:
    """Rank-1 descriptors over flat fp32 ``(b, h, seqlen_q_pad)`` buffers of ``n`` elements,
    ``rows`` a tile, by base address."""
    return DescriptorCache(lambda base: TensorDescriptor(base, [n], [1], [rows], COL_LAYOUT))


def dkdv_reduce_launch(kv_shape, splits: int, batch: int, varlen: bool) -> Launch:
    """The :func:`bwd_dkdv_reduce_kernel` launch of a split group: ``launch(dk_part, dv_part,
    dk, dv, cu_seqlens_k)`` sums the fp32 partials ``(*kv_shape[:-2], h_kv * splits, d)`` into
    ``dk``, ``dv`` shaped ``kv_shape`` (``cu_seqlens_k`` of the ``batch`` sequences, varlen
    only: any tensor otherwise)."""
    n_rows, d = math.prod(kv_shape[:-1]), kv_shape[-1]
    block_r = REDUCE_ELEMENTS // d
    return Launch(bwd_dkdv_reduce_kernel, (triton.cdiv(n_rows, block_r),),
                  (n_rows, splits, batch, kv_shape[-2]), HEAD_DIM=d, BLOCK_R=block_r,
                  IS_VARLEN=varlen, num_warps=4)


def _make_plan(q, k, v, do, out, lse_stride, dlse_stride, has_dlse, p, cfg, group, splits,
               batch, seqlen_q, seqlen_q_pad, seqlen_k, n_q_blocks, n_keys) -> _Plan:
    """The :class:`_Plan` of a call (tensors as :func:`attn_bwd` launches with them; ``group``
    the query heads per CTA: the GQA group's size / ``splits``)."""
    from solattn.kernels.common import strides4

    h, d = q.shape[-2], q.shape[-1]
    h_kv = k.shape[-2] * splits  # the kernel's KV heads: splits CTAs per key block and KV head
    n_batch = 1 if p.varlen else batch
    n_cols = n_batch * h * seqlen_q_pad
    preprocess = Launch(
        bwd_preprocess_kernel, (n_q_blocks * cfg.block_m // PREPROCESS_ROWS, h, batch),
        (*strides4(out), *strides4(do), *lse_stride, *dlse_stride,
         seqlen_q, seqlen_q_pad, math.log(2.0) if p.has_softcap else p.scale,
         1.0 - p.dropout_p),
        HEAD_DIM=d, BLOCK_M=PREPROCESS_ROWS, HAS_DLSE=has_dlse, IS_VARLEN=p.varlen,
        ROW_PAD=cfg.block_m, ZERO_TURNS=p.deterministic and not p.varlen, num_warps=8)
    from solattn.device import num_sms

    n_blocks = triton.cdiv(n_keys, cfg.block_n)
    # dK / dV by TMA where they are the outputs (unsplit) of one non-packed batch (a packed
    # sequence's last key block shares its rows with the next sequence's)
    tma_epilogue = splits == 1 and not p.varlen
    lpt = lpt_grid(cfg, n_blocks * k.shape[-2] * batch, n_blocks, splits, p.causal,
                   num_sms(q.device), group, p.deterministic)
    launch = Launch(
        attn_bwd_kernel, (h_kv, n_blocks, batch) if lpt else (n_blocks, h_kv, batch),
        (h, h_kv, seqlen_q, seqlen_q_pad, seqlen_k, group, splits,
         p.left, p.right, p.qk_scale, p.softcap_prescale, p.scale,
         LOG2E / p.qk_scale if p.has_alibi else 0.0, *p.alibi_strides,
         p.dropout_threshold, p.dropout_scale),
        descriptors=8,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        HAS_LOWER=p.has_left, HAS_UPPER=p.has_right, HAS_SOFTCAP=p.has_softcap,
        IS_VARLEN=p.varlen, LOOKAHEAD=cfg.lookahead, DQ_WRITER=cfg.dq_writer,
        PRODUCER_REGS=cfg.producer_regs, DK_FROM_REGS=cfg.dk_from_regs, DQ_PAD=cfg.dq_pad,
        DQ_VEC=cfg.dq_vec, WRITER_ROWS=cfg.writer_rows, LPT=lpt, STAGGER=stagger_of(cfg, p),
        HAS_ALIBI=p.has_alibi, TMA_EPILOGUE=tma_epilogue, DETERMINISTIC=p.deterministic,
        LOCAL_SYNC=cfg.local_sync and HAS_LOCAL_SYNC, HAS_DROPOUT=p.has_dropout,
        num_warps=CONSUMER_WARPS.value)
    reduce = dkdv_reduce_launch(k.shape, splits, batch, p.varlen) if splits > 1 else None
    convert = None if p.varlen else Launch(
        bwd_dq_convert_kernel, (triton.cdiv(seqlen_q, CONVERT_ROWS), h, batch),
        (seqlen_q, seqlen_q_pad), HEAD_DIM=d, BLOCK_M=CONVERT_ROWS, num_warps=4)
    return _Plan(n_cols=n_cols, dq_shape=(n_batch, h, seqlen_q_pad, d), preprocess=preprocess,
                 launch=launch, reduce=reduce, convert=convert,
                 tma_ready=all(tma_strides_ok(t) for t in (q, k, v, do)),
                 q_desc=rows_desc(q, cfg.block_m),
                 k_desc=rows_desc(k, cfg.block_n), v_desc=rows_desc(v, cfg.block_n),
                 do_desc=rows_desc(do, cfg.block_m), lse_desc=cols_desc(n_cols, cfg.block_m),
                 delta_desc=cols_desc(n_cols, cfg.block_m),
                 dkv_desc=(rows_desc(torch.empty(k.shape, dtype=k.dtype, device="meta"),
                                      cfg.block_n) if tma_epilogue else None))


# dK / dV descriptors over caller-given outputs (views of a packed gradient: attn_bwd's
# ``grads``), per shape, strides and dtype.
_OUT_DESCS = PlanCache()


def _out_desc(t: torch.Tensor, rows: int) -> DescriptorCache:
    key = (t.shape, t.stride(), t.dtype, rows)
    desc = _OUT_DESCS.get(key)
    if desc is None:
        desc = _OUT_DESCS.put(key, rows_desc(t, rows))
    return desc


@primed
def attn_bwd(do, q, k, v, out, lse, p, *, dlse=None, config=None, gqa_splits=None, grads=None):
    """Gradients ``(dq, dk, dv)`` for :class:`solattn.params.AttnParams` ``p`` on validated,
    non-empty inputs that :func:`covers` accepts.

    ``q (b, s_q, h, d)``, ``k``/``v (b, s_k, h_kv, d)``, ``out``/``do (b, s_q, h, d)`` (any
    strides), ``lse`` float32 ``(b, h, s_q)``, ``dlse`` like ``lse`` or None; fp16/bf16, d in
    64/128. Varlen (``p.cu_seqlens_q/k``): ``q``/``out``/``do (t_q, h, d)``, ``k``/``v (t_k,
    h_kv, d)`` packed, ``lse (h, t_q)``; rows past ``cu_seqlens[-1]`` get zero gradients. Same
    contract as :func:`solattn.kernels.triton.backward.attn_bwd`; dQ is summed with fp32
    atomics, in key-block order with ``p.deterministic`` (bitwise reproducible: module
    docstring; needs a ``config`` with ``dq_writer``). ``config`` overrides the
    :class:`HopperBwdConfig` of the head dim (benchmark sweeps); ``gqa_splits`` the query-head
    splits of a GQA group (default :func:`gqa_splits_of`). ``grads``: optional ``(dq, dk, dv)``
    outputs (each may be None; views of a packed gradient,
    :func:`solattn.interface.attn_backward`): where the dK/dV TMA epilogue runs (one unsplit,
    non-varlen batch) and the given dK and dV are TMA-writable, the kernel stores into them and
    returns them; otherwise it returns tensors of its own.
    """
    varlen = p.varlen
    d = q.shape[-1]
    cfg = config or config_of(d, p)
    if p.deterministic and not cfg.dq_writer:
        raise ValueError("config: deterministic=True needs dq_writer=True (the writer warp adds "
                         "dQ in key-block order), got dq_writer=False")
    splits = gqa_splits_of(q, k, p, cfg) if gqa_splits is None else gqa_splits
    if not isinstance(splits, int) or splits < 1 or p.group_size % splits:
        raise ValueError(f"gqa_splits: expected a divisor of the group size {p.group_size}, "
                         f"got {splits}")
    # A split group: `splits` CTAs per key block and KV head, each over group / splits query
    # heads, reading K/V in place (attn_bwd_kernel's kv_splits) and writing fp32 partial dK/dV
    # that bwd_dkdv_reduce_kernel sums in split order and rounds once.
    group = p.group_size // splits
    if varlen:
        # The packed tensors are one batch entry; CTAs find their sequence in cu_seqlens and
        # its rows of the per-row buffers at varlen_row_offset (padded: whole query blocks
        # per sequence).
        batch = p.cu_seqlens_q.numel() - 1
        total_q = q.shape[0]
        q, k, v, out, do = (t.unsqueeze(0) for t in (q, k, v, out, do))
        lse_b, dlse_b = lse.unsqueeze(0), (dlse.unsqueeze(0) if dlse is not None else None)
        seqlen_q, seqlen_k = total_q, k.shape[1]
        # A multiple of 4: every head's slab of the per-row buffers starts 16-byte aligned
        # (the columns' TMA loads), as varlen_row_offset keeps each sequence's start.
        seqlen_q_pad = triton.cdiv(total_q + batch * (cfg.block_m + 4), 4) * 4
        n_q_blocks, n_keys = triton.cdiv(p.max_seqlen_q, cfg.block_m), p.max_seqlen_k
        lse_stride = (0, *lse.stride())
        dlse_stride = (0, *dlse.stride()) if dlse is not None else (0, 0, 0)
        cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = k.shape[1]
        seqlen_q_pad = triton.cdiv(seqlen_q, cfg.block_m) * cfg.block_m
        n_q_blocks, n_keys = seqlen_q_pad // cfg.block_m, seqlen_k
        lse_b, dlse_b = lse, dlse
        lse_stride = lse.stride()
        dlse_stride = dlse.stride() if dlse is not None else (0, 0, 0)
        cu_q = cu_k = lse  # unused pointer arguments (IS_VARLEN off)

    def plan_of(q, k, v, do) -> _Plan:
        key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), out.shape,
               out.stride(), lse_b.shape, lse_b.stride(),
               None if dlse_b is None else dlse_b.stride(), q.dtype, k.dtype, q.device,
               p.launch_key, cfg, splits, seqlen_q_pad, n_q_blocks, n_keys, batch)
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS.put(key, _make_plan(q, k, v, do, out, lse_stride, dlse_stride,
                                              dlse_b is not None, p, cfg, group, splits, batch,
                                              seqlen_q, seqlen_q_pad, seqlen_k, n_q_blocks,
                                              n_keys))
        return plan

    plan = plan_of(q, k, v, do)
    if not plan.tma_ready or (q.data_ptr() | k.data_ptr() | v.data_ptr() | do.data_ptr()) & 15:
        q, k, v, do = tma_ready(q), tma_ready(k), tma_ready(v), tma_ready(do)
        plan = plan_of(q, k, v, do)
    lse_init, delta_init, dq_acc = fp32_workspace(plan.n_cols, plan.dq_shape, q.device,
                                                  turns=p.deterministic)
    if varlen:
        # The preprocess zeroes each sequence's rows; packed rows past cu_seqlens_q[-1] map to
        # rows of no sequence (the gather below reads them as zeros). The deterministic turn
        # counters after the accumulator go in the same fill: all of them, whatever lengths
        # cu_seqlens holds (a counter left unzeroed could stall its turn forever).
        n_turns = plan.n_cols // 4 if p.deterministic else 0
        dq_acc.as_strided((dq_acc.numel() + n_turns,), (1,)).zero_()
    plan.preprocess(out, do, lse_b, dlse_b if dlse_b is not None else lse_b, lse_init,
                    delta_init, dq_acc, cu_q)
    if splits > 1:
        # Partials at the kernel's head j = h * splits + r: the reduce reads a row's splits
        # contiguously and zeroes varlen rows past cu_seqlens_k[-1] itself.
        part_shape = (*k.shape[:-2], k.shape[-2] * splits, d)
        dk_part = torch.empty(part_shape, dtype=torch.float32, device=k.device)
        dv_part = torch.empty(part_shape, dtype=torch.float32, device=k.device)
    k_desc, v_desc = plan.k_desc(k), plan.v_desc(v)
    g_k, g_v = (None, None) if grads is None else grads[1:]
    if (plan.dkv_desc is not None and g_k is not None and g_v is not None
            and g_k.shape == k.shape and g_k.dtype == k.dtype and g_v.stride() == g_k.stride()
            and tma_strides_ok(g_k) and (g_k.data_ptr() | g_v.data_ptr()) & 15 == 0):
        dk, dv = g_k, g_v  # written in place by the TMA epilogue
        out_desc = _out_desc(dk, cfg.block_n)
        dk_desc, dv_desc = out_desc(dk), out_desc(dv)
    else:
        # Varlen rows past cu_seqlens_k[-1] belong to no sequence: zero gradients.
        if varlen and splits == 1:
            dk, dv = k.new_zeros(k.shape), v.new_zeros(v.shape)
        else:
            dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
        dk_desc, dv_desc = ((plan.dkv_desc(dk), plan.dkv_desc(dv)) if plan.dkv_desc is not None
                            else (k_desc, v_desc))
    plan.launch(plan.q_desc(q), k_desc, v_desc, plan.do_desc(do),
                plan.lse_desc(lse_init), plan.delta_desc(delta_init), dk_desc, dv_desc, dq_acc,
                dk_part if splits > 1 else dk, dv_part if splits > 1 else dv, cu_q, cu_k,
                p.alibi_slopes if p.has_alibi else cu_q, p.dropout_seed if p.has_dropout else cu_q)
    if splits > 1:
        plan.reduce(dk_part, dv_part, dk, dv, cu_k)
    if varlen:
        # Packed row r of sequence s sits at buffer row r - q_off + varlen_row_offset(q_off,
        # s); rows past cu_seqlens_q[-1] land past every sequence's rows (zeros).
        rows = torch.arange(total_q, dtype=cu_q.dtype, device=q.device)
        seq = torch.searchsorted(cu_q, rows, right=True) - 1
        q_off = cu_q[seq].long()
        idx = rows - q_off + (q_off // 4) * 4 + seq * (cfg.block_m + 4)
        dq = dq_acc[0].transpose(0, 1).index_select(0, idx)
        dq, dk, dv = dq.to(q.dtype), dk[0], dv[0]
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        plan.convert(dq_acc, dq)
    return dq, dk, dv


# Flag sets `solattn aot` compiles per head dim (data only: aot_calls.py replays them).
AOT_VARIANTS = {
    "plain": dict(),
    "causal": dict(HAS_UPPER=True),
    "window": dict(HAS_LOWER=True, HAS_UPPER=True),
    "softcap": dict(HAS_SOFTCAP=True),
    "causal-softcap": dict(HAS_UPPER=True, HAS_SOFTCAP=True),
    "varlen": dict(IS_VARLEN=True),
    "varlen-causal": dict(HAS_UPPER=True, IS_VARLEN=True),
    "varlen-window": dict(HAS_LOWER=True, HAS_UPPER=True, IS_VARLEN=True),
    "alibi": dict(HAS_ALIBI=True),
    "causal-alibi": dict(HAS_UPPER=True, HAS_ALIBI=True),
    "causal-softcap-alibi": dict(HAS_UPPER=True, HAS_SOFTCAP=True, HAS_ALIBI=True),
    "varlen-causal-alibi": dict(HAS_UPPER=True, IS_VARLEN=True, HAS_ALIBI=True),
    "varlen-softcap": dict(IS_VARLEN=True, HAS_SOFTCAP=True),
    "varlen-causal-softcap": dict(HAS_UPPER=True, IS_VARLEN=True, HAS_SOFTCAP=True),
    "varlen-window-softcap": dict(HAS_LOWER=True, HAS_UPPER=True, IS_VARLEN=True,
                                  HAS_SOFTCAP=True),
    "causal-dropout": dict(HAS_UPPER=True, HAS_DROPOUT=True),
    "varlen-window-dropout": dict(HAS_LOWER=True, HAS_UPPER=True, IS_VARLEN=True,
                                  HAS_DROPOUT=True),
    "varlen-window-softcap-alibi-dropout": dict(HAS_LOWER=True, HAS_UPPER=True, IS_VARLEN=True,
                                                HAS_SOFTCAP=True, HAS_ALIBI=True,
                                                HAS_DROPOUT=True),
}
# deterministic=True (the writer warp's ordered adds, the ordered walk) with each flag set.
AOT_VARIANTS.update({f"{name}-determ": {**flags, "DETERMINISTIC": True}
                     for name, flags in list(AOT_VARIANTS.items())})
