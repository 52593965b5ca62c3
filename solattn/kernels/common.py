"""Device math shared by every kernel (portable forward, backward, decode; Gluon Hopper forward).

One copy of each piece: the log2-domain constants, the score transform (scale, softcap, ALiBi),
the online-softmax step of the forward and decode kernels, the per-sequence bounds of a batch
entry (varlen or padded), and the row-block order of programs that walk query blocks. Gluon
kernels call the ``@triton.jit`` helpers that use only element-wise ops (``tanh_f32``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from solattn.launch import contiguous_strides
from solattn.masking import band_mask

# Softmax runs in the log2 domain (exp2 is one MUFU instruction): scores are multiplied by
# log2(e) and the LSE is converted back to natural log with ln(2).
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def tanh_f32(x):
    """tanh through exp2 (portable: libdevice is unavailable in Triton's interpreter)."""
    e = tl.exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def score_transform(qk, rows, cols, off, qk_scale, softcap_prescale, alibi_slope_log2,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                    flex=None, SCORE_MOD: tl.constexpr = None):
    """Raw ``q.k`` -> score in the log2 domain: scale, softcap, ALiBi (in flash-attn's order).

    ``qk_scale`` is ``scale * log2(e)`` without softcap and ``softcap * log2(e)`` with it
    (then ``softcap_prescale = scale / softcap``). Shared by forward, backward and decode.
    With ``SCORE_MOD`` (FlexAttention, rows are queries and columns keys) the generated
    ``score_mod`` replaces softcap and ALiBi: see :func:`flex_score`.
    """
    if SCORE_MOD is not None:
        s = flex_score(qk, rows[:, None], cols[None, :], flex, SCORE_MOD)
    else:
        if HAS_SOFTCAP:
            s = qk_scale * tanh_f32(qk * softcap_prescale)
        else:
            s = qk * qk_scale
        if HAS_ALIBI:
            dist = rows[:, None] + off - cols[None, :]
            dist = tl.where(dist < 0, -dist, dist)
            s = s - alibi_slope_log2 * dist.to(tl.float32)
    return s


# FlexAttention (solattn.flex): ``flex`` is the tuple ``(b, h, sm_scale, SCORE_ARGS, MASK_ARGS)``
# every flex kernel builds once per (batch, head): the mods' scalar arguments and the flat tuples
# of their captured tensors (pointer, sizes, strides each). ``SCORE_MOD`` / ``MASK_MOD`` are the
# generated @triton.jit functions (solattn.flex.codegen), passed as constexprs; None: absent.
@triton.jit
def flex_score(qk, q_idx, kv_idx, flex, SCORE_MOD: tl.constexpr):
    """``score_mod(q.k * scale, b, h, q_idx, kv_idx)`` -- natural units, as torch's score_mod
    sees it -- returned in the kernels' log2 domain. ``q_idx`` / ``kv_idx`` are index vectors
    shaped to broadcast over the tile (``[M, 1]`` / ``[1, N]``, or transposed)."""
    return SCORE_MOD(qk * flex[2], flex[0], flex[1], q_idx, kv_idx, flex[3]) * LOG2E


@triton.jit
def flex_mask(q_idx, kv_idx, flex, MASK_MOD: tl.constexpr):
    """``mask_mod(b, h, q_idx, kv_idx)``: True where the key is kept (broadcastable tile)."""
    return MASK_MOD(flex[0], flex[1], q_idx, kv_idx, flex[4])


@triton.jit
def sparse_blocks(LIST, b, h, row):
    """``(count, index pointer)`` of row ``row`` of a block-sparse list: ``LIST`` is the tuple
    ``(NUM, IDX, stride_nb, stride_nh, stride_nr, stride_ib, stride_ih, stride_ir)`` of a
    BlockMask's ``*_num_blocks`` ``(B, H, rows)`` and ``*_indices`` ``(B, H, rows, max)`` (last
    stride 1; batch/head strides 0 where the mask broadcasts)."""
    count = tl.load(LIST[0] + b * LIST[2] + h * LIST[3] + row * LIST[4])
    idx = LIST[1] + b.to(tl.int64) * LIST[5] + h * LIST[6] + row * LIST[7]
    return count, idx


@triton.jit
def load_rows(ptrs, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load a ``[rows, BLOCK_D]`` tile whose rows are all in bounds: only a head dim padded to
    ``BLOCK_D`` is masked, so an unpadded tile loads with no predicate at all."""
    if BLOCK_D != HEAD_DIM:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def online_softmax_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, key_ok, rows, cols, offs_d, offs_dv,
                        seqlen_k, off, lower, upper, qk_scale, softcap_prescale, alibi_slope_log2,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        MASKED: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                        flex=None, SCORE_MOD: tl.constexpr = None, MASK_MOD: tl.constexpr = None):
    """One online-softmax step over a tile of keys, given pointer tiles to its K and V rows.

    The one copy of the update (shared by the forward and the decode kernels, which differ only
    in how they address K/V): ``key_ok`` (``cols < seqlen_k``) guards loads of masked tiles;
    unmasked tiles load without predicates (only a padded head dim is masked).

    FlexAttention: ``SCORE_MOD`` transforms every tile's scores; ``MASK_MOD`` (masked tiles
    only: the partial blocks of a BlockMask) joins the bounds mask. The mods see the key index
    clamped to the sequence (a ragged last tile's padding keys are masked anyway), and
    ``rows`` should be the clamped query indices.
    """
    if MASKED:
        k = tl.load(k_ptrs, mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        k = load_rows(k_ptrs, offs_d, HEAD_DIM, BLOCK_D)
    qk = tl.dot(q, tl.trans(k))
    if MASKED and (SCORE_MOD is not None or MASK_MOD is not None):
        mod_cols = tl.minimum(cols, seqlen_k - 1)
    else:
        mod_cols = cols
    s = score_transform(qk, rows, mod_cols, off, qk_scale, softcap_prescale, alibi_slope_log2,
                        HAS_SOFTCAP, HAS_ALIBI, flex, SCORE_MOD)
    if MASKED:
        mask = band_mask(rows, cols, seqlen_k, lower, upper, HAS_LOWER, HAS_UPPER, True)
        if MASK_MOD is not None:
            mask = mask & flex_mask(rows[:, None], mod_cols[None, :], flex, MASK_MOD)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with every key masked so far keeps m = -inf: subtract 0 instead (exp2(-inf) = 0).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    elif SCORE_MOD is not None:
        # A score_mod may return -inf for a whole row of an unmasked tile.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=key_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    else:
        v = load_rows(v_ptrs, offs_dv, HEAD_DIM_V, BLOCK_DV)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def seq_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k,
               IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of batch entry ``b`` (varlen or padded batch)."""
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + b)
        seqlen_q = tl.load(CU_SEQLENS_Q + b + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + b)
        seqlen_k = tl.load(CU_SEQLENS_K + b + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    if HAS_SEQUSED_K:
        seqlen_k = tl.load(SEQUSED_K + b)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def row_block_coords(group_size, HAS_UPPER: tl.constexpr):
    """``(pid_m, h, b, h_kv)`` of a program in a (query blocks, heads, batch) grid.

    Upper-banded (causal) problems give later row blocks more work: they run first, so the last
    wave is made of short programs (longest-first scheduling). Shared by the forward and the
    backward's dQ kernel, which walk the same row blocks.
    """
    pid_m = tl.program_id(0)
    if HAS_UPPER:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    return pid_m, h, tl.program_id(2), h // group_size


def strides4(t):
    """(batch, seq, head, dim) strides; a packed varlen (t, h, d) tensor has batch stride 0."""
    if t.dim() == 3:
        return (0, *t.stride())
    return t.stride()


def strides4_of(shape) -> tuple[int, ...]:
    """:func:`strides4` of a buffer ``torch.empty(shape)`` will allocate (row-major)."""
    strides = contiguous_strides(shape)
    return (0, *strides) if len(shape) == 3 else strides


def launch_fewer_stages(launch, num_stages: int):
    """``launch(stages)`` with the config's pipelining depth, retried with one stage less while
    the kernel needs more shared memory than the device has. FlexAttention kernels compile
    user mods whose gathers the pipeliner stages in shared memory (a bias-table gather is a
    [BLOCK_M, BLOCK_N] tile per stage), so a table config can overflow for a heavy mod."""
    from triton.runtime.errors import OutOfResources

    for stages in range(num_stages, 0, -1):
        try:
            return launch(stages)
        except OutOfResources:
            if stages == 1:
                raise
