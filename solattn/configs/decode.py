"""Decode configurations (flash_attn_with_kvcache and calls of few query rows): the split-KV
kernel tiles, the combine kernel's warps and the ``num_splits`` and small-q heuristics, chosen by
pure functions of (arch, head dim, ...) as :mod:`solattn.configs.portable`'s tables are."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import triton

from solattn.arch import arch_limits
from solattn.configs.portable import padded_head_dim
from solattn.device import interpreting, triton_version


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


def combine_accepted_spill(arch: int, head_dim: int) -> str:
    """Why ``solattn aot`` may report a spill of the split-merge kernel ("" where it may not).
    Merging a one-row decode step (``dim_b`` = 1 and unit strides, constexprs at launch) at
    d=128 on sm_90 with triton 3.6: 128 registers, one 4-byte word (a row pointer's) reloaded
    each step of 4 splits, beside that step's 16 x 4 x 128 loads (`solattn aot --arch 90`,
    2026-11-28; spill-free with triton 3.9). The binary every such merge runs; the fused
    decode (one launch) merges in its own kernel. Not timed against a spill-free build."""
    if arch == 90 and padded_head_dim(head_dim) == 128 and triton_version() < (3, 9):
        return "8 B: one reload a step of 4 splits (a one-row decode step), triton 3.6"
    return ""


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
