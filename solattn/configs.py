"""Kernel configurations: frozen dataclasses chosen by pure functions of (arch, head dim, ...).

``arch`` is the exact compute capability (86 for an RTX 3090). Each capability runs one class of
tables (:mod:`solattn.arch`, ``Arch.tables``): "sm90" (Hopper), "sm80" (A100; and
B200 until it is tuned), "sm86" (the parts of 99 KB of shared memory a block: RTX 3090, 4090,
5090); a capability the arch table does not list runs the "sm86" tables, the most conservative.
Every entry says where its numbers came from. Autotuning is not used on the default path: a call
must start fast and behave the same on every run. ``solattn bench --sweep`` (see ``bench/``)
re-measures candidate tables on a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import triton

from solattn.arch import arch_limits
from solattn.device import interpreting, triton_version


@dataclass(frozen=True)
class FwdConfig:
    """Tile shape and launch parameters of the portable forward kernel."""

    block_m: int     # query rows per program (one online-softmax state per row in registers)
    block_n: int     # keys per inner step (the S tile is block_m x block_n fp32)
    num_warps: int   # 8 at block_m 128 on sm_90: two wgmma warpgroups of 64 rows
    num_stages: int  # K/V tiles in flight (software pipelining of the key loop)


def padded_head_dim(d: int) -> int:
    """Head dims are padded to a power of two inside the kernel (tl.arange needs one); >= 16."""
    return max(16, triton.next_power_of_2(d))


# Portable forward. key: (padded max(head_dim, head_dim_v), upper-banded (causal / right window)).
# sm_90: H100 80GB HBM3, triton 3.6.0, bf16, 2026-11-22, scripts/sweep_portable.py (numbers in
# docs/journal/2026-11-22.md), restricted to tiles `solattn aot --arch 90` builds without spills.
# d=128 causal keeps 128x64: 128x128 spills with the causal mask and was no faster there.
# d=256: the fastest measured tile (64x32, 4 warps) spills; this is the fastest that does not.
_F = FwdConfig
_FWD_TABLE_SM90 = {
    (16, False): _F(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (16, True): _F(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (32, False): _F(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (32, True): _F(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (64, False): _F(block_m=128, block_n=64, num_warps=8, num_stages=3),
    (64, True): _F(block_m=128, block_n=64, num_warps=8, num_stages=3),
    (128, False): _F(block_m=128, block_n=128, num_warps=8, num_stages=3),
    (128, True): _F(block_m=128, block_n=64, num_warps=8, num_stages=3),
    (256, False): _F(block_m=64, block_n=32, num_warps=8, num_stages=3),
    (256, True): _F(block_m=64, block_n=32, num_warps=8, num_stages=3),
}

# From Triton 3.8 on, the d=128 non-causal 128x128 tile spills inside its loops (`solattn aot
# --arch 90`, 2026-11-23: 3.8 with every feature on 24 B, 14 LDL/STL in loops; 3.9 plain 96 B /
# 23 in loops, every feature 240 B / 133); the causal entry's 128x64 tile compiles spill-free on
# 3.6-3.9 (registers 221 / 255 on 3.9). On the H100 under 3.6, 128x64 was 7% slower non-causal.
_FWD_TABLE_SM90_TRITON_38 = {
    (128, False): _F(block_m=128, block_n=64, num_warps=8, num_stages=3),
}

# Ampere-class (sm_80/86/89) and newer non-Hopper parts: mma.sync keeps both operands in
# registers, so d >= 128 needs narrower key blocks than Hopper's wgmma. The largest tiles that
# compile without spills for sm_80 (`solattn aot --arch 80`, 2026-11-22); not timed on an Ampere
# GPU (none is lent here).
_FWD_TABLE_SM80 = {
    (16, False): _F(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (16, True): _F(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (32, False): _F(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (32, True): _F(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (64, False): _F(block_m=128, block_n=64, num_warps=8, num_stages=3),
    (64, True): _F(block_m=128, block_n=64, num_warps=8, num_stages=3),
    (128, False): _F(block_m=128, block_n=32, num_warps=8, num_stages=2),
    (128, True): _F(block_m=128, block_n=32, num_warps=8, num_stages=2),
    (256, False): _F(block_m=64, block_n=32, num_warps=8, num_stages=2),
    (256, True): _F(block_m=64, block_n=32, num_warps=8, num_stages=2),
}

# The 99 KB parts (sm_86 RTX 3090, sm_89 RTX 4090, sm_120 RTX 5090 / 5060). Rule: the sm_80 tile
# where its shared memory fits 99 KB a block, else one stage less (the AOT gate fails any entry
# above the part's limit). The sm_80 tiles are bound by registers (mma.sync keeps its operands
# there), not by shared memory, so every one fits and the table is sm_80's: `solattn aot --arch
# 86` (triton 3.6, 2026-11-28) measures 48 KB for d <= 128 (K/V tiles of 64 x 64 or 32 x 128 in
# 2-3 stages) and 68 KB for d=256 (64 x 32 in 2 stages). 8 warps a block fit the 1536 threads an
# SM of these parts holds; registers (178-252 a thread) allow one block an SM, as on sm_80, so
# the smaller shared memory costs no occupancy. Not timed on any of these GPUs.
_FWD_TABLE_SM86 = dict(_FWD_TABLE_SM80)

# Triton's interpreter runs every program instance in Python: small tiles keep tests fast, and
# 16 still exercises ragged tails, multi-block loops and the masked/unmasked split.
_FWD_INTERPRET = FwdConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def fwd_config(arch: int, head_dim: int, head_dim_v: int, upper_banded: bool) -> FwdConfig:
    """Config of the portable forward for compute capability ``arch`` (e.g. 90), head dims, and
    whether the mask has an upper edge (causal or a right window: a masked diagonal block)."""
    if interpreting():
        return _FWD_INTERPRET
    d = padded_head_dim(max(head_dim, head_dim_v))
    return all_fwd_configs(arch)[(d, bool(upper_banded))]


def flex_fwd_config(arch: int, head_dim: int, head_dim_v: int) -> FwdConfig:
    """Config of the FlexAttention forward (solattn.flex): the upper-banded entry (its 64-key
    tile: the 128-key one spilled inside loops once a mod was inlined). From Triton 3.9 with 2
    stages: with 3, the document + relative-bias mod spills inside its loops at d=128 (56 B, 15
    LDL/STL; `solattn aot`, 2026-11-23), with 2 it does not (not timed on a GPU)."""
    cfg = fwd_config(arch, head_dim, head_dim_v, True)
    if triton_version() >= (3, 9) and not interpreting():
        cfg = dataclasses.replace(cfg, num_stages=min(cfg.num_stages, 2))
    # The 99 KB parts: at d=64 the 3 stages of K/V tiles and of the mods' gathered loads (document
    # ids, a bias table) take 113 KB a block, past their 99 KB (sm_80's 163 KB holds it); 2 stages
    # take 65 KB. `solattn aot --arch 86`, 2026-11-28; not timed.
    if arch_limits(arch).tables == "sm86" and not interpreting():
        cfg = dataclasses.replace(cfg, num_stages=min(cfg.num_stages, 2))
    # From Triton 3.9 on sm_120, the 128-row tile with gathered mods spills inside its loop
    # (doc+relbias: 88 B, 21 local accesses in loops at d=64; 32 B, 14 at d=128); 64 rows compile
    # spill-free (220 / 176 registers). `solattn aot --arch 120`, 2026-11-28; not timed.
    if arch == 120 and triton_version() >= (3, 9) and not interpreting():
        cfg = dataclasses.replace(cfg, block_m=64)
    return cfg


def dropout_fwd_config(cfg: FwdConfig) -> FwdConfig:
    """``cfg`` for a forward with dropout: at least 8 warps and at most 64-key tiles. The
    per-element Philox draws of a 128 x 64 score tile spill on 4 warps at head dim 32 with
    Triton 3.9 (sm_80 and sm_90, 1-2 local accesses inside loops; `solattn aot`, 2026-11-23)
    and compile spill-free on 8; the configs of head dims >= 64 already have 8. The
    four-per-draw mask's interleave (common.dropout_keep) spills inside the loop of the d=128
    non-causal 128 x 128 tile (144 B, 35 LDL in loops, sm_90, Triton 3.6) and not with 64 keys
    (250 registers). Not timed on a GPU."""
    if interpreting():
        return cfg
    return dataclasses.replace(cfg, num_warps=max(cfg.num_warps, 8),
                               block_n=min(cfg.block_n, 64))


def all_fwd_configs(arch: int) -> dict[tuple[int, bool], FwdConfig]:
    """Every ((padded head dim, upper-banded) -> config) the dispatcher can pick on ``arch`` with
    the installed Triton."""
    tables = arch_limits(arch).tables
    if tables == "sm86":
        return _FWD_TABLE_SM86
    if tables != "sm90":
        return _FWD_TABLE_SM80
    if triton_version() >= (3, 8):
        return {**_FWD_TABLE_SM90, **_FWD_TABLE_SM90_TRITON_38}
    return _FWD_TABLE_SM90


# --------------------------------------------------------------------------------------------
# Decode (flash_attn_with_kvcache): split-KV kernel tiles and the num_splits heuristic.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch parameters of the split-KV decode kernel (kernels/triton/decode.py)."""

    block_m: int     # packed (query, head of the GQA group) rows: each K/V tile is read once
    block_n: int     # keys per step: small tiles finish a ragged tail sooner, more CTAs per SM
    num_warps: int   # 4: a decode step is bandwidth-bound, one warpgroup keeps loads in flight
    num_stages: int  # K/V tiles in flight, bounded by shared memory


