"""Hopper (sm_90a) FlashAttention forward in Gluon: TMA, an mbarrier ring, warp-specialized wgmma.

One CTA owns ``2 * BLOCK_M`` query rows of one (batch, head) and splits the work between three
warp roles (``warp_specialize``)::

    producer (1 warp, 24 regs)         consumer WG0 (4 warps, 240)     consumer WG1 (4 warps, 240)
    TMA Q0, Q1 -> q_bar[0], q_bar[1]   rows [0, BLOCK_M)               rows [BLOCK_M, 2 BLOCK_M)
    for each key block j:              for each key block j:           (the same, on its own rows)
      wait k_empty[s]; TMA K_j           wait k_ready[s]; S_j = Q K_j^T (async)
      wait v_empty[s]; TMA V_j           O *= alpha_{j-1}; O += P_{j-1} V_{j-1} (async)
                                         wait S_j; arrive k_empty[s]; softmax_j -> P_j
                                         wait O;   arrive v_empty[s']
                                       O /= l -> Q's smem tile -> TMA store; lse -> global

``s = j % STAGES``. K and V have separate ready/empty barriers, so ``Q K_j^T`` starts as soon as
``K_j`` lands, while ``V_j`` is still in flight. Each consumer overlaps the ``P V`` product of the
previous block with the ``Q K^T`` product and the softmax of the current one (issue both async,
wait for ``S`` first). The two consumer warpgroups are interleaved by the warp schedulers: while
one runs its softmax on the FMA/MUFU units the other keeps the tensor cores busy (an explicit
mbarrier "ping-pong" measured slower: docs/hopper-forward.md).

Barrier phases. An mbarrier completes a phase when its arrival count is reached (TMA: when the
expected bytes have landed); ``wait(bar, parity)`` returns once the phase with that parity has
completed. Use ``u = j // STAGES`` of ring slot ``s``: consumers wait ``*_ready[s]`` with parity
``u & 1``; the producer waits ``*_empty[s]`` with ``(u & 1) ^ 1``. A freshly initialised barrier
counts as having completed the phase of parity 1, so the first ``STAGES`` waits on the empties
pass at once. Empties count one arrival per consumer warpgroup.

Softmax in the log2 domain with the scale folded into one FFMA per score::

    m' = max(m, rowmax(S))  (raw q.k units)     P = exp2(S * c - m' * c)     c = scale * log2(e)
    alpha = exp2(m * c - m' * c)                 l = l * alpha + rowsum(P)

Masks come from :mod:`solattn.masking` (the same ``band_mask`` / ``block_range`` as the portable
kernel): the unmasked interior runs without a predicate, only the edge blocks (causal diagonal,
window edges, ragged end of the keys) pay for it, and blocks outside the band are never loaded.
Descriptors are rank 4 over ``(batch, head, seq, dim)``: a ragged sequence end reads zeros and
stores nothing past the end, never another head's rows.

This module holds the device code only: the host side (coverage, plans, launch) is
:mod:`solattn.kernels.hopper.forward_plan`, the tiles :mod:`solattn.configs.hopper_forward`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)

from solattn.kernels.common import LN2, LOG2E, tanh_f32
from solattn.kernels.hopper.columns import alibi_bias
from solattn.kernels.hopper.compat import (
    Value,
    barrier,
    bundle,
    reinterpret,
    tma_store,
    warp_specialize,
)
from solattn.kernels.hopper.dropout import keep_mask
from solattn.kernels.hopper.pipeline import (
    release,
    ring_load,
    ring_slot,
    wait_empty,
    wait_ready,
)
from solattn.kernels.hopper.step import a_operand, kv_step, p_operand, v_operand
from solattn.masking import band_mask, band_offsets, block_range

SUPPORTED_HEAD_DIMS = (64, 128, 256)
# (head_dim, head_dim_v) -> the power-of-two tile widths they run in (Gluon tensors and TMA
# boxes are powers of two): 96 and 192 are padded, TMA reading zeros past the last column (the
# scores and the output are unchanged) and storing nothing there. (192, 128) is DeepSeek's MLA
# prefill (a 256-wide Q/K tile, a 128-wide V/O tile).
HEAD_DIM_TILES = {
    (64, 64): (64, 64), (96, 96): (128, 128), (128, 128): (128, 128), (192, 192): (256, 256),
    (256, 256): (256, 256), (192, 128): (256, 128),
}


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------

@bundle
class FwdSmem:
    """One CTA's shared memory and its barriers (:mod:`pipeline`'s ring vocabulary): Q, one
    slot per consumer warpgroup, each used once a tile; the ``STAGES``-deep K and V rings, whose
    empties count one arrival per consumer warpgroup; O's staging tiles (Q's buffer, or FP8's
    own bf16 one)."""
    q: gl.shared_memory_descriptor        # [CONSUMERS, 1, 1, BLOCK_M, HEAD_DIM]
    k: gl.shared_memory_descriptor        # [STAGES, 1, 1, BLOCK_N, HEAD_DIM]
    v: gl.shared_memory_descriptor        # [STAGES, 1, 1, BLOCK_N, HEAD_DIM_V] (FP8: transposed)
    o: gl.shared_memory_descriptor        # [CONSUMERS, 1, 1, BLOCK_M, HEAD_DIM_V]
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor


@bundle
class FwdProblem:
    """The call's shape: per-sequence lengths (varlen, KV caches), sizes and the band's
    ``(left, right)``. Lengths and counts are runtime values: one binary serves every shape."""
    SEQUSED_K: Value                      # (b,) int32: keys used per batch entry (KV caches)
    CU_SEQLENS_Q: Value                   # (b + 1,) int32, varlen only: sequence starts
    CU_SEQLENS_K: Value
    n_m: gl.tensor                        # row blocks of CONSUMERS * BLOCK_M
    num_heads: gl.tensor
    group_size: gl.tensor                 # h_q // h_kv
    seqlen_q: gl.tensor                   # varlen: total rows of q and k
    seqlen_k: gl.tensor
    left: gl.tensor
    right: gl.tensor


@bundle
class FwdSchedule:
    """The persistent tile schedule every partition walks: CTA ``pid`` runs its round robin's
    tiles ``pid, pid + grid_size, ...`` of ``num_tiles``, or (``DYNAMIC``) claims them from the
    ``SCHED`` counter, the producer handing each claim to the consumers through ``tid_*``
    (:func:`_claim_next`, :func:`_next_tile`). ``grid_size`` is an argument rather than
    ``gl.num_programs``: the latter is read once at kernel entry and spilled across the register
    reallocation."""
    SCHED: Value                          # int32 workspace, DYNAMIC only (_SCHED_SLOTS)
    tid_ready: gl.shared_memory_descriptor
    tid_empty: gl.shared_memory_descriptor
    num_tiles: gl.tensor
    grid_size: gl.tensor


@bundle
class FwdOut:
    """Where a tile's results go and what scales its scores. O and LSE are the launcher's own
    contiguous tensors: their strides follow from the shapes (fewer live registers than stride
    arguments)."""
    O: Value                              # (b, s_q, h, V_COLS) contiguous (REGISTER_EPILOGUE)
    o_desc: Value                         # rank-4 TMA descriptor of O's (b, h, s, d) view
    LSE: Value                            # (b, h, s_q) float32 contiguous
    Q_DESCALE: Value                      # FP8: (batch, h_kv) float32 contiguous
    K_DESCALE: Value
    V_DESCALE: Value
    qk_scale: gl.tensor                   # scale * log2(e) (/ softcap with one)
    softcap_prescale: gl.tensor
    ALIBI: Value                          # (b, h) or (h,) float32 slopes, HAS_ALIBI only
    SEED: Value                           # dropout's (1,) int64 seed, HAS_DROPOUT only
    dropout_threshold: Value              # round(dropout_p * 2**31) (solattn.dropout)
    dropout_scale: Value                  # 1 / (1 - dropout_p)


@bundle
class FwdConsts:
    """The kernel's constexprs (:func:`attn_fwd_kernel`'s comments)."""
    HEAD_DIM: gl.constexpr                # Q / K tile width (a power of two)
    BLOCK_M: gl.constexpr                 # rows of one consumer warpgroup
    BLOCK_N: gl.constexpr                 # keys of one ring slot
    STAGES: gl.constexpr
    HAS_LOWER: gl.constexpr
    HAS_UPPER: gl.constexpr
    HAS_SOFTCAP: gl.constexpr
    STORE_LSE: gl.constexpr
    HAS_SEQUSED_K: gl.constexpr
    IS_VARLEN: gl.constexpr
    REGISTER_EPILOGUE: gl.constexpr
    CONSUMERS: gl.constexpr
    FP8: gl.constexpr
    HEAD_DIM_V: gl.constexpr
    V_COLS: gl.constexpr
    HAS_ALIBI: gl.constexpr
    ALIBI_BATCHED: gl.constexpr
    LPT: gl.constexpr
    DYNAMIC: gl.constexpr
    HAS_DROPOUT: gl.constexpr
    O_STAGING: gl.constexpr


@bundle
class FwdTile:
    """One tile of the schedule (:func:`_tile_work`): ``b`` is the descriptors' batch index and
    ``q_off`` / ``k_off`` the first row of the sequence in it (varlen: the packed tensors are one
    batch entry, the sequence starts at ``cu_seqlens[b]``, and a tile with ``start_m >=
    seqlen_q`` is empty; otherwise both are 0). ``seqlen_*`` are the sequence's lengths,
    ``lower`` / ``upper`` its band offsets, ``[lo, hi)`` its key blocks and ``[full_lo,
    full_hi)`` the unmasked ones (:func:`solattn.masking.block_range`)."""
    b: Value
    h: gl.tensor
    h_kv: gl.tensor
    start_m: gl.tensor
    q_off: Value
    k_off: Value
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    lower: Value
    upper: Value
    lo: Value
    full_lo: Value
    full_hi: Value
    hi: Value


@bundle
class FwdStep:
    """The dense and FP8 consumers' step bundle (:func:`solattn.kernels.hopper.step.kv_step`):
    its Q tile, the K / V rings, its rows, the sequence's band, and the score scales (FP8: with
    the tile's descales folded in); ALiBi's slope (in ``m``'s units) and each row's diagonal key
    (float), else 0. Its score transform: softcap, ALiBi, the band mask (:meth:`softmax`)."""
    q_tile: gl.shared_memory_descriptor   # [BLOCK_M, HEAD_DIM]
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    rows: gl.tensor
    seqlen_k: gl.tensor
    lower: Value
    upper: Value
    qk_scale: gl.tensor
    softcap_prescale: gl.tensor
    alibi_slope: Value
    alibi_diag: Value
    drop: Value                           # dropout's (seed, b, h, threshold, scale), else 0
    row_start: gl.tensor                  # rows[0]
    MASK_IN_S: gl.constexpr               # False: S starts from zeros (step.kv_step)

    @gluon.jit
    def s_init(self, start_n, s_layout: gl.constexpr, cfg, MASKED: gl.constexpr):
        """``S``'s starting accumulator: zeros (the product overwrites them)."""
        return gl.zeros([cfg.BLOCK_M, cfg.BLOCK_N], gl.float32, s_layout)

    @gluon.jit
    def softmax(self, qk, m_i, l_i, start_n, cfg, MASKED: gl.constexpr):
        """Online softmax of one ``[BLOCK_M, BLOCK_N]`` score tile -> ``(p, alpha, m_new,
        l_new)``.

        ``m`` is kept in raw ``q.k`` units (tanh units with softcap); ``qk_scale`` turns it into
        the log2 domain inside the FFMA that feeds ``exp2``. A row whose keys so far are all
        masked keeps ``m = -inf``: it subtracts 0 instead, so ``p = alpha = 0`` rather than NaN.
        ``p`` (and so ``l``) is scaled by ``2**P_LOG2`` (FP8: 8, so that ``p`` in ``[0, 256]``
        uses e4m3's normal range rather than its subnormals; the epilogue divides it out of the
        LSE, and ``O / l`` cancels it).

        ALiBi (``HAS_ALIBI``): ``alibi_slope`` in ``m``'s units (``slope * log2(e) /
        qk_scale``) and ``alibi_diag`` (float ``rows + seqlen_k - seqlen_q``, the key on each
        row's diagonal); ``slope * |diag - key|`` is subtracted after the softcap, before the
        mask and the row max: :func:`solattn.kernels.common.score_transform`'s bias, in these
        units.

        Dropout (``HAS_DROPOUT``): the dropped probabilities (:func:`keep_mask`) are zeroed after
        ``l`` has summed them; the epilogue scales ``O`` by ``1 / (1 - dropout_p)`` and the LSE
        is the undropped softmax's, as the portable kernel's.
        """
        BLOCK_N: gl.constexpr = cfg.BLOCK_N
        P_LOG2: gl.constexpr = 8 if cfg.FP8 else 0
        qk_scale = self.qk_scale
        s_layout: gl.constexpr = qk.type.layout
        if cfg.HAS_SOFTCAP:
            qk = tanh_f32(qk * self.softcap_prescale)
        if cfg.HAS_ALIBI:
            qk = qk - alibi_bias(self.alibi_slope, self.alibi_diag - start_n, BLOCK_N, s_layout)
        if MASKED:
            cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk.type.layout))
            mask = band_mask(self.rows, cols, self.seqlen_k, self.lower, self.upper, cfg.HAS_LOWER,
                             cfg.HAS_UPPER, True)
            qk = gl.where(mask, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        m_scaled = m_new * qk_scale
        if MASKED:
            m_scaled = gl.where(m_new == float("-inf"), 0.0, m_scaled)
        if P_LOG2 != 0:
            p = gl.exp2(qk * qk_scale - (m_scaled - P_LOG2)[:, None])
        else:
            p = gl.exp2(qk * qk_scale - m_scaled[:, None])
        alpha = gl.exp2(m_i * qk_scale - m_scaled)
        l_i = l_i * alpha + gl.sum(p, 1)
        if cfg.HAS_DROPOUT:
            keep = keep_mask(self.drop, self.row_start, start_n, cfg.BLOCK_M, BLOCK_N, s_layout)
            p = gl.where(keep, p, 0.0)
        return p, alpha, m_new, l_i


@gluon.jit
def _dealt(tile, num_tiles, grid_size):
    """The tile a persistent CTA runs at its ``tile``-th slot of the round robin, dealt in
    snake order: round ``r`` of ``grid_size`` tiles goes to CTAs 0, 1, ... when ``r`` is even
    and back from the last CTA when odd, so that no CTA gets the same place of every round
    (where tiles alternate in length, e.g. a causal sequence's m-blocks, it would get the long
    or the short one every time). With one CTA per tile (``grid_size == num_tiles``) the
    identity."""
    r = tile // grid_size
    c = tile - r * grid_size
    if (r & 1) == 1:
        c = gl.minimum(grid_size, num_tiles - r * grid_size) - 1 - c
    return r * grid_size + c


# Dynamic tile scheduling (HopperFwdConfig.dynamic): SCHED is the launch's int32 workspace,
# [0] the tile counter, [1] the CTAs retired, then two slots per CTA through which its producer
# hands the claimed tile indices to its consumers. Counters start at 0 and the last CTA to
# retire puts them back to 0, so launches on one stream share a workspace.
_SCHED_SLOTS = gl.constexpr(2)


@gluon.jit
def _lane0():
    """One warp's lanes as a ``[32]`` tensor -> ``(lane index, lane == 0)``."""
    lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    return lanes, lanes == 0


@gluon.jit
def _claim_next(sched, j):
    """Producer (one warp), at its ``j``-th tile: claim the CTA's next tile (``grid_size`` + a
    ticket of the launch's counter: every CTA's first tile is its program id) and publish it
    in the CTA's slot ``j % 2`` for the consumers (:func:`_next_tile`) -> its index. The claim
    comes once the current tile's loads are issued (its last ``STAGES`` key blocks still to
    compute, behind which its latency hides), so the CTAs that finish first take the next
    tiles."""
    lanes, first = _lane0()
    zero = lanes * 0
    ticket = gl.atomic_add(sched.SCHED + zero, zero + 1, mask=first, sem="relaxed")
    nxt = gl.max(gl.where(first, ticket, 0), axis=0) + sched.grid_size
    slot = j % _SCHED_SLOTS
    mbarrier.wait(sched.tid_empty.index(slot), ((j // _SCHED_SLOTS) & 1) ^ 1)
    # (every lane stores the value: whichever thread arrives has its store ordered before)
    gl.store(sched.SCHED + (2 + gl.program_id(0) * _SCHED_SLOTS + slot) + zero, zero + nxt)
    mbarrier.arrive(sched.tid_ready.index(slot), count=1)
    return nxt


@gluon.jit
def _next_tile(sched, j):
    """Consumer, after its ``j``-th tile: the index of its next one, from the producer's slot
    (a volatile load: the producer's store is made visible by the barrier, not through L1)."""
    slot = j % _SCHED_SLOTS
    mbarrier.wait(sched.tid_ready.index(slot), (j // _SCHED_SLOTS) & 1)
    nxt = gl.load(sched.SCHED + (2 + gl.program_id(0) * _SCHED_SLOTS + slot), volatile=True)
    mbarrier.arrive(sched.tid_empty.index(slot), count=1)
    return nxt


@gluon.jit
def _slot_tile(slot, sched, cfg):
    """A CTA's ``slot`` (its place in the static round robin, or the tile it claimed) -> the
    tile it runs and the grid :func:`_tile_work`'s LPT order deals over (every tile of a
    dynamic launch is dealt already: the identity)."""
    if cfg.DYNAMIC:
        return slot, sched.num_tiles
    if cfg.LPT > 0:  # (the LPT order deals its own: _tile_work)
        return slot, sched.grid_size
    return _dealt(slot, sched.num_tiles, sched.grid_size), sched.grid_size


@gluon.jit
def _retire(sched):
    """Producer, after its last claim: count the CTA retired; the last of the grid resets both
    counters for the next launch (every claim is made by then)."""
    lanes, first = _lane0()
    zero = lanes * 0
    retired = gl.atomic_add(sched.SCHED + 1 + zero, zero + 1, mask=first, sem="acq_rel")
    if gl.max(gl.where(first, retired, 0), axis=0) == sched.grid_size - 1:
        gl.store(sched.SCHED + lanes, zero, mask=lanes < 2)


@gluon.jit
def _tile_work(tile, deal_grid, prob, num_tiles, cfg):
    """Tile ``tile`` of the persistent schedule -> its :class:`FwdTile` (``deal_grid``: the
    grid the LPT order deals over, :func:`_slot_tile`).

    Tiles are numbered m-block fastest, then head, then batch: CTAs that run at the same time
    share a head's K/V in L2. With an upper band (causal) the m order is reversed so that each
    head's longest tiles come first. Every partition calls this, so all walk the same tiles.
    """
    ROWS: gl.constexpr = cfg.CONSUMERS * cfg.BLOCK_M
    n_m = prob.n_m
    seqlen_q = prob.seqlen_q
    seqlen_k = prob.seqlen_k
    if cfg.LPT > 0:
        # Longest first within groups of (batch, head) pairs whose K and V fit in LPT MiB
        # together (query heads of one KV head count once): in a group, m-block slowest
        # and (batch, head) fastest, i.e. sorted by length for an upper band. Persistent grids
        # deal the tiles in snake order: round r of grid_size tiles goes to CTAs 0, 1, ... when
        # r is even and back from the last CTA when odd, so that no CTA gets the longest tile
        # of every round (the static round robin in m-fastest order gave some CTAs mostly long
        # tiles: 430 vs 596 TFLOP/s, B1 H16 L16k causal). Ungrouped, the m-slowest order
        # streams every head's K/V each round (B4 H16 L4k D128 causal 460 vs 520 TFLOP/s).
        n_hb = num_tiles // n_m
        t = _dealt(tile, num_tiles, deal_grid)
        KEY_BYTES: gl.constexpr = 2 if cfg.FP8 else 4  # K + V bytes of one key per dim
        KEYS: gl.constexpr = cfg.LPT * 2**20 // (KEY_BYTES * cfg.HEAD_DIM)  # K + V fill LPT MiB
        heads = gl.maximum(KEYS // seqlen_k, 1) * prob.group_size
        first = t // (heads * n_m) * heads
        n_group = gl.minimum(heads, n_hb - first)
        local = t - first * n_m
        pid_m = n_m - 1 - local // n_group
        hb = first + local % n_group
    else:
        pid_m = tile % n_m
        if cfg.HAS_UPPER:
            pid_m = n_m - 1 - pid_m
        hb = tile // n_m
    h = hb % prob.num_heads
    b = hb // prob.num_heads
    q_off = 0
    k_off = 0
    if cfg.IS_VARLEN:
        # (index bounding, issue 39) seqlen_q / seqlen_k arrive as the packed totals: every
        # cu_seqlens / seqused_k value is clamped into them, as common.seq_bounds does.
        q_off = gl.minimum(gl.maximum(gl.load(prob.CU_SEQLENS_Q + b), 0), seqlen_q)
        seqlen_q = gl.minimum(gl.maximum(gl.load(prob.CU_SEQLENS_Q + b + 1), q_off),
                              seqlen_q) - q_off
        k_off = gl.minimum(gl.maximum(gl.load(prob.CU_SEQLENS_K + b), 0), seqlen_k)
        seqlen_k = gl.minimum(gl.maximum(gl.load(prob.CU_SEQLENS_K + b + 1), k_off),
                              seqlen_k) - k_off
    if cfg.HAS_SEQUSED_K:
        seqlen_k = gl.minimum(gl.maximum(gl.load(prob.SEQUSED_K + b), 0), seqlen_k)
    if cfg.IS_VARLEN:
        b = 0
    start_m = pid_m * ROWS
    lower, upper = band_offsets(seqlen_q, seqlen_k, prob.left, prob.right)
    lo, full_lo, full_hi, hi = block_range(start_m, seqlen_q, seqlen_k, lower, upper,
                                           ROWS, cfg.BLOCK_N, cfg.HAS_LOWER, cfg.HAS_UPPER)
    return FwdTile(b, h, h // prob.group_size, start_m, q_off, k_off, seqlen_q, seqlen_k, lower,
                   upper, lo, full_lo, full_hi, hi)


@gluon.jit
def _produce_tile(q_desc, k_desc, v_desc, smem, kv_it, tile_it, tile, q_row, v_off, cfg):
    """The loads of one tile: its Q tile per consumer (rows from ``q_row``), then K_j and V_j
    as ring slots free up (FP8: V_j from the transposed ``(b, h_kv, d, s_k)`` copy, keys along
    the tile's columns, the sequence's keys from column ``v_off``; 16-bit V rows start at
    ``k_off`` as K's)."""
    for wg in gl.static_range(cfg.CONSUMERS):
        wait_empty(smem.q_empty, wg, tile_it & 1)
        ring_load(q_desc, [tile.b, tile.h, q_row + wg * cfg.BLOCK_M, 0], smem.q, smem.q_ready, wg)
    for start_n in range(tile.lo, tile.hi, cfg.BLOCK_N):
        slot, parity = ring_slot(kv_it, cfg.STAGES)
        wait_empty(smem.k_empty, slot, parity)
        ring_load(k_desc, [tile.b, tile.h_kv, tile.k_off + start_n, 0], smem.k, smem.k_ready,
                  slot)
        wait_empty(smem.v_empty, slot, parity)
        if cfg.FP8:
            ring_load(v_desc, [tile.b, tile.h_kv, 0, v_off + start_n], smem.v, smem.v_ready, slot)
        else:
            ring_load(v_desc, [tile.b, tile.h_kv, tile.k_off + start_n, 0], smem.v, smem.v_ready,
                      slot)
        kv_it += 1
    return kv_it, tile_it + 1


@gluon.jit
def _produce_one(tile_idx, deal_grid, kv_it, tile_it, q_desc, k_desc, v_desc, smem, prob, sched,
                 cfg):
    """The producer's work for tile ``tile_idx`` (``deal_grid`` as :func:`_tile_work`'s) ->
    the updated ``(kv_it, tile_it)``."""
    tile = _tile_work(tile_idx, deal_grid, prob, sched.num_tiles, cfg)
    if cfg.IS_VARLEN:  # (two call sites: see _consume_one)
        v_off = tile.k_off
        if cfg.FP8:  # the sequence's columns of the transposed V (fp8_v_transpose_varlen_kernel)
            v_off = fp8_varlen_v_start(tile.k_off, (tile_idx // prob.n_m) // prob.num_heads)
        if tile.start_m < tile.seqlen_q:
            kv_it, tile_it = _produce_tile(q_desc, k_desc, v_desc, smem, kv_it, tile_it, tile,
                                           tile.q_off + tile.start_m, v_off, cfg)
    else:
        kv_it, tile_it = _produce_tile(q_desc, k_desc, v_desc, smem, kv_it, tile_it, tile,
                                       tile.start_m, 0, cfg)
    return kv_it, tile_it


@gluon.jit
def _producer(q_desc, k_desc, v_desc, smem, prob, sched, cfg):
    """One warp: per tile, TMA the consumers' Q tiles, then K_j and V_j into the ring as slots
    free up.

    ``kv_it`` counts ring uses across tiles, so the next tile's first blocks stream in while the
    consumers still finish the current one. Empty varlen tiles (past a short sequence's end)
    are skipped here and by the consumers alike, so ``tile_it`` agrees between them.
    ``DYNAMIC``: the CTA's tiles after its first are claimed from the launch's counter
    (:func:`_claim_next`), each claim made after the current tile's loads. (Claimed before
    them, the CTAs that started first, which run the longest tiles of a longest-first order,
    took the remaining tiles too: B1 H8 L3072 d=128 causal 329 vs 424 TFLOP/s with one CTA a
    tile, H200.)
    """
    kv_it = 0
    tile_it = 0
    j = 0
    slot = gl.program_id(0)  # the CTA's place in the round robin, or its claimed tile
    while slot < sched.num_tiles:
        tile_idx, deal_grid = _slot_tile(slot, sched, cfg)
        kv_it, tile_it = _produce_one(tile_idx, deal_grid, kv_it, tile_it, q_desc, k_desc, v_desc,
                                      smem, prob, sched, cfg)
        if cfg.DYNAMIC:
            slot = _claim_next(sched, j)
        else:
            slot = slot + sched.grid_size
        j += 1
    if cfg.DYNAMIC:
        _retire(sched)


@gluon.jit
def _kv_range(st, o, p, alpha, m_i, l_i, it0, lo, start, end, cfg, MASKED: gl.constexpr):
    """:func:`solattn.kernels.hopper.step.kv_step` over key blocks ``[start, end)``; block
    ``lo`` was ring use ``it0``."""
    for start_n in range(start, end, cfg.BLOCK_N):
        o, p, alpha, m_i, l_i = kv_step(st, o, p, alpha, m_i, l_i,
                                         it0 + (start_n - lo) // cfg.BLOCK_N, start_n, cfg,
                                         MASKED)
    return o, p, alpha, m_i, l_i


@gluon.jit
def _attend_tile(st, q_empty, kv_it, tile, cfg):
    """``BLOCK_M`` rows of Q against the tile's key blocks ``[lo, hi)`` -> un-normalized
    ``(o, m, l)``.

    The first block is the prologue (no ``P V`` to overlap yet) and always runs masked; then the
    masked leading edge, the unmasked interior, the masked trailing edge; then the last ``P V``.
    Q is released (``q_empty``) as soon as the last ``Q K^T`` is done, so the producer loads the
    next tile's Q during the last ``P V`` and the epilogue.
    """
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    FP8: gl.constexpr = cfg.FP8
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32 if FP8 else 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cfg.HEAD_DIM_V, 32 if FP8 else 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=4 if FP8 else 2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    lo = tile.lo
    full_lo = tile.full_lo
    full_hi = tile.full_hi
    hi = tile.hi

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    o = gl.zeros([BLOCK_M, cfg.HEAD_DIM_V], gl.float32, o_layout)
    if hi > lo:
        slot, parity = ring_slot(kv_it, cfg.STAGES)
        wait_ready(st.k_ready, slot, parity)
        k_t = st.k.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        qk = warpgroup_mma(st.q_tile, k_t, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                           use_acc=False)
        release(st.k_empty, slot)
        p_f32, alpha, m_i, l_i = st.softmax(qk, m_i, l_i, lo, cfg, True)
        p_dtype: gl.constexpr = gl.float16 if FP8 else st.q_tile.dtype  # (FP8: p_operand)
        p = p_operand(p_f32, p_dtype, p_layout, BLOCK_M, BLOCK_N, FP8)

        second = lo + BLOCK_N
        o, p, alpha, m_i, l_i = _kv_range(st, o, p, alpha, m_i, l_i, kv_it, lo, second, full_lo,
                                          cfg, True)
        o, p, alpha, m_i, l_i = _kv_range(st, o, p, alpha, m_i, l_i, kv_it, lo,
                                          gl.maximum(full_lo, second), full_hi, cfg, False)
        o, p, alpha, m_i, l_i = _kv_range(st, o, p, alpha, m_i, l_i, kv_it, lo,
                                          gl.maximum(full_hi, second), hi, cfg, True)
        mbarrier.arrive(q_empty, count=1)

        # Tail: P V of the last block.
        last, last_parity = ring_slot(kv_it + gl.cdiv(hi - lo, BLOCK_N) - 1, cfg.STAGES)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout), assert_trivial=True)[:, None]
        wait_ready(st.v_ready, last, last_parity)
        o = warpgroup_mma(a_operand(p, FP8),
                          v_operand(st.v, last, cfg.HEAD_DIM_V, BLOCK_N, FP8), o)
        release(st.v_empty, last)
    else:
        mbarrier.arrive(q_empty, count=1)
    return o, m_i, l_i


@gluon.jit
def _consume_tile(WG: gl.constexpr, q_tile, smem, out, prob, kv_it, tile_it, tile, descale_idx,
                  alibi_idx, drop_b, cfg):
    """One tile of one warpgroup: attend, normalize, write O and the LSE.

    FP8: the scores are in units of the stored (scaled) Q and K, so the tile's descales
    ``q_descale * k_descale`` (element ``descale_idx`` of the ``(batch, h_kv)`` arrays) fold into
    the scale that multiplies them (``softcap_prescale`` with softcap, else ``qk_scale``, which
    the LSE then uses too); ``v_descale`` multiplies ``1 / l``. ``smem.o`` stages the bf16 O
    for its TMA store (Q's fp8 buffer is too small); 16-bit inputs stage it in Q's buffer
    (viewed as ``[BLOCK_M, HEAD_DIM_V]`` when ``HEAD_DIM_V < HEAD_DIM``).

    ``HEAD_DIM`` / ``HEAD_DIM_V`` are the tiles' widths (powers of two); ``V_COLS`` the output's
    true width (a head dim of 96 or 192 runs in a 128 or 256 tile: TMA reads zeros past the
    tensor's last column and stores nothing there; the register epilogue masks those columns).
    ALiBi: element ``alibi_idx`` of ``ALIBI`` is the (sequence, head)'s slope. Dropout: the
    mask's batch entry is ``drop_b`` (varlen: the sequence). Varlen tiles store from registers
    (a tile's ragged rows belong to the next sequence).
    """
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    HEAD_DIM_V: gl.constexpr = cfg.HEAD_DIM_V
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    FP8: gl.constexpr = cfg.FP8
    REGISTER_EPILOGUE: gl.constexpr = cfg.REGISTER_EPILOGUE or cfg.IS_VARLEN
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cfg.BLOCK_N, 32 if FP8 else 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM_V, 32 if FP8 else 16])
    o_rows_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    b = tile.b
    h = tile.h
    seqlen_q_b = tile.seqlen_q
    cols = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
    row_start = tile.start_m + WG * BLOCK_M
    rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    qk_scale = out.qk_scale
    softcap_prescale = out.softcap_prescale
    if FP8:
        qk_descale = gl.load(out.Q_DESCALE + descale_idx) * gl.load(out.K_DESCALE + descale_idx)
        if cfg.HAS_SOFTCAP:
            softcap_prescale = softcap_prescale * qk_descale
        else:
            qk_scale = qk_scale * qk_descale
    alibi_slope = 0
    alibi_diag = 0
    if cfg.HAS_ALIBI:  # (slope in m's units, each row's diagonal key): FwdStep.softmax
        alibi_slope = gl.load(out.ALIBI + alibi_idx) * LOG2E / qk_scale
        alibi_diag = (rows + (tile.seqlen_k - seqlen_q_b)).to(gl.float32)
    drop = 0
    if cfg.HAS_DROPOUT:  # (the tuple of solattn.kernels.common.dropout_params)
        drop = (gl.load(out.SEED), drop_b, h, out.dropout_threshold, out.dropout_scale)
    wait_ready(smem.q_ready, WG, tile_it & 1)
    st = FwdStep(q_tile, smem.k, smem.v, smem.k_ready, smem.k_empty, smem.v_ready, smem.v_empty,
                 rows, tile.seqlen_k, tile.lower, tile.upper, qk_scale, softcap_prescale,
                 alibi_slope, alibi_diag, drop, row_start, False)
    o, m_i, l_i = _attend_tile(st, smem.q_empty.index(WG), kv_it, tile, cfg)
    kv_it += gl.cdiv(tile.hi - tile.lo, cfg.BLOCK_N)

    # Rows that saw no key: l = 0 -> output 0, lse = -inf.
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    if FP8:
        v_descale = gl.load(out.V_DESCALE + descale_idx)
        o = o * gl.convert_layout(v_descale / l_safe, o_rows_layout, assert_trivial=True)[:, None]
    elif cfg.HAS_DROPOUT:
        o = o * gl.convert_layout(out.dropout_scale / l_safe, o_rows_layout,
                                  assert_trivial=True)[:, None]
    else:
        o = o / gl.convert_layout(l_safe, o_rows_layout, assert_trivial=True)[:, None]
    if cfg.STORE_LSE:
        if FP8:  # l carries p's 2**8 (FwdStep.softmax)
            lse = gl.where(empty, float("-inf"),
                           (m_i * qk_scale + gl.log2(l_safe) - 8.0) * LN2)
        else:
            lse = gl.where(empty, float("-inf"),
                           (m_i * qk_scale + gl.log2(l_safe)) * LN2)
        # int32 offsets (LSE below 2**31 elements): a 64-bit product with an argument
        # gets hoisted out of the tile loop by LLVM and spilled across the partitions.
        lse_ptrs = out.LSE + ((b * prob.num_heads + h) * prob.seqlen_q + tile.q_off + rows)
        gl.store(lse_ptrs, lse, mask=rows < seqlen_q_b)
    if REGISTER_EPILOGUE:
        O = out.O
        o_rows = gl.convert_layout(rows, o_rows_layout, assert_trivial=True)
        o_offs = ((b * prob.seqlen_q + tile.q_off + o_rows) * prob.num_heads + h).to(
            gl.int64) * cfg.V_COLS
        o_ptrs = O + (o_offs[:, None] + cols[None, :])
        if cfg.V_COLS == HEAD_DIM_V:
            gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(o_rows < seqlen_q_b)[:, None])
        else:
            gl.store(o_ptrs, o.to(O.dtype.element_ty),
                     mask=(o_rows < seqlen_q_b)[:, None] & (cols < cfg.V_COLS)[None, :])
    elif cfg.O_STAGING:
        # Persistent, with O's own staging tile per warpgroup: the previous tile's TMA store
        # must have read it (the store's wait covers the thread that issued it; the barrier
        # holds the others until it returns), then the store is left in flight across the
        # next tile's work (_consumer waits for the last one before the CTA exits).
        o_desc = out.o_desc
        o_tile = smem.o.index(WG)
        tma.store_wait(0)
        barrier()
        o_tile.reshape([BLOCK_M, HEAD_DIM_V]).store(o.to(o_desc.dtype))
        fence_async_shared()
        tma_store(o_desc, [b, h, row_start, 0], o_tile)
    else:
        # The CTA's only tile: Q's buffer is dead, stage O there for one TMA store (bulk
        # 128-byte writes; measured 1-4% faster than the register stores above).
        o_desc = out.o_desc
        if FP8:
            smem.o.index(WG).reshape([BLOCK_M, HEAD_DIM]).store(o.to(smem.o.dtype))
            fence_async_shared()
            tma_store(o_desc, [b, h, row_start, 0], smem.o.index(WG))
        elif HEAD_DIM_V == HEAD_DIM:
            q_tile.store(o.to(q_tile.dtype))
            fence_async_shared()
            tma_store(o_desc, [b, h, row_start, 0], smem.q.index(WG))
        else:  # O is narrower than Q: the front of Q's buffer, in o_desc's tile shape
            o_tile = reinterpret(smem.q.index(WG), o_desc.dtype, o_desc.block_type.shape,
                                 o_desc.layout)
            o_tile.reshape([BLOCK_M, HEAD_DIM_V]).store(o.to(o_desc.dtype))
            fence_async_shared()
            tma_store(o_desc, [b, h, row_start, 0], o_tile)
        tma.store_wait(0)
    return kv_it, tile_it + 1


@gluon.jit
def _consume_one(WG: gl.constexpr, tile_idx, deal_grid, kv_it, tile_it, q_tile, smem, out, prob,
                 sched, cfg):
    """One warpgroup's work for tile ``tile_idx`` (``deal_grid`` as :func:`_produce_one`'s) ->
    the updated ``(kv_it, tile_it)``."""
    tile = _tile_work(tile_idx, deal_grid, prob, sched.num_tiles, cfg)
    n_m = prob.n_m
    num_heads = prob.num_heads
    group_size = prob.group_size
    descale_idx = 0
    if cfg.FP8:  # (batch, h_kv) of the descales (the batch from the tile: _tile_work's order)
        if cfg.LPT > 0:
            descale_idx = tile.b * (num_heads // group_size) + tile.h // group_size
        else:
            descale_idx = ((tile_idx // n_m) // num_heads * (num_heads // group_size)
                           + tile.h // group_size)
    alibi_idx = tile.h  # the slope of (batch entry or sequence, head): (h,) or (b, h) slopes
    if cfg.ALIBI_BATCHED:
        if cfg.LPT > 0:  # (never varlen: b is the batch entry)
            alibi_idx = tile.b * num_heads + tile.h
        else:
            alibi_idx = tile_idx // n_m  # = b * num_heads + h (_tile_work's order)
    drop_b = tile.b  # dropout's batch entry: varlen, the sequence (descriptors' b is 0)
    if cfg.IS_VARLEN:
        drop_b = tile_idx // n_m // num_heads  # (varlen tiles run in _tile_work's order)
    # Two call sites rather than one under a runtime test: without varlen the consumer
    # compiles with no per-tile branch (the same SASS as a kernel with no varlen support).
    if cfg.IS_VARLEN:
        if tile.start_m < tile.seqlen_q:
            kv_it, tile_it = _consume_tile(WG, q_tile, smem, out, prob, kv_it, tile_it, tile,
                                           descale_idx, alibi_idx, drop_b, cfg)
    else:
        kv_it, tile_it = _consume_tile(WG, q_tile, smem, out, prob, kv_it, tile_it, tile,
                                       descale_idx, alibi_idx, drop_b, cfg)
    return kv_it, tile_it


@gluon.jit
def _consumer(WG: gl.constexpr, smem, out, prob, sched, cfg):
    """One warpgroup: rows ``[WG * BLOCK_M, (WG + 1) * BLOCK_M)`` of every tile this CTA runs.

    Epilogue per tile: the LSE, and ``O / l``: with ``REGISTER_EPILOGUE`` (set for persistent
    grids without ``O_STAGING`` and outputs in another dtype than the staging buffer's) or
    varlen, stored straight from registers (rows past the sequence masked: a varlen tile's
    ragged rows belong to the next sequence; persistent: Q's buffer is the next tile's); with
    ``O_STAGING`` (persistent) through ``smem.o``, O's own tile, and a TMA store that stays in
    flight until the next tile's epilogue; otherwise (one tile a CTA) through Q's buffer, or
    ``smem.o`` for FP8, and a TMA store. ``DYNAMIC``: after each tile, the next one's index
    from the producer (:func:`_next_tile`).
    """
    q_tile = smem.q.index(WG).reshape([cfg.BLOCK_M, cfg.HEAD_DIM])
    kv_it = 0
    tile_it = 0
    j = 0
    slot = gl.program_id(0)  # as _producer's
    while slot < sched.num_tiles:
        tile_idx, deal_grid = _slot_tile(slot, sched, cfg)
        kv_it, tile_it = _consume_one(WG, tile_idx, deal_grid, kv_it, tile_it, q_tile, smem, out,
                                      prob, sched, cfg)
        if cfg.DYNAMIC:
            slot = _next_tile(sched, j)
        else:
            slot += sched.grid_size
        j += 1
    if cfg.O_STAGING:  # (the last tile's O store: shared memory lives until the CTA exits)
        tma.store_wait(0)


@gluon.jit
def _attn_fwd(q_desc, k_desc, v_desc, out, prob, SCHED, num_tiles, grid_size, cfg,
              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """The body of :func:`attn_fwd_kernel` and :func:`attn_fwd_fp8_kernel`: shared memory,
    barriers, and the warp-specialized partitions."""
    # Persistent: one CTA per SM walks tiles pid, pid + grid, ...; otherwise grid = tiles and
    # each CTA runs one (see _tile_work).
    CONSUMERS: gl.constexpr = cfg.CONSUMERS
    STAGES: gl.constexpr = cfg.STAGES
    o_desc = out.o_desc
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape,
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    o_smem = q_smem
    # O's own staging tiles: persistent (O_STAGING), where Q's buffer takes the next tile's Q
    # during the epilogue; FP8, whose bf16 O is twice Q's fp8 tile.
    if cfg.O_STAGING or (cfg.FP8 and not cfg.REGISTER_EPILOGUE):
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape,
                                           o_desc.layout)
    # Q: one slot per consumer warpgroup, each used once a tile. K and V: STAGES-deep rings
    # whose empties count one arrival per consumer warpgroup.
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    if cfg.DYNAMIC:  # the claimed tiles' slots (_claim_next, _next_tile)
        tid_ready = gl.allocate_shared_memory(gl.int64, [_SCHED_SLOTS, 1],
                                              mbarrier.MBarrierLayout())
        tid_empty = gl.allocate_shared_memory(gl.int64, [_SCHED_SLOTS, 1],
                                              mbarrier.MBarrierLayout())
        for i in gl.static_range(_SCHED_SLOTS):
            mbarrier.init(tid_ready.index(i), count=1)
            mbarrier.init(tid_empty.index(i), count=CONSUMERS)
    else:  # (unused)
        tid_ready = q_ready
        tid_empty = q_empty
    fence_async_shared()
    smem = FwdSmem(q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                   v_empty)
    sched = FwdSchedule(SCHED, tid_ready, tid_empty, num_tiles, grid_size)

    # The first partition runs in the kernel's own 4 warps; the others are workers. (Gluon
    # takes no function-valued variables: each count spells its partitions out.)
    if CONSUMERS == 2:
        warp_specialize([
            (_consumer, (0, smem, out, prob, sched, cfg)),
            (_consumer, (1, smem, out, prob, sched, cfg)),
            (_producer, (q_desc, k_desc, v_desc, smem, prob, sched, cfg)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 3:
        warp_specialize([
            (_consumer, (0, smem, out, prob, sched, cfg)),
            (_consumer, (1, smem, out, prob, sched, cfg)),
            (_consumer, (2, smem, out, prob, sched, cfg)),
            (_producer, (q_desc, k_desc, v_desc, smem, prob, sched, cfg)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        warp_specialize([
            (_consumer, (0, smem, out, prob, sched, cfg)),
            (_producer, (q_desc, k_desc, v_desc, smem, prob, sched, cfg)),
        ], [1], [PRODUCER_REGS])

# Lengths and counts are not specialized (divisibility by 16, == 1): one binary per config
# serves every shape, so a new sequence length never triggers a compile.
@gluon.jit(do_not_specialize=["num_tiles", "n_m", "num_heads", "grid_size", "seqlen_q",
                              "seqlen_k", "group_size", "left", "right", "dropout_threshold"])
def attn_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc,   # rank-4 TMA descriptors over (b, h, s, d) views of BSHD
    O,                                # (b, s_q, h, d) contiguous (o_desc's tensor, or float32)
    LSE,                              # (b, h, s_q) float32 contiguous
    SEQUSED_K,                        # (b,) int32: keys used per batch entry (KV caches)
    CU_SEQLENS_Q, CU_SEQLENS_K,       # (b + 1,) int32, varlen only: sequence starts
    SCHED,                            # int32 workspace, DYNAMIC only (_SCHED_SLOTS' comment)
    SEED,                             # dropout's (1,) int64 seed, HAS_DROPOUT only
    num_tiles, n_m, num_heads,        # tiles = n_m (row blocks of 2 * BLOCK_M) * heads * batch
    grid_size,                        # = num_programs(0), an argument: see FwdSchedule
    seqlen_q, seqlen_k, group_size,   # h_q // h_kv; varlen: total rows of q and k
    qk_scale, softcap_prescale, left, right,
    dropout_threshold, dropout_scale,  # round(dropout_p * 2**31), 1 / (1 - dropout_p)
    ALIBI,                            # (b, h) or (h,) float32 contiguous ALiBi slopes
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    STORE_LSE: gl.constexpr, HAS_SEQUSED_K: gl.constexpr, IS_VARLEN: gl.constexpr,
    REGISTER_EPILOGUE: gl.constexpr,  # O stored from registers, not through o_desc (_consumer)
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMERS: gl.constexpr,          # consumer warpgroups of BLOCK_M rows each: 2, 3 or 1
    HEAD_DIM_V: gl.constexpr,         # V / O tile width (a power of two; HEAD_DIM: Q / K's)
    V_COLS: gl.constexpr,             # O's true head dim (<= HEAD_DIM_V; the row stride of O)
    HAS_ALIBI: gl.constexpr,          # subtract slope * |diagonal - key| (FwdStep.softmax)
    ALIBI_BATCHED: gl.constexpr,      # slopes per (batch entry or sequence, head), not per head
    LPT: gl.constexpr,                # > 0: tiles longest first in head groups (_tile_work)
    DYNAMIC: gl.constexpr = False,    # persistent CTAs claim their tiles from a counter
    HAS_DROPOUT: gl.constexpr = False,  # drop probabilities by the Philox mask (FwdStep.softmax)
    O_STAGING: gl.constexpr = False,  # persistent: O through its own shared tile and a TMA store
):
    """The fp16/bf16 forward (LSE stands in for the descale pointers, which FP8=False never
    reads)."""
    prob = FwdProblem(SEQUSED_K, CU_SEQLENS_Q, CU_SEQLENS_K, n_m, num_heads, group_size,
                      seqlen_q, seqlen_k, left, right)
    out = FwdOut(O, o_desc, LSE, LSE, LSE, LSE, qk_scale, softcap_prescale, ALIBI, SEED,
                 dropout_threshold, dropout_scale)
    cfg = FwdConsts(HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP,
                    STORE_LSE, HAS_SEQUSED_K, IS_VARLEN, REGISTER_EPILOGUE, CONSUMERS, False,
                    HEAD_DIM_V, V_COLS, HAS_ALIBI, ALIBI_BATCHED, LPT, DYNAMIC, HAS_DROPOUT,
                    O_STAGING)
    _attn_fwd(q_desc, k_desc, v_desc, out, prob, SCHED, num_tiles, grid_size, cfg,
              CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit(do_not_specialize=["num_tiles", "n_m", "num_heads", "grid_size", "seqlen_q",
                              "seqlen_k", "group_size", "left", "right"])
def attn_fwd_fp8_kernel(
    q_desc, k_desc,                   # e4m3 Q, K: as attn_fwd_kernel's
    v_desc,                           # e4m3 V transposed, (b, h_kv, d, s_k'): fp8_v_operand
    o_desc,                           # bf16 O (b, h, s_q, d) view (REGISTER_EPILOGUE: unused)
    O, LSE, SEQUSED_K, CU_SEQLENS_Q, CU_SEQLENS_K,   # as attn_fwd_kernel's
    Q_DESCALE, K_DESCALE, V_DESCALE,  # (batch, h_kv) float32 contiguous
    SCHED,                            # int32 workspace, DYNAMIC only (as attn_fwd_kernel's)
    num_tiles, n_m, num_heads, grid_size, seqlen_q, seqlen_k, group_size,
    qk_scale, softcap_prescale, left, right,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LOWER: gl.constexpr, HAS_UPPER: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    STORE_LSE: gl.constexpr, HAS_SEQUSED_K: gl.constexpr, IS_VARLEN: gl.constexpr,
    REGISTER_EPILOGUE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMERS: gl.constexpr,
    O_STAGING: gl.constexpr = False,  # persistent: O (bf16) through smem.o and a TMA store
    LPT: gl.constexpr = 0,            # > 0: tiles longest first in head groups (_tile_work)
    DYNAMIC: gl.constexpr = False,    # persistent CTAs claim their tiles from a counter
):
    """The FP8 (e4m3) forward: the same pipeline, with the descales, 8-bit operands (K-major V)
    and P in e4m3 (scaled by 2**8) for ``P V``; O in bf16. Varlen: V is
    :func:`fp8_v_transpose_varlen_kernel`'s copy (sequence ``b`` from column
    :func:`fp8_varlen_v_start`)."""
    prob = FwdProblem(SEQUSED_K, CU_SEQLENS_Q, CU_SEQLENS_K, n_m, num_heads, group_size,
                      seqlen_q, seqlen_k, left, right)
    out = FwdOut(O, o_desc, LSE, Q_DESCALE, K_DESCALE, V_DESCALE, qk_scale, softcap_prescale, LSE,
                 LSE, 0, 1.0)
    cfg = FwdConsts(HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LOWER, HAS_UPPER, HAS_SOFTCAP,
                    STORE_LSE, HAS_SEQUSED_K, IS_VARLEN, REGISTER_EPILOGUE, CONSUMERS, True,
                    HEAD_DIM, HEAD_DIM, False, False, LPT, DYNAMIC, False, O_STAGING)
    _attn_fwd(q_desc, k_desc, v_desc, out, prob, SCHED, num_tiles, grid_size, cfg, CONSUMER_REGS,
              PRODUCER_REGS)


@triton.jit
def fp8_v_transpose_kernel(
    V,                                # (b, s_k, h_kv, d) 8-bit, last stride 1
    VT,                               # (b, h_kv, d, s_pad) 8-bit contiguous, s_pad % 32 == 0
    s_k, s_pad, h_kv, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``VT[b, h, :, n] = V[b, key(n), h, :]`` for ``BLOCK_K`` columns ``n`` of one (b, h_kv):
    within each group of 32 columns, column ``16h + 4q + 2j + e`` holds key
    ``16h + 8j + 2q + e`` (the order :func:`_p_operand` gives P's columns); keys past ``s_k``
    are 0. Rows of ``BLOCK_K`` contiguous bytes are stored whole."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // h_kv
    h = bh % h_kv
    n = pid_n * BLOCK_K + tl.arange(0, BLOCK_K)
    r = n % 32
    key = n - r + (r // 16) * 16 + ((r // 2) % 2) * 8 + ((r // 4) % 4) * 2 + r % 2
    d = tl.arange(0, HEAD_DIM)
    src = V + b.to(tl.int64) * stride_vb + h * stride_vh
    x = tl.load(src + key.to(tl.int64)[:, None] * stride_vs + d[None, :],
                mask=(key < s_k)[:, None], other=0)
    dst = VT + (bh.to(tl.int64) * HEAD_DIM + d[:, None]) * s_pad + n[None, :]
    tl.store(dst, tl.trans(x), mask=(n < s_pad)[None, :])


@triton.jit
def fp8_varlen_v_start(k_start, seq):
    """First column of sequence ``seq`` (keys from packed row ``k_start``) in
    :func:`fp8_v_transpose_varlen_kernel`'s copy: ``k_start`` rounded up to 32, plus 32 per earlier
    sequence. Multiples of 32 (the key permutation's groups start at each sequence's first key),
    and no two sequences overlap: ``ceil32(a) + ceil32(n) <= ceil32(a + n) + 32``."""
    return (k_start + 31) // 32 * 32 + 32 * seq


@triton.jit(do_not_specialize=("t_k",))
def fp8_v_transpose_varlen_kernel(
    V,                                # (t_k, h_kv, d) 8-bit packed keys, last stride 1
    VT,                               # (h_kv, d, s_pad) 8-bit contiguous
    CU_SEQLENS_K,                     # (batch + 1,) int32
    batch, t_k, s_pad, h_kv, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, TAIL: tl.constexpr,
):
    """:func:`fp8_v_transpose_kernel` per packed sequence: sequence ``b``'s keys, permuted in
    groups of 32 from its own first key, go to columns ``fp8_varlen_v_start(cu_k[b], b) + n``;
    the columns up to the next sequence's start (at most ``TAIL`` past this one's padded keys,
    the last sequence's up to ``s_pad``) are written 0, so the FP8 kernel's tiles that run past a
    sequence's end read finite values (zeros, or the next sequence's keys), never uninitialized
    bytes. The ``cu_seqlens_k`` values are clamped into ``[0, t_k]`` as the FP8 forward's
    ``_tile_work`` clamps them (so both place a sequence at the same column): whatever they
    hold, the kernel reads V's rows and writes VT's columns only."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // h_kv
    h = bh % h_kv
    k_start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b), 0), t_k)
    k_end = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b + 1), k_start), t_k)
    col0 = fp8_varlen_v_start(k_start, b)
    col_end = s_pad
    if b + 1 < batch:
        col_end = fp8_varlen_v_start(k_end, b + 1)
    col_end = tl.minimum(col_end, col0 + (k_end - k_start + 31) // 32 * 32 + TAIL)
    n = pid_n * BLOCK_K + tl.arange(0, BLOCK_K)
    r = n % 32
    key = n - r + (r // 16) * 16 + ((r // 2) % 2) * 8 + ((r // 4) % 4) * 2 + r % 2
    d = tl.arange(0, HEAD_DIM)
    src = V + h * stride_vh
    x = tl.load(src + (k_start + key).to(tl.int64)[:, None] * stride_vs + d[None, :],
                mask=(key < k_end - k_start)[:, None], other=0)
    dst = VT + (h.to(tl.int64) * HEAD_DIM + d[:, None]) * s_pad + (col0 + n)[None, :]
    tl.store(dst, tl.trans(x), mask=(col0 + n < col_end)[None, :])
