"""The consumer's key-block step that the Hopper (Gluon) forwards share: the dense and FP8
kernels of :mod:`solattn.kernels.hopper.forward` and the flex kernel of
:mod:`solattn.kernels.hopper.flex_forward`.

:func:`kv_step` issues ``S = Q K^T`` of key block ``it`` and ``O += P V`` of block ``it - 1``
asynchronously, runs the score transform and the online softmax on ``S`` while ``P V`` is in
flight, and returns the carried ``(o, p, alpha, m, l)``. What differs between the kernels comes
in with the step bundle ``st`` (the kernel's own ``@bundle`` class): its operands (``q_tile``,
the ``k`` / ``v`` rings and their barriers) and its score transform as two methods,
``st.s_init(start_n, s_layout, cfg, MASKED)`` (``S``'s starting accumulator, evaluated before
the step waits for K; the wgmma adds ``Q K^T`` to it when ``MASKED and st.MASK_IN_S``) and
``st.softmax(qk, m, l, start_n, cfg, MASKED)`` (transform, mask and online softmax ->
``(p, alpha, m, l)``). The walker -- which key blocks, in which order, masked or not -- stays
with the kernel: a band's block range (dense) or a BlockMask's lists (flex).

``cfg`` is the kernel's constexpr bundle; the step reads its ``HEAD_DIM``, ``HEAD_DIM_V``,
``BLOCK_M``, ``BLOCK_N``, ``STAGES`` and ``FP8``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from solattn.configs import triton_version
from solattn.kernels.hopper.pipeline import release, ring_slot, step_view, wait_ready


@gluon.jit
def v_operand(v_smem, slot, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, FP8: gl.constexpr):
    """The ``[BLOCK_N, HEAD_DIM]`` B operand of ``P V`` in ring slot ``slot``. 8-bit wgmma
    takes K-major operands only: FP8 V arrives transposed (``[HEAD_DIM, BLOCK_N]``, keys
    contiguous) and is viewed back; 16-bit V is used as loaded."""
    if FP8:
        return v_smem.index(slot).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
    else:
        return v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])


@gluon.jit
def a_operand(p, FP8: gl.constexpr):
    """The A operand of ``P V`` from the carried ``p`` (:func:`p_operand`). FP8: fp16 -> e4m3
    (round to nearest, saturating), two ``F2FP`` per 32-bit operand register, right before the
    wgmma: an e4m3 tensor carried across the key loop is kept as separate bytes and re-packed
    every iteration (two ``PRMT`` per value, measured in the SASS)."""
    if FP8:
        return gl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi;
            cvt.rn.satfinite.e4m3x2.f16x2 lo, $1;
            cvt.rn.satfinite.e4m3x2.f16x2 hi, $2;
            mov.b32 $0, {lo, hi};
            }""",
            "=r,r,r", [p], dtype=gl.float8e4nv, is_pure=True, pack=4)
    else:
        return p


@gluon.jit
def p_operand(p_f32, dtype: gl.constexpr, layout: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, FP8: gl.constexpr):
    """``P`` in ``dtype`` in the register layout of the A operand of ``P V``, without moving
    data between threads (FP8: in fp16, :func:`a_operand` makes the e4m3 operand of it).

    16-bit: the wgmma accumulator layout of ``S`` is the A operand layout (``k_width=2``).
    FP8 (``k_width=4``): in each 32-key chunk a thread of the accumulator holds keys
    ``16h + 8j + 2q + e`` (``h, j, e`` in {0, 1}, ``q = lane % 4``) and the A operand wants
    ``16h + 4q + 2j + e`` of it. Swapping the ``j`` and ``q`` axes of P's columns is a relabelling
    of each thread's own registers; V's keys are permuted the same way on the host
    (:func:`solattn.kernels.hopper.forward.fp8_v_operand`), so ``P' V'`` = ``P V``.
    """
    if FP8:
        # Relabelled and re-ordered in fp32 (free: a renaming of registers), then packed in
        # pairs of keys that share their operand register.
        p = p_f32.reshape([BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5))
        p = gl.convert_layout(p.reshape([BLOCK_M, BLOCK_N]), layout, assert_trivial=True)
        return p.to(dtype)
    else:
        return gl.convert_layout(_to_16bit_pairs(p_f32, dtype), layout, assert_trivial=True)


# Whether P is converted in pairs (_to_16bit_pairs): with triton 3.9's ptxas two d=64
# persistent builds (window-softcap-seqused, varlen) spill 8 bytes outside their loops with it
# (`solattn aot`, 2026-11-27), so 3.9 keeps the scalar conversions; measured on triton 3.6.
_PAIRED_CVT = gl.constexpr(triton_version() < (3, 9))


@gluon.jit
def _to_16bit_pairs(x, dtype: gl.constexpr):
    """``x.to(dtype)`` (bf16 or fp16, round to nearest) for each thread's adjacent pair of
    values in one ``cvt.rn.{bf16x2,f16x2}.f32`` (where :data:`_PAIRED_CVT`). (From
    ``x.to(dtype)`` ptxas fuses the two scalar conversions into an ``F2FP`` with the halves
    swapped and a ``PRMT`` to swap them back: one extra instruction per register of ``P``.)"""
    if not _PAIRED_CVT:
        return x.to(dtype)
    elif dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                         dtype=gl.float16, is_pure=True, pack=2)



@gluon.jit
def kv_step(st, o, p, alpha, m_i, l_i, it, start_n, cfg, MASKED: gl.constexpr):
    """Key block ``it`` at key ``start_n`` (``S = Q K^T``, the score transform, softmax)
    overlapped with ``P V`` of block ``it - 1`` -> the updated ``(o, p, alpha, m, l)``."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    FP8: gl.constexpr = cfg.FP8
    s_layout: gl.constexpr = m_i.type.layout.parent
    o_layout: gl.constexpr = o.type.layout
    slot, parity = ring_slot(it, cfg.STAGES)
    prev, prev_parity = ring_slot(it - 1, cfg.STAGES)

    s_acc = st.s_init(start_n, s_layout, cfg, MASKED)
    wait_ready(st.k_ready, slot, parity)
    k_t = st.k.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    q_op = st.q_tile
    if HEAD_DIM == 256 and not FP8:
        # (triton 3.9 spilled these builds with Q's descriptors hoisted out of the key loop;
        # the FP8 ones, 8 k-steps of 32 bytes, compile spill-free as they are, not with it)
        q_op = step_view(q_op, it)
    s_tok = warpgroup_mma(q_op, k_t, s_acc, use_acc=MASKED and st.MASK_IN_S, is_async=True)

    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout), assert_trivial=True)[:, None]
    wait_ready(st.v_ready, prev, prev_parity)
    o_tok = warpgroup_mma(a_operand(p, FP8),
                          v_operand(st.v, prev, cfg.HEAD_DIM_V, BLOCK_N, FP8), o, is_async=True)

    qk = warpgroup_mma_wait(1, deps=(s_tok,))
    release(st.k_empty, slot)
    p_f32, alpha, m_i, l_i = st.softmax(qk, m_i, l_i, start_n, cfg, MASKED)
    o = warpgroup_mma_wait(0, deps=(o_tok,))
    release(st.v_empty, prev)
    p_dtype: gl.constexpr = p.dtype
    p_layout: gl.constexpr = p.type.layout
    p = p_operand(p_f32, p_dtype, p_layout, BLOCK_M, BLOCK_N, FP8)
    return o, p, alpha, m_i, l_i