# key: (padded max(head_dim, head_dim_v), wide) where wide = block_m >= 32 (s_q * group > 16:
# speculative decoding, chunked prefill); block_m itself comes from decode_block_m.
# Provenance: H100 80GB HBM3, triton 3.6.0, bf16, scripts/bench_decode.py --sweep, 2026-11-22
# (K+V GB/s, CUDA-graph medians; sweep table: docs/journal/2026-11-22.md). d=128: 32-key tiles, 3
# stages were best on both swept shapes (B64 L4096, B8 L32768) for block_m 16; wide query tiles
# lost 30% with 32-key tiles and keep 64. Other head dims: not swept, scaled from d=128 by the
# shared-memory budget.
_D = DecodeConfig
_DECODE_TABLE_SM90 = {
    (16, False): _D(block_m=16, block_n=64, num_warps=4, num_stages=3),
    (16, True): _D(block_m=64, block_n=64, num_warps=4, num_stages=3),
    (32, False): _D(block_m=16, block_n=64, num_warps=4, num_stages=3),
    (32, True): _D(block_m=64, block_n=64, num_warps=4, num_stages=3),
    (64, False): _D(block_m=16, block_n=64, num_warps=4, num_stages=3),
    (64, True): _D(block_m=64, block_n=64, num_warps=4, num_stages=3),
    (128, False): _D(block_m=16, block_n=32, num_warps=4, num_stages=3),
    (128, True): _D(block_m=64, block_n=64, num_warps=4, num_stages=3),
    (256, False): _D(block_m=16, block_n=32, num_warps=4, num_stages=2),
    (256, True): _D(block_m=64, block_n=32, num_warps=4, num_stages=2),
}

