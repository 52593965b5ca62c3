"""Device math shared by every kernel (portable forward, backward, decode; Gluon Hopper forward).

One copy of each piece: the log2-domain constants, the score transform (scale, softcap, ALiBi),
the attention-dropout mask, the online-softmax step of the forward and decode kernels, the
per-sequence bounds of a batch entry (varlen or padded), and the row-block order of programs
that walk query blocks. Gluon kernels call the ``@triton.jit`` helpers that use only
element-wise ops (``tanh_f32``).
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

# Integer arguments the portable kernels do not specialize on (``do_not_specialize``): lengths,
# the window offsets and the LSE's strides (``(b, h, s_q)``: they follow ``seqlen_q``). Triton
# would otherwise compile one binary per value class of each (a multiple of 16, equal to 1,
# other), so a new sequence length would compile again; this way one binary per config serves
# every length, and ``solattn warmup`` fills the cache for all of them. The binary is the one
# a length that is not a multiple of 16 got before (same registers and SASS, sm_90, Triton 3.6).
# Tensor strides of q/k/v/o stay specialized: their divisibility by 16 is what lets the loads
# vectorize (they are multiples of 16 for every contiguous layout with ``head_dim % 16 == 0``,
# whatever the shape). The GQA group is specialized on its value 1 only
# (:data:`GROUP_ARG`): without it the dK/dV kernel keeps a loop over the group's heads and
# spills (d=128: 200-256 bytes of stack, sm_90, Triton 3.6), with it a group > 1 is one class.
SHAPE_ARGS = ("seqlen_q", "seqlen_k", "left", "right", "stride_lb", "stride_lh")
GROUP_ARG = ("group_size",)  # do_not_specialize_on_alignment: MHA (1) and GQA (> 1)


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


# Rounds of Philox per draw: Philox4x32-7, as flash-attn's dropout (7 rounds pass BigCrush,
# Salmon et al. 2011; Triton's default of 10 costs 3 more rounds of 4 multiplies per element).
DROPOUT_ROUNDS: tl.constexpr = tl.constexpr(7)


@triton.jit
def _philox(dropout, c0, c1):
    """The four 32-bit outputs of one Philox4x32 draw per element of the broadcast of ``c0`` and
    ``c1``, keyed by the seed, at counter ``(c0, c1, h, b)``."""
    zero = c0 * 0 + c1 * 0  # an int tile of the broadcast shape
    return tl.philox(dropout[0], (zero + c0).to(tl.int32), (zero + c1).to(tl.int32),
                     (zero + dropout[2]).to(tl.int32), (zero + dropout[1]).to(tl.int32),
                     DROPOUT_ROUNDS)


@triton.jit
def _kept(r, threshold):
    """Kept when the top 31 bits of a 32-bit output are ``>= threshold``."""
    return (r >> 1).to(tl.int32, bitcast=True) >= threshold


@triton.jit
def dropout_keep(dropout, q_idx, k_idx):
    """Attention dropout's keep mask: True where probability ``P[q_idx, k_idx]`` is kept.

    ``dropout`` is the tuple ``(seed, b, h, threshold, scale)`` a kernel builds once per
    (batch entry, query head) (:func:`dropout_params`): the call's 64-bit seed
    (:mod:`solattn.dropout`), the batch entry (the sequence, varlen) and the query head,
    ``threshold = round(dropout_p * 2**31)`` and ``scale = 1 / (1 - dropout_p)`` (unused
    here). ``q_idx`` / ``k_idx`` are the query and key indices in their sequence, one a column
    and the other a row vector: ``[M, 1]`` / ``[1, N]`` in the forward and the dQ kernel,
    ``[1, M]`` / ``[N, 1]`` in the dK/dV kernel. The keys are a tile's
    consecutive indices ``k0 + arange(N)`` with ``k0`` a multiple of 4 (key tiles start at
    multiples of their power-of-two size >= 16); keys past the sequence clamped to its last key
    are allowed too (their elements are masked anyway).

    The scheme: element ``(i, j)`` takes output ``j % 4`` of the Philox4x32-7 draw keyed by the
    seed at counter ``(j // 4, i, h, b)``. One draw serves four consecutive keys of a row, the
    mask is a pure function of ``(seed, b, h, i, j)`` -- every kernel (forward, dK/dV, dQ,
    whatever its tile shapes and orientation) regenerates the same mask -- and no counter
    repeats within a call. An element is kept when its output's top 31 bits are
    ``>= threshold``: probability ``1 - dropout_p`` (to within 2**-31). With keys along axis 1
    (forward, dQ) the kernel draws on a ``[M, N / 4]`` tile and interleaves the four outputs'
    keep bits along the keys (``tl.join`` + ``tl.reshape``: ``4c + 2a + b`` takes output
    ``2a + b`` of group ``c``); with keys along axis 0 (dK/dV) every element draws its group
    and selects output ``j % 4`` (no interleave; see the branch).
    """
    if k_idx.shape[0] == 1:  # keys along axis 1: q_idx [M, 1], k_idx [1, N]
        n: tl.constexpr = k_idx.shape[1]
        m: tl.constexpr = q_idx.shape[0]
        # first key of each group of 4 (a clamped group past the end gives any counter)
        group = tl.min(tl.reshape(k_idx, [n // 4, 4]), axis=1) >> 2
        r0, r1, r2, r3 = _philox(dropout, group[None, :], q_idx)
        k0, k1, k2, k3 = (_kept(r0, dropout[3]), _kept(r1, dropout[3]),
                          _kept(r2, dropout[3]), _kept(r3, dropout[3]))
        keep = tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), [m, n])
    else:
        # Keys along axis 0 (the dK/dV kernel's transposed tile): the interleave's layout
        # change spills there (d=128, sm_90, 11 local accesses in the loop), so each element
        # draws its group's four outputs and keeps output j % 4 -- the same mask, at the
        # cost of one draw per element in this kernel only.
        r0, r1, r2, r3 = _philox(dropout, k_idx >> 2, q_idx)
        o = k_idx & 3
        r = tl.where(o < 2, tl.where(o == 0, r0, r1), tl.where(o == 2, r2, r3))
        keep = _kept(r, dropout[3])
    return keep


@triton.jit
def dropout_params(SEED, b, h, threshold, scale, HAS_DROPOUT: tl.constexpr):
    """The ``dropout`` tuple of :func:`dropout_keep` for batch entry ``b`` and query head
    ``h``. ``SEED`` points to the call's (1,) int64 seed, read only with ``HAS_DROPOUT``
    (without it nothing reads the tuple and the kernel compiles as if it did not exist)."""
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    else:
        seed = 0
    return (seed, b, h, threshold, scale)


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
    ``(NUM, IDX, stride_nb, stride_nh, stride_nr, stride_ib, stride_ih, stride_ir, max)`` of a
    BlockMask's ``*_num_blocks`` ``(B, H, rows)`` and ``*_indices`` ``(B, H, rows, max)`` (last
    stride 1; batch/head strides 0 where the mask broadcasts). The count is clamped into
    ``[0, max]``: a row never reads past its indices, whatever ``*_num_blocks`` holds (the
    index values themselves are bounded by the callers, :func:`sparse_index`)."""
    count = tl.load(LIST[0] + b * LIST[2] + h * LIST[3] + row * LIST[4])
    count = tl.minimum(tl.maximum(count, 0), LIST[8])
    idx = LIST[1] + b.to(tl.int64) * LIST[5] + h * LIST[6] + row * LIST[7]
    return count, idx


@triton.jit
def sparse_index(idx, i, n_blocks):
    """Entry ``i`` of a BlockMask row's indices, clamped into ``[0, n_blocks)`` (the blocks of
    the sequence it indexes): an invalid index gives a wrong block, never an address outside
    the tensors."""
    return tl.minimum(tl.maximum(tl.load(idx + i), 0), n_blocks - 1)


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
                        flex=None, SCORE_MOD: tl.constexpr = None, MASK_MOD: tl.constexpr = None,
                        HAS_DROPOUT: tl.constexpr = False, dropout=None):
    """One online-softmax step over a tile of keys, given pointer tiles to its K and V rows.

    The one copy of the update (shared by the forward and the decode kernels, which differ only
    in how they address K/V): ``key_ok`` (``cols < seqlen_k``) guards loads of masked tiles;
    unmasked tiles load without predicates (only a padded head dim is masked).

    FlexAttention: ``SCORE_MOD`` transforms every tile's scores; ``MASK_MOD`` (masked tiles
    only: the partial blocks of a BlockMask) joins the bounds mask. The mods see the key index
    clamped to the sequence (a ragged last tile's padding keys are masked anyway), and
    ``rows`` should be the clamped query indices.

    Dropout (``HAS_DROPOUT``, ``dropout`` as :func:`dropout_keep`): ``l`` sums the whole row
    (the LSE is the undropped softmax's) and only the kept probabilities reach ``P V``; the
    caller scales the output by ``1 / (1 - dropout_p)`` once, at the end.
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
    if HAS_DROPOUT:
        p = tl.where(dropout_keep(dropout, rows[:, None], cols[None, :]), p, 0.0)
    if MASKED:
        v = tl.load(v_ptrs, mask=key_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    else:
        v = load_rows(v_ptrs, offs_dv, HEAD_DIM_V, BLOCK_DV)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def seq_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k,
               IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr, PAGED: tl.constexpr = False):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of batch entry ``b`` (varlen or padded batch).

    flash-attn's rules: ``seqused_k[b]``, when given, is the key count; else
    ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``. Paged keys (``PAGED``, varlen only) start at
    position 0 of the sequence's pages: ``cu_seqlens_k`` only counts them, and is not read at
    all with ``seqused_k``.

    Every value read is bounded by the extents the launcher passes: ``seqlen_q`` / ``seqlen_k``
    are, for varlen, the packed tensors' row counts (``t_q``, ``t_k``; for paged keys, the
    ``max_pages * page_size`` keys a block-table row addresses), and the batched lengths
    otherwise. Starts are clamped into ``[0, total]``, ends into ``[start, total]`` and key
    counts into ``[0, rows available]``: invalid index values (decreasing ``cu_seqlens``,
    values past the tensors, negative or oversized ``seqused_k``) give a wrong result whose
    addresses all lie inside the tensors, never a read or write outside them. Valid values
    are unchanged.
    """
    if IS_VARLEN:
        total_q, total_k = seqlen_q, seqlen_k
        q_start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b), 0), total_q)
        seqlen_q = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b + 1), q_start), total_q) \
            - q_start
        if PAGED:
            k_start = 0
            if not HAS_SEQUSED_K:
                seqlen_k = tl.load(CU_SEQLENS_K + b + 1) - tl.load(CU_SEQLENS_K + b)
        else:
            k_start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b), 0), total_k)
            seqlen_k = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b + 1), k_start),
                                  total_k) - k_start
            total_k = seqlen_k  # seqused_k counts keys of this span
    else:
        q_start = 0
        k_start = 0
        total_k = seqlen_k
    if HAS_SEQUSED_K:
        seqlen_k = tl.load(SEQUSED_K + b)
    if IS_VARLEN or HAS_SEQUSED_K:
        seqlen_k = tl.minimum(tl.maximum(seqlen_k, 0), total_k)
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
