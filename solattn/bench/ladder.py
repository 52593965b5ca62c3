"""The seeds' ladder rebuilt in Triton. TEACHING CODE: no user path imports this module.

``solattn bench --ladder`` times each step below on the user's GPU, so that the progression the
seed write-ups describe (naive attention -> tiled online softmax -> tensor cores -> pipelining ->
the softmax and masking tricks -> TMA and warp specialization) is measured, not quoted. Steps
(b)-(e) are deliberately small kernels that each add one idea to the previous one; the top rows
are the shipping kernels, called through the public API.

====  ================  ===================================================================
step  name              what it adds
====  ================  ===================================================================
(a)   naive             PyTorch: ``S = Q K^T`` materialized (b, h, s_q, s_k), fp32 softmax, ``P V``
(b)   cuda-cores        one program per block of 16 queries walks the keys 16 at a time with
                        the online softmax (FlashAttention-2's loop): S never leaves the chip,
                        but both products are fp32 FMAs on the CUDA cores (no ``tl.dot``)
(c)   tensor-cores      ``tl.dot`` on 128x64 bf16 tiles (mma.sync / wgmma), one stage: each
                        K/V tile is loaded, then used
(d)   pipelined         ``num_stages=3``: the loads of the next K/V tiles are in flight while
                        the current one is multiplied (cp.async / TMA rings chosen by Triton)
(e)   exp2+skip         scale and log2(e) folded into one FFMA before ``exp2`` (one MUFU.EX2
                        per score, no separate multiply); for causal, key blocks above the
                        diagonal are skipped and only diagonal blocks pay for the mask
                        (:func:`solattn.masking.block_range`)
(f)   portable          the shipping portable kernel (``flash_attn_func`` with
                        ``forced_backend("portable")``)
(g0)  hopper-1wg         the sm_90 kernel with one consumer warpgroup: TMA loads by a producer
                        warp through an mbarrier ring, 64 query rows per CTA
(g)   hopper            the shipping sm_90 kernel: two consumer warpgroups (128 rows per CTA,
                        warp specialization, ``setmaxnreg`` register reallocation)
(h)   hopper schedules  the same kernel forced to a persistent grid (one CTA per SM walking the
                        tiles) and to one CTA per tile, through its launcher's ``config=``
====  ================  ===================================================================

The seeds' shared-memory swizzling step (seed 001's v2, seed 003) has no row: Triton lays out
every ``tl.dot`` operand in a swizzled shared-memory layout by itself, as it picks ``ldmatrix``
and ``cp.async`` (seed 000).

Scope of the teaching kernels: fp16/bf16, head dim a power of two in 16..256 (``d_v == d``), any
sequence lengths (bounds masks), GQA, causal bottom-right aligned as flash-attn (the mask is
:func:`solattn.masking.band_mask`, the one every shipping kernel uses). No window, softcap, ALiBi,
LSE or backward: that is the shipping kernels' job.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from solattn.masking import band_mask, block_range

from .core import Inputs, Shape, interpreting
from .peers import PeerUnavailable

LOG2E = 1.4426950408889634


# ---- (a) naive ------------------------------------------------------------------------------


def naive_attention(q, k, v, causal: bool = False):
    """What a PyTorch user writes first: the whole score matrix in memory.

    ``q (b, s_q, h, d)``, ``k``/``v (b, s_k, h_kv, d)``. ``S`` (b, h, s_q, s_k) is materialized
    in the input dtype, upcast to fp32 for the softmax, cast back for ``P V``: O(s_q * s_k)
    memory per head, and S is written to and read back from HBM several times.
    """
    from solattn.reference import allowed_mask

    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
    if h != h_kv:
        kt = kt.repeat_interleave(h // h_kv, dim=1)
        vt = vt.repeat_interleave(h // h_kv, dim=1)
    s = torch.matmul(qt, kt.transpose(-1, -2)).float().mul_(1.0 / math.sqrt(d))
    if causal:
        s.masked_fill_(~allowed_mask(s_q, s_k, True, (-1, -1), device=q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if causal and s_q > s_k:
        p = p.nan_to_num_(0.0)  # queries that see no key: output 0, as flash-attn
    return torch.matmul(p.to(q.dtype), vt).transpose(1, 2)


# ---- shared host side of the teaching kernels -----------------------------------------------


def _prepare(q, k, v):
    """Check the teaching kernels' scope; make the head dim contiguous."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q: expected float16 or bfloat16, got {q.dtype}")
    d = q.shape[-1]
    if d not in (16, 32, 64, 128, 256) or k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"head dims: the teaching kernels take d == d_v in 16..256, a power of "
                         f"two; got q {d}, k {k.shape[-1]}, v {v.shape[-1]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads: expected a multiple of k's {k.shape[2]}, got {q.shape[2]}")
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