# Ampere-class parts: less shared memory (99-163 KB), one stage less. Not timed (no Ampere GPU
# is lent here); checked spill-free by `solattn aot --arch 80`.
_DECODE_TABLE_SM80 = {
    (16, False): _D(block_m=16, block_n=64, num_warps=4, num_stages=2),
    (16, True): _D(block_m=64, block_n=64, num_warps=4, num_stages=2),
    (32, False): _D(block_m=16, block_n=64, num_warps=4, num_stages=2),
    (32, True): _D(block_m=64, block_n=64, num_warps=4, num_stages=2),
    (64, False): _D(block_m=16, block_n=64, num_warps=4, num_stages=2),
    (64, True): _D(block_m=64, block_n=64, num_warps=4, num_stages=2),
    (128, False): _D(block_m=16, block_n=32, num_warps=4, num_stages=2),
    (128, True): _D(block_m=64, block_n=64, num_warps=4, num_stages=2),
    (256, False): _D(block_m=16, block_n=32, num_warps=4, num_stages=2),
    (256, True): _D(block_m=64, block_n=32, num_warps=4, num_stages=2),
}

# The 99 KB parts: the sm_80 tiles (the rule of _FWD_TABLE_SM86). They fit: 20 KB (d=64, 16 rows)
# to 56 KB (d=128, 64 rows) measured by `solattn aot --arch 86` (triton 3.6, 2026-11-28).
_DECODE_TABLE_SM86 = dict(_DECODE_TABLE_SM80)
# From Triton 3.9 (its CUDA 13 ptxas), the wide d=128 tile (64 x 64) spills inside its loop on
# sm_120 (32 B, 14 local accesses in loops) but not on sm_86/89; with 32 keys it compiles
# spill-free (222 registers, 36 KB). `solattn aot --arch 120`, 2026-11-28; not timed.
_DECODE_SM120_TRITON_39 = {(128, True): _D(block_m=64, block_n=32, num_warps=4, num_stages=2)}

