"""Kernel configurations: frozen dataclasses chosen by pure functions of (arch, head dim, ...).

Every entry says where its numbers came from. Autotuning is not used on the default path: a call
must start fast and behave the same on every run. ``solattn bench --sweep`` (see ``bench/``)
re-measures candidate tables on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class FwdConfig:
    """Tile shape and launch parameters of the portable forward kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def interpreting() -> bool:
    """True when Triton's CPU interpreter runs kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def padded_head_dim(d: int) -> int:
    """Head dims are padded to a power of two inside the kernel (tl.arange needs one); >= 16."""
    return max(16, triton.next_power_of_2(d))


# Portable forward. key: (padded max(head_dim, head_dim_v), upper-banded (causal / right window))
# -> (block_m, block_n, num_warps, num_stages).
# sm_90 provenance: H100 80GB HBM3, triton 3.6.0, bf16, 2026-11-22, scripts/sweep_portable.py
# (TFLOP/s in BENCHMARKS.md), restricted to tiles that `solattn aot --arch 90` compiles without
# local-memory spills. d=128: 128x128 tiles gave 505 vs 472 TFLOP/s (B4 H16 L4096) non-causal,
# but spill 8 bytes with the causal mask, where 128x64 is as fast (412 vs 409). d=64: 128x64 with
# 8 warps 422 vs 413 with 4. d=256: the fastest tile measured (64x32, 4 warps, 386) spills, so
# the 8-warp one that does not.
_FWD_TABLE_SM90 = {
    (16, False): (128, 64, 4, 3), (16, True): (128, 64, 4, 3),
    (32, False): (128, 64, 4, 3), (32, True): (128, 64, 4, 3),
    (64, False): (128, 64, 8, 3), (64, True): (128, 64, 8, 3),
    (128, False): (128, 128, 8, 3), (128, True): (128, 64, 8, 3),
    (256, False): (64, 32, 8, 3), (256, True): (64, 32, 8, 3),
}

# Ampere-class (sm_80/86/89) and newer non-Hopper parts: mma.sync keeps both operands in
# registers, so d >= 128 needs narrower key blocks than Hopper's wgmma. Chosen as the largest
# tiles that compile without spills for sm_80 (`solattn aot --arch 80`, 2026-11-22; d=128 with
# 128x64 tiles, d=256 with 64x64 tiles and d=64 with 4 warps spill); not timed on an Ampere GPU
# (none is lent here).
_FWD_TABLE_SM80 = {
    (16, False): (128, 64, 4, 3), (16, True): (128, 64, 4, 3),
    (32, False): (128, 64, 4, 3), (32, True): (128, 64, 4, 3),
    (64, False): (128, 64, 8, 3), (64, True): (128, 64, 8, 3),
    (128, False): (128, 32, 8, 2), (128, True): (128, 32, 8, 2),
    (256, False): (64, 32, 8, 2), (256, True): (64, 32, 8, 2),
}

# Triton's interpreter runs every program instance in Python: small tiles keep tests fast, and
# 16 still exercises ragged tails, multi-block loops and the masked/unmasked split.
_FWD_INTERPRET = FwdConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def fwd_config(arch: int, head_dim: int, head_dim_v: int, upper_banded: bool) -> FwdConfig:
    """Config of the portable forward for compute capability ``arch`` (e.g. 90), head dims, and
    whether the mask has an upper edge (causal or a right window: a masked diagonal block)."""
    if interpreting():
        return _FWD_INTERPRET
    d = padded_head_dim(max(head_dim, head_dim_v))
    table = _FWD_TABLE_SM90 if arch == 90 else _FWD_TABLE_SM80
    return FwdConfig(*table[(d, bool(upper_banded))])


def all_fwd_configs(arch: int) -> dict[tuple[int, bool], FwdConfig]:
    """Every ((padded head dim, upper-banded) -> config) the dispatcher can pick on ``arch``."""
    table = _FWD_TABLE_SM90 if arch == 90 else _FWD_TABLE_SM80
    return {key: FwdConfig(*cfg) for key, cfg in table.items()}


# --------------------------------------------------------------------------------------------
# Decode (flash_attn_with_kvcache): split-KV kernel tiles and the num_splits heuristic.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch parameters of the split-KV decode kernel (kernels/triton/decode.py).

    ``block_m`` rows are (query, head-of-the-GQA-group) pairs packed together so that each K/V
    tile is read once per kv head; ``block_n`` keys per step, ``num_stages`` tiles in flight.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# key: padded max(head_dim, head_dim_v) -> ((block_n, num_warps, num_stages) for block_m = 16,
#                                           (block_n, num_warps, num_stages) for block_m >= 32).
# Provenance (d=128, block_m 16): H100 80GB HBM3, triton 3.6.0, bf16, s_q=1,
# scripts/bench_decode.py --sweep on 2026-11-22 (K+V GB/s, CUDA-graph medians; two runs agree
# within 3% on every config, e.g. bn32 st3 3033/3035 and 3089/3088):
#                      B64 Hq32 Hkv8 L4096   B8 Hq32 Hkv8 L32768 (4 splits)
#   bn32  w4 st2            3097                  2643
#   bn32  w4 st3            3033                  3089      <- chosen: best on both shapes
#   bn64  w4 st3            2842                  3003
#   bn64  w4 st4            3015                  2990
#   bn128 w4 st2            3043                  3007
#   (pure-read ceiling x.sum(): 3028 GB/s; copy 2436 GB/s read+write; cuDNN SDPA 3052)
# Paged page 16 with bn32 st3: 2961 / 2917. A decode step is bandwidth-bound: the tile only has
# to keep bytes in flight; 32-key tiles finish the ragged tail sooner and leave more CTAs per SM.
# block_m >= 32 (s_q * group > 16, e.g. speculative s_q=8 at group 4): 32-key tiles lost 30%
# (B64 L4096 s_q=8: 0.460 ms = 2334 GB/s with bn32 st3, 0.361 ms = 2977 GB/s with bn64 st3; B8
# L32768 s_q=8: 3007 vs 2934), so wider query tiles keep 64-key tiles (same runs, 2026-11-22).
# Other head dims: not swept; scaled from the d=128 choice by the shared-memory budget.
_DECODE_TABLE_SM90 = {
    16: ((64, 4, 3), (64, 4, 3)),
    32: ((64, 4, 3), (64, 4, 3)),
    64: ((64, 4, 3), (64, 4, 3)),
    128: ((32, 4, 3), (64, 4, 3)),
    256: ((32, 4, 2), (32, 4, 2)),
}

# Ampere-class parts: less shared memory (99-163 KB), one stage less. Not timed (no Ampere GPU
# is lent here); checked spill-free by `solattn aot --arch 80`.
_DECODE_TABLE_SM80 = {
    16: ((64, 4, 2), (64, 4, 2)),
    32: ((64, 4, 2), (64, 4, 2)),
    64: ((64, 4, 2), (64, 4, 2)),
    128: ((32, 4, 2), (64, 4, 2)),
    256: ((32, 4, 2), (32, 4, 2)),
}

# The interpreter: tiny tiles so CPU tests cover multi-block splits, ragged tails and pages
# larger and smaller than a key block.
_DECODE_INTERPRET = (16, 4, 1)


def decode_block_m(rows: int) -> int:
    """Packed rows per program: ``seqlen_q * group_size`` rounded up to a power of two, in
    [16, 64] (16 is the smallest ``tl.dot``; 64 keeps the fp32 accumulator in registers)."""
    return min(64, max(16, triton.next_power_of_2(max(rows, 1))))


def decode_config(arch: int, head_dim: int, head_dim_v: int, rows: int) -> DecodeConfig:
    """Config of the decode kernel on ``arch`` for packed ``rows = seqlen_q * (h_q // h_kv)``."""
    block_m = decode_block_m(rows)
    if interpreting():
        return DecodeConfig(block_m, *_DECODE_INTERPRET)
    d = padded_head_dim(max(head_dim, head_dim_v))
    table = _DECODE_TABLE_SM90 if arch == 90 else _DECODE_TABLE_SM80
    return DecodeConfig(block_m, *table[d][block_m > 16])


def all_decode_configs(arch: int) -> dict[tuple[int, int], DecodeConfig]:
    """((padded head dim, block_m) -> config) for ``solattn aot``: block_m 16 (decode) and 64
    (speculative / chunked prefill, the widest packed tile)."""
    table = _DECODE_TABLE_SM90 if arch == 90 else _DECODE_TABLE_SM80
    return {(d, bm): DecodeConfig(bm, *cfgs[bm > 16])
            for d, cfgs in table.items() for bm in (16, 64)}


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


@dataclass(frozen=True)
class BwdConfig:
    """Tiles and launch parameters of the portable backward.

    ``block_n`` keys per dK/dV program, walking ``block_m`` queries per step; the dQ kernel (used
    when dQ is not accumulated with atomics: ``deterministic=True`` or ``atomic_dq=False``) holds
    ``dq_block_m`` query rows and walks ``dq_block_n`` keys per step.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dq_block_m: int
    dq_block_n: int
    dq_num_warps: int
    dq_num_stages: int
    atomic_dq: bool
    split_dkdv: bool = False  # dK and dV in two launches (large head dims: registers)
    edge_m: int = 16  # query step of the masked edge blocks (see edge_block_m)

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


# Portable backward. key: padded max(head_dim_qk, head_dim_v) ->
# (block_m, block_n, warps, stages, dq_block_m, dq_block_n, dq_warps, dq_stages, atomic_dq
#  [, split_dkdv [, edge_m]]).
# The dK/dV program keeps dK and dV (2 x block_n x d fp32) in registers for its whole life, so
# the budget is registers: 64 keys per wgmma warpgroup (128 keys on 8 warps, or 64 on 4; 64 keys
# on 8 warps would compute the S^T tile twice, once per warpgroup) and a narrow block_m.
# dQ: its own kernel (deterministic) beat fp32 atomics from the dK/dV kernel in every H100 sweep
# (d128: 287 vs 225 TFLOP/s, d64: 294 vs 258), so atomic_dq is off everywhere.
# Provenance: scripts/bench_backward.py --sweep on an H100 80GB HBM3, bf16, B4 L4096 (H16 d128,
# H32 d64), full / causal, three runs of 2026-11-22 (session 2); registers from `solattn aot --arch
# 90` (triton 3.6.0). Three loads in flight (num_stages 3) instead of two moved both kernels most.
# The d128 and d64 dK/dV kernels sit at 255 registers with a few local loads/stores *outside*
# their loops (`solattn aot`: "cold", none inside a loop).
_BWD_TABLE_SM90 = {
    16: (32, 128, 8, 2, 128, 64, 8, 2, False),
    32: (32, 128, 8, 2, 128, 64, 8, 2, False),
    # d64: 352 / 306 with 64 keys per program on 4 warps. Before: (64,128,8,1 | 128,64,8,2, edge
    # 16) 292 / 213; 128 keys on 8 warps, 3 stages: 319 / 292 (2 stages: 313 / 272); edge 32 and
    # 64 alone: - / 222, 224; dQ (64,64,4,2): 288 / 258; dQ 4 stages: 313 / 275; 64 keys with
    # 128 or 32 queries per step: 242 / 247, 344 / -; 4 stages: 349 / 310 (edge 64).
    64: (64, 64, 4, 3, 128, 64, 8, 3, False, False, 32),
    # d128: 367 / 327 with 64 keys per program on one warpgroup (4 warps). Before: (32,128,8,2 |
    # 128,64,8,2) 301 / 271; 128 keys on 8 warps, 3 stages: 367 / 305 (dK/dV 3 stages alone: 344
    # / -; dQ 3 stages alone: 318 / 293); dQ 4 stages: 365 / 303; edge 32: - / 309. 64 queries
    # per step on 4 warps: 370 / 341, but spills inside its loops.
    128: (32, 64, 4, 3, 128, 64, 8, 3, False),
    # d16, d32, d256 are the register-budget choices of `solattn aot`, not timed.
    256: (16, 128, 8, 2, 128, 16, 8, 2, False, True),
}
# Softcap or ALiBi keep more [block_n, block_m] fp32 tiles live (tanh, distances): smaller steps.
_BWD_TABLE_SM90_SCORES = {
    16: (16, 128, 8, 2, 128, 64, 8, 2, False),
    32: (16, 128, 8, 2, 128, 64, 8, 2, False),
    64: (32, 128, 8, 2, 128, 64, 8, 2, False),
    128: (16, 128, 8, 2, 128, 64, 8, 2, False),
    256: (16, 64, 8, 2, 128, 16, 8, 2, False, True),
}

# Ampere-class and newer non-Hopper parts. mma.sync holds both operands in registers, so tiles
# are smaller than on sm_90 (dQ rows 64, d >= 64 one query step of 16, dK/dV split from d=128).
# Chosen to be spill-free in `solattn aot --arch 80` (2026-11-22); not timed on an Ampere GPU.
_BWD_TABLE_SM80 = {
    16: (32, 128, 8, 2, 128, 64, 8, 2, False),
    32: (32, 128, 8, 2, 128, 64, 8, 2, False),
    64: (16, 128, 8, 2, 128, 64, 8, 2, False),
    128: (16, 128, 8, 2, 64, 64, 8, 2, False, True),
    256: (16, 64, 8, 1, 64, 16, 8, 2, False, True),
}
_BWD_TABLE_SM80_SCORES = {
    16: (16, 128, 8, 1, 128, 64, 8, 1, False),
    32: (16, 128, 8, 1, 128, 64, 8, 1, False),
    64: (16, 128, 8, 1, 128, 64, 8, 1, False),
    128: (16, 128, 8, 1, 64, 64, 8, 1, False, True),
    256: (16, 64, 8, 1, 64, 16, 8, 1, False, True),
}

# Interpreter: tiny tiles (fast in Python, and many masked/unmasked blocks on small shapes).
_BWD_INTERPRET = BwdConfig(16, 16, 4, 1, 16, 16, 4, 1, True)


def _bwd_table(arch: int, scores: bool) -> dict:
    if arch == 90:
        return _BWD_TABLE_SM90_SCORES if scores else _BWD_TABLE_SM90
    return _BWD_TABLE_SM80_SCORES if scores else _BWD_TABLE_SM80


def bwd_config(arch: int, head_dim: int, head_dim_v: int, scores: bool = False) -> BwdConfig:
    """Config of the portable backward on ``arch`` for these head dims; ``scores``: softcap or
    ALiBi is on (more live registers per step)."""
    if interpreting():
        return _BWD_INTERPRET
    d = padded_head_dim(max(head_dim, head_dim_v))
    return BwdConfig(*_bwd_table(arch, scores)[d])


def all_bwd_configs(arch: int) -> dict[tuple[int, bool], BwdConfig]:
    """Every ((padded head dim, scores) -> backward config) the dispatcher can pick on ``arch``."""
    return {(d, scores): BwdConfig(*cfg) for scores in (False, True)
            for d, cfg in _bwd_table(arch, scores).items()}