def _strides(*ts):
    return [s for t in ts for s in t.stride()[:3]]


@triton.jit
def _bases(Q, K, V, O, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
           stride_ob, stride_oh, group_size):
    """Pointers to this program's (batch, head) in a (query blocks, heads, batch) grid; 64-bit."""
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h_kv = (h // group_size).to(tl.int64)
    h = h.to(tl.int64)
    return (Q + b * stride_qb + h * stride_qh, K + b * stride_kb + h_kv * stride_kh,
            V + b * stride_vb + h_kv * stride_vh, O + b * stride_ob + h * stride_oh)


# ---- (b) tiled online softmax on the CUDA cores ---------------------------------------------

# (block_m, block_n, num_warps). The [16, 16, d] products below live in registers: tiles this
# small are what fits without tensor cores, and they reuse each K/V load only 16 times.
CUDA_CORE_TILE = (16, 16, 8)


@triton.jit
def _cuda_core_kernel(
    Q, K, V, O,
    stride_qb, stride_qs, stride_qh,  # q: (b, s_q, h, d), unit stride on d
    stride_kb, stride_ks, stride_kh,  # k: (b, s_k, h_kv, d)
    stride_vb, stride_vs, stride_vh,  # v: (b, s_k, h_kv, d)
    stride_ob, stride_os, stride_oh,  # o: like q
    seqlen_q, seqlen_k, group_size, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    q_base, k_base, v_base, o_base = _bases(Q, K, V, O, stride_qb, stride_qh, stride_kb,
                                            stride_kh, stride_vb, stride_vh, stride_ob,
                                            stride_oh, group_size)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    upper = seqlen_k - seqlen_q  # causal, bottom-right: query r sees keys c <= r + upper
    row_ok = rows[:, None] < seqlen_q
    q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :], mask=row_ok, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], tl.float32)                # running sum of exp(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)      # running sum of exp(s - m) * v
    for start_n in range(0, seqlen_k, BLOCK_N):
        cols = start_n + offs_n
        key_ok = cols[:, None] < seqlen_k
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=key_ok, other=0.0)
        # S = Q K^T as BLOCK_M x BLOCK_N dot products of length d: a [M, N, d] broadcast product
        # summed over d, fp32 multiply-adds on the CUDA cores.
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * sm_scale
        mask = band_mask(rows, cols, seqlen_k, 0, upper, False, CAUSAL, True)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)  # rescales what was summed against the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        # O += P V with V loaded transposed, (d, keys): a [M, d, N] broadcast product summed over
        # its last axis (the [M, N, d] one summed over axis 1 is what Triton rewrites to tl.dot).
        vt = tl.load(v_base + cols[None, :] * stride_vs + offs_d[:, None],
                     mask=cols[None, :] < seqlen_k, other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, None, :] * vt.to(tl.float32)[None, :, :], axis=2)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a query that saw no key: output 0
    tl.store(o_base + rows[:, None] * stride_os + offs_d[None, :],
             (acc / l_i[:, None]).to(O.dtype.element_ty), mask=row_ok)


def cuda_core_attention(q, k, v, causal: bool = False):
    """Step (b): tiled online softmax without tensor cores. Layout as :func:`naive_attention`."""
    q, k, v = _prepare(q, k, v)
    b, s_q, h, d = q.shape
    s_k = k.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    bm, bn, warps = CUDA_CORE_TILE
    _cuda_core_kernel[(triton.cdiv(s_q, bm), h, b)](
        q, k, v, out, *_strides(q, k, v, out), s_q, s_k, h // k.shape[2], 1.0 / math.sqrt(d),
        HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, num_warps=warps, num_stages=1)
    return out


# ---- (c), (d), (e) tensor-core tiles --------------------------------------------------------


# Steps (c)-(e): (block_m, block_n, num_warps) per head dim: the shipping portable kernel's causal
# d=128 tile on sm_90 (``solattn/configs/portable.py``), smaller at d=256 (registers).
TENSOR_CORE_TILE = {16: (128, 64, 4), 32: (128, 64, 4), 64: (128, 64, 8), 128: (128, 64, 8),
                    256: (64, 32, 8)}