# The interpreter: tiny tiles so CPU tests cover multi-block splits, ragged tails and pages
# larger and smaller than a key block.
_DECODE_INTERPRET = _D(block_m=16, block_n=16, num_warps=4, num_stages=1)


def decode_block_m(rows: int) -> int:
    """Packed rows per program: ``seqlen_q * group_size`` rounded up to a power of two, in
    [16, 64] (16 is the smallest ``tl.dot``; 64 keeps the fp32 accumulator in registers)."""
    return min(64, max(16, triton.next_power_of_2(max(rows, 1))))


def decode_config(arch: int, head_dim: int, head_dim_v: int, rows: int) -> DecodeConfig:
    """Config of the decode kernel on ``arch`` for packed ``rows = seqlen_q * (h_q // h_kv)``."""
    block_m = decode_block_m(rows)
    if interpreting():
        return dataclasses.replace(_DECODE_INTERPRET, block_m=block_m)
    d = padded_head_dim(max(head_dim, head_dim_v))
    return dataclasses.replace(_decode_table(arch)[(d, block_m > 16)], block_m=block_m)


def _decode_table(arch: int) -> dict:
    if arch == 120 and triton_version() >= (3, 9):
        return {**_DECODE_TABLE_SM86, **_DECODE_SM120_TRITON_39}
    tables = arch_limits(arch).tables
    return {"sm90": _DECODE_TABLE_SM90, "sm86": _DECODE_TABLE_SM86}.get(tables,
                                                                      _DECODE_TABLE_SM80)


def all_decode_configs(arch: int) -> dict[tuple[int, int], DecodeConfig]:
    """((padded head dim, block_m) -> config) for ``solattn aot``: block_m 16 (decode) and 64
    (speculative / chunked prefill, the widest packed tile)."""
    return {(d, cfg.block_m): cfg for (d, _), cfg in _decode_table(arch).items()}


def combine_num_warps(arch: int, head_dim: int) -> int:
    """Warps of the split-merge kernel (kernels/triton/combine.py): 4. From Triton 3.9 (its
    CUDA 13 ptxas) the d=128 merge (16 rows, 4 parts a step, 4 warps) spills inside its loop on
    sm_100 and sm_120 (24-40 B, 4-5 local accesses in loops) and not with 8 warps (216-220
    registers); sm_80/86/89/90 compile it spill-free. `solattn aot`, 2026-11-28; not timed."""
    if (arch in (100, 120) and padded_head_dim(head_dim) == 128
            and triton_version() >= (3, 9) and not interpreting()):
        return 8
    return 4