PIPELINE_STAGES = 3


def tensor_core_tile(d: int) -> tuple[int, int, int]:
    """The tile of steps (c)-(e) for head dim ``d``; 16x16 in the interpreter (speed)."""
    return (16, 16, 4) if interpreting() else TENSOR_CORE_TILE[d]


@triton.jit
def _tc_block(acc, l_i, m_i, q, k_base, v_base, start_n, rows, offs_n, offs_d,
              stride_ks, stride_vs, seqlen_k, upper, scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, FAST_SOFTMAX: tl.constexpr):
    """One key block of the online softmax with tensor-core products."""
    cols = start_n + offs_n
    k_ptrs = k_base + cols[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = v_base + cols[:, None] * stride_vs + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=cols[:, None] < seqlen_k, other=0.0)
    else:
        k = tl.load(k_ptrs)  # interior block: no predicate
    qk = tl.dot(q, tl.trans(k))  # tensor cores, fp32 accumulator
    if MASKED:
        qk = tl.where(band_mask(rows, cols, seqlen_k, 0, upper, False, CAUSAL, True), qk,
                      float("-inf"))
    if FAST_SOFTMAX:
        # scale = softmax scale * log2(e), applied to the row max (BLOCK_M multiplies) and fused
        # with the subtraction below: one FFMA + one MUFU.EX2 per score.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
    else:
        qk = qk * scale  # scale = softmax scale: a multiply per score, and tl.exp adds another
        m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = m_new
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    if FAST_SOFTMAX:
        p = tl.exp2(qk * scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
    else:
        p = tl.exp(qk - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=cols[:, None] < seqlen_k, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _tc_range(acc, l_i, m_i, q, k_base, v_base, lo, hi, rows, offs_n, offs_d,
              stride_ks, stride_vs, seqlen_k, upper, scale, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, FAST_SOFTMAX: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _tc_block(acc, l_i, m_i, q, k_base, v_base, start_n, rows, offs_n,
                                  offs_d, stride_ks, stride_vs, seqlen_k, upper, scale,
                                  MASKED, CAUSAL, FAST_SOFTMAX)
    return acc, l_i, m_i


@triton.jit
def _tensor_core_kernel(
    Q, K, V, O,
    stride_qb, stride_qs, stride_qh,  # q: (b, s_q, h, d), unit stride on d
    stride_kb, stride_ks, stride_kh,  # k: (b, s_k, h_kv, d)
    stride_vb, stride_vs, stride_vh,  # v: (b, s_k, h_kv, d)
    stride_ob, stride_os, stride_oh,  # o: like q
    seqlen_q, seqlen_k, group_size, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, FAST_SOFTMAX: tl.constexpr, SKIP_BLOCKS: tl.constexpr,
):
    q_base, k_base, v_base, o_base = _bases(Q, K, V, O, stride_qb, stride_qh, stride_kb,
                                            stride_kh, stride_vb, stride_vh, stride_ob,
                                            stride_oh, group_size)
    start_m = tl.program_id(0) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    upper = seqlen_k - seqlen_q
    row_ok = rows[:, None] < seqlen_q
    q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :], mask=row_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if SKIP_BLOCKS:
        # Only the key blocks some query of this block sees; the interior ones without a mask,
        # the causal diagonal and the ragged end with it.
        lo, full_lo, full_hi, hi = block_range(start_m, seqlen_q, seqlen_k, 0, upper,
                                               BLOCK_M, BLOCK_N, False, CAUSAL)
        acc, l_i, m_i = _tc_range(acc, l_i, m_i, q, k_base, v_base, full_lo, full_hi, rows,
                                  offs_n, offs_d, stride_ks, stride_vs, seqlen_k, upper, scale,
                                  BLOCK_N, False, CAUSAL, FAST_SOFTMAX)
        acc, l_i, m_i = _tc_range(acc, l_i, m_i, q, k_base, v_base, full_hi, hi, rows,
                                  offs_n, offs_d, stride_ks, stride_vs, seqlen_k, upper, scale,
                                  BLOCK_N, True, CAUSAL, FAST_SOFTMAX)
    else:
        # Every key block, every element masked (causal: blocks above the diagonal are computed
        # and thrown away).
        acc, l_i, m_i = _tc_range(acc, l_i, m_i, q, k_base, v_base, 0, seqlen_k, rows,
                                  offs_n, offs_d, stride_ks, stride_vs, seqlen_k, upper, scale,
                                  BLOCK_N, True, CAUSAL, FAST_SOFTMAX)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(o_base + rows[:, None] * stride_os + offs_d[None, :],
             (acc / l_i[:, None]).to(O.dtype.element_ty), mask=row_ok)


def tensor_core_attention(q, k, v, causal: bool = False, *, num_stages: int = 1,
                          fast_softmax: bool = False, skip_blocks: bool = False):
    """Steps (c) ``num_stages=1``, (d) ``num_stages=3``, (e) ``+ fast_softmax, skip_blocks``.
    Layout as :func:`naive_attention`."""
    q, k, v = _prepare(q, k, v)
    b, s_q, h, d = q.shape
    s_k = k.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    bm, bn, warps = tensor_core_tile(d)
    scale = 1.0 / math.sqrt(d) * (LOG2E if fast_softmax else 1.0)
    _tensor_core_kernel[(triton.cdiv(s_q, bm), h, b)](
        q, k, v, out, *_strides(q, k, v, out), s_q, s_k, h // k.shape[2], scale,
        HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, FAST_SOFTMAX=fast_softmax,
        SKIP_BLOCKS=skip_blocks, num_warps=warps, num_stages=num_stages)
    return out


# ---- (g0), (h) the shipping Hopper kernel with one config field forced -------------------


def hopper_config_attention(shape: Shape, **overrides):
    """``attn(q, k, v)`` running the shipping Hopper forward with fields of its
    :class:`~solattn.configs.hopper_forward.HopperFwdConfig` forced (``consumers=1``: one
    consumer warpgroup; ``persistent=``: the tile schedule) through the launcher's ``config=``
    argument, and whether the forced config is the one the dispatcher picks for ``shape``.
    Raises :class:`~solattn.bench.peers.PeerUnavailable` when the launcher no longer takes a
    config with those fields (the row is then dropped, with the reason)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise PeerUnavailable("needs sm_90")
    try:
        from solattn.kernels.hopper import forward_plan as hf
        from solattn.params import AttnParams

        params = inspect.signature(hf.attn_fwd).parameters
        fields = {f.name for f in dataclasses.fields(hf.HopperFwdConfig)}
        default = hf.hopper_fwd_config(shape.d, shape.causal)
    except Exception as exc:  # noqa: BLE001 - the launcher moved: drop the row, say why
        raise PeerUnavailable(f"Hopper launcher changed ({type(exc).__name__}: {exc})") from exc
    if not {"p", "config"} <= set(params) or not set(overrides) <= fields:
        raise PeerUnavailable(f"Hopper launcher takes no config with fields {sorted(overrides)}")
    cfg = dataclasses.replace(default, **overrides)
    p = AttnParams(scale=1.0 / math.sqrt(shape.d), causal=shape.causal,
                   group_size=shape.h // shape.kv_heads)

    def attn(q, k, v):
        return hf.attn_fwd(q, k, v, p, return_lse=False, config=cfg)[0]

    return attn, cfg == default


# ---- the step registry ----------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One row of the ladder. ``setup(shape, inputs) -> attn(q, k, v)`` as the peers'
    (:mod:`solattn.bench.peers`); ``vs`` names the step the speed-up is measured against;
    ``seeds`` where the seed write-ups (``shared/seeds/``) take the same step."""

    key: str
    name: str
    change: str
    seeds: str
    setup: object
    vs: str | None = None
    shipping: bool = False


def _fixed(fn, **kw):
    return lambda shape, x: (lambda q, k, v: fn(q, k, v, causal=shape.causal, **kw))


def _shipping(backend: str):
    def setup(shape: Shape, x: Inputs):
        from solattn import flash_attn_func
        from solattn.dispatch import forced_backend

        if backend == "hopper" and (x.q.device.type != "cuda"
                                    or torch.cuda.get_device_capability() != (9, 0)):
            raise PeerUnavailable("needs sm_90")

        def attn(q, k, v):
            with forced_backend(backend):
                return flash_attn_func(q, k, v, causal=shape.causal)

        return attn

    return setup


def _hopper_config(**overrides):
    def setup(shape: Shape, x: Inputs):
        run, is_default = hopper_config_attention(shape, **overrides)

        def attn(q, k, v):
            try:
                return run(q, k, v)
            except TypeError as exc:  # the launcher's arguments changed under us
                raise PeerUnavailable(f"Hopper launcher changed ({exc}); row dropped") from exc

        attn.is_default = is_default
        return attn

    return setup


STEPS = [
    Step("a", "naive", "PyTorch, S = QK^T materialized, fp32 softmax, P V",
         "002 version 0 (naive, S materialized)", _fixed(naive_attention)),
    Step("b", "cuda-cores", "tiled online softmax, {}x{} tiles, fp32 FMAs (no tl.dot)".format(
        *CUDA_CORE_TILE[:2]),
         "002 'tiled (FP32)'; 003 step 1 (naive FA2)", _fixed(cuda_core_attention), vs="a"),
    Step("c", "tensor-cores", "+ tl.dot on {}x{} bf16 tiles, 1 stage".format(
        *TENSOR_CORE_TILE[128][:2]),
         "000 kernel 1, 001 v1 (mma.m16n8k16); 003 step 3 (MMA)",
         _fixed(tensor_core_attention, num_stages=1), vs="b"),
    Step("d", "pipelined", f"+ num_stages={PIPELINE_STAGES}: next K/V tiles loaded during the math",
         "001 v3 + v5 (pipelining); 003 step 6 (double buffering)",
         _fixed(tensor_core_attention, num_stages=PIPELINE_STAGES), vs="c"),
    Step("e", "exp2+skip", "+ exp2 with the scale folded into one FFMA; causal: blocks above "
         "the diagonal skipped, only the diagonal masked",
         "004 (P = exp2(S * scale - max * scale)); 002 (causal tile skipping)",
         _fixed(tensor_core_attention, num_stages=PIPELINE_STAGES, fast_softmax=True,
                skip_blocks=True),
         vs="d"),
    Step("f", "portable", "shipping portable kernel (public API, forced_backend('portable'))",
         "-", _shipping("portable"), vs="e", shipping=True),
    Step("g0", "hopper-1wg", "sm_90 kernel with TMA loads (a producer warp, mbarrier ring) and "
         "one consumer warpgroup: 64 query rows per CTA",
         "003 step 4 (TMA); 004 (producer/consumer warp roles)",
         _hopper_config(consumers=1), vs="f", shipping=True),
    Step("g", "hopper", "shipping sm_90 kernel: + a second consumer warpgroup (128 rows per "
         "CTA) and setmaxnreg register reallocation (producer 24, consumers 240)",
         "003 step 7 (warp specialization); 004 (warp roles, register reallocation)",
         _shipping("hopper"), vs="g0", shipping=True),
    Step("h1", "hopper-persistent", "same kernel, persistent grid (one CTA per SM)",
         "004 (persistent scheduling)", _hopper_config(persistent=True), vs="g", shipping=True),
    Step("h2", "hopper-per-tile", "same kernel, one CTA per tile", "-",
         _hopper_config(persistent=False), vs="g", shipping=True),
]
STEP_BY_NAME = {s.name: s for s in STEPS}


def aot_specs(arch: int):
    """The teaching kernels as :mod:`solattn.aot` specs (bf16, d=128, full and causal), so their
    compilation for a GPU is checked without one (tests/test_ladder.py)."""
    from solattn.aot import AotSpec, make_signature

    pointers = {n: "*bf16" for n in ("Q", "K", "V", "O")}
    variants = [("cuda-cores", _cuda_core_kernel, {}, CUDA_CORE_TILE, 1)]
    for name, stages, fast in (("tensor-cores", 1, False), ("pipelined", PIPELINE_STAGES, False),
                               ("exp2+skip", PIPELINE_STAGES, True)):
        variants.append((name, _tensor_core_kernel, dict(FAST_SOFTMAX=fast, SKIP_BLOCKS=fast),
                         TENSOR_CORE_TILE[128], stages))
    specs = []
    for name, fn, flags, (bm, bn, warps), stages in variants:
        for causal in (False, True):
            consts = dict(HEAD_DIM=128, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, **flags)
            sig, consts = make_signature(fn, pointers=pointers, constexprs=consts,
                                         floats=("sm_scale", "scale"))
            specs.append(AotSpec(
                name=f"ladder_{name}", fn=fn, signature=sig, constexprs=consts,
                config=f"d128 bm{bm} bn{bn} w{warps} s{stages}{' causal' if causal else ''}",
                options=dict(num_warps=warps, num_stages=stages), pointer_args=tuple(pointers),
                divisible_args=tuple(n for n in sig if n.startswith("stride_")),
                tensor_cores=name != "cuda-cores"))  # step (b) multiplies on the CUDA cores
    return specs