# num_splits heuristic. A split costs one fp32 partial row per (split, query, head) and the
# combine launch, so split only as far as needed to fill the machine. Each CTA streams its slice
# at a roughly fixed rate, so time ~ ceil(waves) * slice: pick the smallest split count whose
# wave efficiency (waves / ceil(waves)) is within 5% of the best, and never cut a split shorter
# than _MIN_KEYS_PER_SPLIT keys (a CTA's fixed cost: q load, epilogue, partial write).
# Provenance: the FA2 wave-efficiency rule (flash_api.cpp num_splits_heuristic) with 2 CTA slots
# per SM; checked on the H100 by bench_decode.py --sweep (2026-11-22, bn64 st3, GB/s by split
# count): B64 L4096 (512 CTAs): 1 -> 2842, 2 -> 2818, 4 -> 2915, 8 -> 2888, 32 -> 2636 (picks 1);
# B8 L32768 (64 CTAs): 1 -> 2242, 2 -> 3085, 4 -> 3003, 8 -> 2810, 16 -> 2728 (picks 4; 2..6
# are within the ~3% noise).
_DECODE_CTAS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 128


def decode_num_splits(num_ctas: int, max_seqlen_k: int, block_n: int, num_sms: int) -> int:
    """Split count for ``num_ctas = batch * h_kv * m_blocks`` programs over ``max_seqlen_k`` keys.

    Pure function (tests and the benchmark call it directly).
    """
    if num_ctas <= 0 or max_seqlen_k <= 0:
        return 1
    n_blocks = triton.cdiv(max_seqlen_k, block_n)
    by_length = max_seqlen_k // _MIN_KEYS_PER_SPLIT
    max_splits = max(1, min(_MAX_SPLITS, n_blocks, by_length))
    slots = num_sms * _DECODE_CTAS_PER_SM
    effs = []
    for s in range(1, max_splits + 1):
        waves = num_ctas * s / slots
        # Under one wave, more splits add parallelism; past it, only the tail wave's fill counts.
        effs.append(waves / -(-waves // 1) if waves >= 1 else waves)
    best = max(effs)
    return next(s for s, eff in enumerate(effs, start=1) if eff >= 0.95 * best)


# flash_attn_func calls of few query rows run on the split-KV decode kernels (the single
# launch of flash_attn_with_kvcache, k/v as a full cache, nothing appended) rather than the
# prefill kernels, whose CTAs own 128 query rows of one head each: with s_q rows most of every
# tile is padding, and b * h CTAs leave most SMs idle on long keys. flash-attn 2 splits the keys
# of such calls in its flash_attn_func too. H100, bf16, scripts/bench_small_q.py (2026-11-26),
# flash_attn_func (Hopper) / decode kernel time, causal (full within 2%): B1 Hq32 Hkv8 d128 s_q 1
# at 2k / 8k / 32k / 128k keys 32.4 / 99.2 / 360 / 1409 us vs 15.7 / 27.0 / 65.2 / 191 us
# (2.1-7.4x); s_q 4 / 16 / 64 / 128 / 256 at 32k 4.97x / 3.27x / 3.21x / 1.98x / 1.12x; B8 s_q 1
# 8k 1.91x; B64 s_q 1 2k 2.25x; Hq32 Hkv4 d64 s_q 1 at 544 / 8k keys 1.16x / 5.82x; MHA Hq32 s_q 1
# / 16 at 8k 1.62x / 1.49x; H8 d256 s_q 1 32k 5.71x; but B4 Hq32 Hkv8 s_q 16 4k (128 prefill
# CTAs, short keys) 0.86x. Hence: up to 8 rows always; up to 128 rows over >= 8192 keys while
# the prefill grid fills at most half the SMs.
_SMALL_Q_ROWS = 8
_SMALL_Q_MAX_ROWS = 128
_SMALL_Q_MIN_KEYS = 8192


def small_q_decode(seqlen_q: int, seqlen_k: int, prefill_ctas: int, num_sms: int) -> bool:
    """Whether a call of ``seqlen_q`` query rows over ``seqlen_k`` keys, whose prefill kernel
    would launch ``prefill_ctas`` CTAs (``batch * heads * ceil(seqlen_q / 128)``), runs on the
    decode kernels (see above)."""
    if seqlen_q <= _SMALL_Q_ROWS:
        return True
    return (seqlen_q <= _SMALL_Q_MAX_ROWS and seqlen_k >= _SMALL_Q_MIN_KEYS
            and 2 * prefill_ctas <= num_sms)


@dataclass(frozen=True)
class BwdConfig:
    """Tiles and launch parameters of the portable backward (kernels/triton/backward.py)."""

    block_m: int        # queries per step of the dK/dV program (dK, dV stay in registers)
    block_n: int        # keys per dK/dV program: 64 per wgmma warpgroup
    num_warps: int      # of the dK/dV kernel
    num_stages: int     # Q/dO tiles in flight in the dK/dV kernel's unmasked interior loop
    dq_block_m: int     # query rows per program of the dQ kernel
    dq_block_n: int     # keys per step of the dQ kernel
    dq_num_warps: int   # of the dQ kernel
    dq_num_stages: int  # K/V tiles in flight in the dQ kernel
    atomic_dq: bool = False  # dQ by fp32 atomics from the dK/dV kernel instead of its own kernel
    split_dkdv: bool = False  # dK and dV in two launches (large head dims: registers)
    edge_m: int = 16    # query step of the masked edge blocks (see edge_block_m)

    @property
    def edge_block_m(self) -> int:
        """Query step of the dK/dV kernel's masked edge blocks (diagonal, window edges, ragged
        end): ``edge_m`` (default 16, whose mask tiles fit the registers the unmasked interior
        step leaves), never more than ``block_m``."""
        return min(self.block_m, self.edge_m)

    @property
    def edge_num_stages(self) -> int:
        """Pipelining depth of the dK/dV kernel's masked edge loops: at most 2 (a third Q/dO
        tile in flight beside the mask tiles spills at d=128; the interior loop keeps 3)."""
        return min(self.num_stages, 2)


# Portable backward. key: padded max(head_dim_qk, head_dim_v).
# The dK/dV program keeps dK and dV (2 x block_n x d fp32) in registers for its whole life, so
# the budget is registers: 64 keys per wgmma warpgroup and a narrow block_m. dQ in its own
# kernel (deterministic) beat fp32 atomics from the dK/dV kernel in every H100 sweep, so
# atomic_dq is off everywhere (tests force it on to keep that path correct).
# Provenance: scripts/bench_backward.py --sweep on an H100 80GB HBM3, bf16, B4 L4096 (H16 d128,
# H32 d64), full / causal, 2026-11-22 (steps, TFLOP/s: docs/journal/2026-11-22.md); registers from
# `solattn aot --arch 90` (triton 3.6.0): the d64/d128 dK/dV kernels sit at 255 registers with a
# few local loads/stores outside their loops ("cold"), none inside. d16, d32 and d256 are the
# register-budget choices of `solattn aot`, not timed.
_B = BwdConfig
_BWD_TABLE_SM90 = {
    16: _B(block_m=32, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2),
    32: _B(block_m=32, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2),
    64: _B(block_m=64, block_n=64, num_warps=4, num_stages=3,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=3, edge_m=32),
    128: _B(block_m=32, block_n=64, num_warps=4, num_stages=3,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=3),
    256: _B(block_m=16, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=16, dq_num_warps=8, dq_num_stages=2, split_dkdv=True),
}
# Softcap or ALiBi keep more [block_n, block_m] fp32 tiles live (tanh, distances): smaller steps.
_BWD_TABLE_SM90_SCORES = {
    16: _B(block_m=16, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2),
    32: _B(block_m=16, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2),
    64: _B(block_m=32, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2),
    128: _B(block_m=16, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2),
    256: _B(block_m=16, block_n=64, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=16, dq_num_warps=8, dq_num_stages=2, split_dkdv=True),
}

# Ampere-class and newer non-Hopper parts. mma.sync holds both operands in registers, so tiles
# are smaller than on sm_90 (dQ rows 64, d >= 64 one query step of 16, dK/dV split from d=128).
# Chosen to be spill-free in `solattn aot --arch 80` (2026-11-22); not timed on an Ampere GPU.
_BWD_TABLE_SM80 = {
    16: _B(block_m=32, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2),
    32: _B(block_m=32, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2),
    64: _B(block_m=16, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2),
    128: _B(block_m=16, block_n=128, num_warps=8, num_stages=2,
        dq_block_m=64, dq_block_n=64, dq_num_warps=8, dq_num_stages=2, split_dkdv=True),
    256: _B(block_m=16, block_n=64, num_warps=8, num_stages=1,
        dq_block_m=64, dq_block_n=16, dq_num_warps=8, dq_num_stages=2, split_dkdv=True),
}
_BWD_TABLE_SM80_SCORES = {
    16: _B(block_m=16, block_n=128, num_warps=8, num_stages=1,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=1),
    32: _B(block_m=16, block_n=128, num_warps=8, num_stages=1,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=1),
    64: _B(block_m=16, block_n=128, num_warps=8, num_stages=1,
        dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=1),
    128: _B(block_m=16, block_n=128, num_warps=8, num_stages=1,
        dq_block_m=64, dq_block_n=64, dq_num_warps=8, dq_num_stages=1, split_dkdv=True),
    256: _B(block_m=16, block_n=64, num_warps=8, num_stages=1,
        dq_block_m=64, dq_block_n=16, dq_num_warps=8, dq_num_stages=1, split_dkdv=True),
}

# The 99 KB parts: the sm_80 tiles (the rule of _FWD_TABLE_SM86). They fit: `solattn aot --arch
# 86` (triton 3.6, 2026-11-28) measures at most 82 KB (the d=256 dQ kernel, 64 x 16 in 2 stages)
# and 72 KB (the d=128 dK pass). sm_80 kernels of more than 50 KB run one block an SM on these
# parts (100 KB an SM) where sm_80 runs up to three; their registers (166-255 a thread for 8
# warps) allow one block an SM on both. Not timed on any of these GPUs.
_BWD_TABLE_SM86 = dict(_BWD_TABLE_SM80)
_BWD_TABLE_SM86_SCORES = dict(_BWD_TABLE_SM80_SCORES)

# Interpreter: tiny tiles (fast in Python, and many masked/unmasked blocks on small shapes);
# atomic dQ on, so the CPU suite covers that path by default and the dQ kernel where tests ask.
_BWD_INTERPRET = _B(block_m=16, block_n=16, num_warps=4, num_stages=1, dq_block_m=16,
                    dq_block_n=16, dq_num_warps=4, dq_num_stages=1, atomic_dq=True)


def _bwd_table(arch: int, scores: bool) -> dict:
    tables = arch_limits(arch).tables
    if tables == "sm90":
        return _BWD_TABLE_SM90_SCORES if scores else _BWD_TABLE_SM90
    if tables == "sm86":
        return _BWD_TABLE_SM86_SCORES if scores else _BWD_TABLE_SM86
    return _BWD_TABLE_SM80_SCORES if scores else _BWD_TABLE_SM80


def bwd_config(arch: int, head_dim: int, head_dim_v: int, scores: bool = False) -> BwdConfig:
    """Config of the portable backward on ``arch`` for these head dims; ``scores``: softcap or
    ALiBi is on (more live registers per step)."""
    if interpreting():
        return _BWD_INTERPRET
    d = padded_head_dim(max(head_dim, head_dim_v))
    return _bwd_table(arch, scores)[d]


def all_bwd_configs(arch: int) -> dict[tuple[int, bool], BwdConfig]:
    """Every ((padded head dim, scores) -> backward config) the dispatcher can pick on ``arch``."""
    return {(d, scores): cfg for scores in (False, True)
            for d, cfg in _bwd_table(arch, scores).items()}
