"""Configurations of the Hopper forward (:mod:`solattn.kernels.hopper.forward`, launched by
:mod:`solattn.kernels.hopper.forward_plan`): tiles and register splits per head dim, the FP8
tables, the accepted spills, and the measured thresholds of the persistent / LPT schedules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from solattn.device import triton_version


@dataclass(frozen=True)
class HopperFwdConfig:
    """Tile and register split of :func:`~solattn.kernels.hopper.forward.attn_fwd_kernel`
    (rows per CTA = ``consumers * block_m``)."""

    block_m: int         # rows per consumer warpgroup (a wgmma accumulator covers 64)
    block_n: int         # keys per ring slot
    stages: int          # depth of the K and the V ring
    consumer_regs: int   # setmaxnreg of each consumer warpgroup
    producer_regs: int   # setmaxnreg of the TMA warp
    persistent: bool     # one CTA per SM walking the tiles, or one CTA per tile
    consumers: int = 2   # consumer warpgroups: 2 in every shipping config; 1 is the ladder's
    #                      "TMA + one consumer warpgroup" step (solattn.bench.ladder)
    lpt: int = 0         # > 0: tiles longest first within groups of heads whose K and V fit
    #                      in this many MiB of L2 (_tile_work); persistent grids snake-deal them
    dynamic: bool = False  # persistent: each CTA claims its next tile from a counter once
    #                        the current tile's loads are issued (tiles of unequal lengths
    #                        balance as with one CTA per tile), rather than walking pid,
    #                        pid + grid, ...
    o_staging: bool = False  # persistent, O in q's 16-bit dtype or the FP8 forward's bf16: O
    #                          leaves through a shared tile of its own
    #                          and a TMA store left in flight across the next tile, rather
    #                          than from registers (Q's buffer, which one-CTA-per-tile grids
    #                          stage O in, holds the next tile's Q by then); costs
    #                          2 * block_m * d_v * 2 B of shared memory


# head dim -> config. Shared memory per CTA: Q 2*64*d*2 B + (K + V) stages*block_n*d*2 B each.
# d=256 halves block_n: O (128 regs/thread) + S + P must fit the 240 registers of a consumer.
# Measured H100 SXM, bf16, 2026-11-22 (docs/hopper-forward.md): d=128 3 stages beat 2 by 1-6%
# (4k/8k: 625 vs 589 TFLOP/s), block_n 64 lost 8-12%; d=64 2 stages beat 3 (422 vs 391).
# Persistent paid at d=64 (B4 H32 L4k: 436-442 vs 409-421 one CTA per tile); at d=128/256
# it was even or 2-4% slower on long problems (register-store epilogue), and for causal far
# slower (static order). d=128 runs persistent with O staged in its own tile, two stages
# (hopper_fwd_config, _STAGED_HEAD_DIMS).
_CONFIGS = {
    64: HopperFwdConfig(block_m=64, block_n=128, stages=2, consumer_regs=240, producer_regs=24,
                         persistent=True),
    128: HopperFwdConfig(block_m=64, block_n=128, stages=3, consumer_regs=240, producer_regs=24,
                         persistent=False),
    256: HopperFwdConfig(block_m=64, block_n=64, stages=2, consumer_regs=240, producer_regs=24,
                         persistent=False),
}


# (head_dim tile, head_dim_v tile) -> config, where d_v's tile is narrower than d's. (256, 128),
# MLA's 192/128: 64-key blocks, 3 stages: Q 64 KiB + 3 x (K 32 + V 16) KiB = 208 KiB of shared
# memory (128-key blocks need 256 KiB with 2 stages); O is d=128's 64 registers, S 32.
_CONFIGS_DV = {
    (256, 128): HopperFwdConfig(block_m=64, block_n=64, stages=3, consumer_regs=240,
                                producer_regs=24, persistent=False),
}


# Triton >= 3.9 assembles sm_90 with its CUDA 13 ptxas (`ptxas-blackwell --regAllocOptLevel=2`),
# and two of the configs above spill there (`solattn aot --arch 90`, 2026-11-23): d=128 with
# softcap (48 B, 4 local loads/stores inside loops) and d=256 (32-80 B, 1-10 inside loops).
# d=128 with softcap takes 64-key blocks under 3.9: spill-free, and on the H100 (B4 H16 L4096,
# softcap 30) 370 vs 382 TFLOP/s non-causal, 328 vs 307 causal. d=256 kept its 64-key blocks
# and their spill (the spill-free 32-key blocks measured 489 vs 713 TFLOP/s, B2 H8 L4096 D256;
# causal 403 vs 541) until Q's wgmma descriptors were rebuilt on each key block
# (kernels.hopper.pipeline.step_view, 2026-11-29): every forward build now compiles
# spill-free under 3.9 (`solattn aot`), so no spill is accepted (accepted_spill).
_TRITON_39_SOFTCAP_BLOCK_N = {128: 64}
# With dropout the consumers also run the Philox draws of the keep mask
# (solattn.kernels.hopper.dropout), and the default key blocks spill (`solattn aot --arch 90`,
# 2026-11-28, triton 3.6): d=64 with 128 keys 8 B (8 local accesses in the loops, varlen), d=128
# with 128 keys 48-88 B (8-26 in the loops), d=128 with 64 keys and a left band bound 8 B
# outside the loops. These widths compile spill-free under 3.6 and 3.9. d=256 keeps its 64 keys
# (since step_view, 2026-11-29; before it the 32-key builds spilled in the loops under 3.9):
# spill-free under 3.9; under 3.6 the builds with a band bounded on both sides or varlen keep a
# few values outside the loops (_ACCEPTED_SPILL_36). With ALiBi the 3.9 varlen build spilled in
# a loop (16 B, 1 access): dropout with ALiBi at d=256 runs the portable forward
# (forward_plan.covers).
_DROPOUT_BLOCK_N = {64: 64, 128: 64, 256: 64}
_DROPOUT_LEFT_BLOCK_N = {128: 32}
DROPOUT_HEAD_DIMS = tuple(_DROPOUT_BLOCK_N)
_DROPOUT_256_COLD = ("dropout at d=256, triton 3.6: {} bytes in local memory outside the key "
                     "loops (a few accesses a tile, none in a loop; spill-free with triton "
                     "3.9); not timed (the plain and causal builds, spill-free: 2.5-2.7x the "
                     "portable kernel)")
_CLAIMED_LPT_128_COLD = (
    "d=128 causal, claimed tiles with O staged, longest first (in head groups from 2049 to 8192 "
    "keys, over all heads when the tiles are few: hopper_fwd_config, lpt_all_heads), triton "
    "3.6: {} bytes in local memory outside the key loops (none in a loop; spill-free with "
    "triton 3.9); timed with it, H200: -1% to +5% over one CTA a tile "
    "(docs/runs/2026-11-29-h200-s33.txt sections 11, 13)")
_ACCEPTED_SPILL_36 = {  # (head dim, AOT variant) -> why (`solattn aot --arch 90`, 2026-11-29)
    (256, "dropout-window"): _DROPOUT_256_COLD.format(40),
    (256, "dropout-window-softcap"): _DROPOUT_256_COLD.format(16),
    (256, "dropout-varlen-causal"): _DROPOUT_256_COLD.format(8),
    (128, "mid-causal"): _CLAIMED_LPT_128_COLD.format(16),
    (128, "few-causal"): _CLAIMED_LPT_128_COLD.format(16),
}
_TRITON_39_ACCEPTED_SPILL: dict[int, str] = {}  # head dim -> why its spill is accepted (above)


# FP8 (e4m3) head dim -> config. The 8-bit tiles take half the shared memory of the 16-bit ones,
# so the K/V ring is deeper; O gets its own bf16 staging tile for the TMA store. Registers per
# consumer thread as for 16-bit (S and O in fp32), P takes half (4 e4m3 per register).
_FP8_CONFIGS = {
    64: HopperFwdConfig(block_m=64, block_n=128, stages=4, consumer_regs=240, producer_regs=24,
                         persistent=False),
    128: HopperFwdConfig(block_m=64, block_n=128, stages=4, consumer_regs=240, producer_regs=24,
                          persistent=False),
    256: HopperFwdConfig(block_m=64, block_n=64, stages=3, consumer_regs=240, producer_regs=24,
                          persistent=False),
}

# The FP8 forward runs a static persistent grid with O (bf16) staged in its own tile, its TMA
# store in flight across the next tile (o_staging), except varlen (one CTA a tile) and causal
# problems of more than _FP8_STAGED_CAUSAL_MAX_KEYS keys, which claim their tiles longest first
# in head groups of _STAGED_LPT_MIB MiB of K and V, as the 16-bit d=128 forward's middle lengths
# (the static grid deals tile t to CTA t mod grid, which at 16k keys left the bf16 d=128 causal
# forward 21% behind, docs/runs/2026-11-29-h200-s33.txt section 6); at d=256 those stay one CTA
# a tile (the claimed build keeps 16 bytes outside its loops under Triton 3.6; not timed).
# H200, TFLOP/s, 7 interleaved rounds (the runs' section 7), one CTA a tile -> staged: d=128 B4
# H16 L4k 732 -> 744, causal 596 -> 655, B1 H8 Lq4k Lk8k 745 -> 754, B1 Hq32 Hkv8 L8k causal 695
# -> 726; d=64 B4 H32 L4k 432 -> 448, causal 366 -> 395; d=256 B2 H8 L4k 899 -> 917, causal 677
# -> 702. The persistent grid with O stored from registers lost (`solattn bench --suite fp8`,
# section 2: 708 vs 746 at d=128). Long causal, one CTA a tile -> claimed (16 MiB groups;
# docs/runs/2026-11-29-h200-s34.txt section 2): d=64 B1 H32 L16k 452 -> 467, B2 H16 L16k 454 ->
# 468 (rounds within 1%); d=128 B1 H16 L16k 748 -> 749, B1 Hq32 Hkv8 L16k 750 -> 754, B2 H16
# L12k 714 -> 719, B1 H16 L32k 762 -> 766 (even; 8 and 32 MiB groups the same within 1-2%).
_FP8_STAGED_CAUSAL_MAX_KEYS = 8192

# Head dims whose FP8 kernel takes neither softcap nor a left window bound (HAS_LOWER): at d=256
# those builds spill (8 bytes outside the loops, `solattn aot --arch 90`, triton 3.6,
# 2026-11-23); with triton >= 3.9 the d=128 window builds spill in their loops too (40 bytes,
# 10-18 local accesses in loops, `solattn aot`, 2026-11-23). Not measured.
_FP8_BAND_ONLY = {(3, 6): (256,), (3, 9): (128, 256)}


def fp8_band_only_head_dims() -> tuple[int, ...]:
    """The head dims of :data:`_FP8_BAND_ONLY` for the installed Triton."""
    return _FP8_BAND_ONLY[(3, 9) if triton_version() >= (3, 9) else (3, 6)]


FP8_DTYPE = torch.float8_e4m3fn
FP8_OUT_DTYPE = torch.bfloat16
# The FP8 kernel's P V reads V transposed with its keys permuted within groups of this many
# (_p_operand, fp8_v_operand).
_FP8_KEY_GROUP = 32


# Causal problems of few tiles run them longest first over all heads (HopperFwdConfig.lpt with
# a budget no problem reaches: one group) rather than head by head. H100, bf16, one CTA per tile,
# same process (scripts/hopper_variants.py bench-few, 2026-11-23), TFLOP/s head-major -> LPT:
# B2 H8 L4k D256 543 -> 592 (and 536 -> 582, 541 -> 587 in two more runs), B1 H8 L8k D128
# 523 -> 569, B2 H8 L4k D128 459 -> 516, B4 H4 L4k D128 456 -> 513, B1 H8 L8k D64 330 -> 382,
# B1 Hq16 Hkv4 L8k D128 550 -> 570: with at most ~4 tiles per SM the head-major order's tail
# (the last head's long tiles start late) costs up to 14%. So do problems of more tiles whose
# K and V, all heads together, stay in L2 while every head's longest tiles run at once (<= 32
# MiB; bench-l2, 2026-11-26, H100): B1 Hq32 Hkv4 L4k D64 326 -> 351 (the 1.1B Llama layer, 4
# MiB), B1 H32 L4k D64 325 -> 345, B1 Hq32 Hkv8 L4k D128 516 -> 540, B1 Hq64 Hkv8 L4k D128
# 528 -> 536, B4 Hq32 Hkv4 L4k D64 363 -> 364, B2 Hq32 Hkv4 L8k D64 396 -> 400, B1 Hq32 Hkv8
# L8k D128 (32 MiB) 574 -> 572. Not taken: more K/V (B4 H16 L4k D128, 128 MiB, 2048 tiles:
# 521 -> 446; B8 H16 L2k D256: 508 -> 321: every head's K/V streams through L2 at once) or one
# head's K + V over 8 MiB (B1 H4 L16k D256, 16 MiB: 692 -> 667).
LPT_ALL_HEADS = 4096
_LPT_MAX_TILES_PER_SM = 4
_LPT_MAX_HEAD_KV_BYTES = 8 * 2**20
_LPT_MAX_KV_BYTES = 32 * 2**20


def lpt_all_heads(causal: bool, num_tiles: int, sms: int, seqlen_k: int, head_dim: int,
                  kv_heads: int) -> bool:
    """Whether a 16-bit problem runs its tiles longest first over all heads (see above);
    ``kv_heads`` counts the (batch, KV head) pairs, whose K and V are read."""
    head_bytes = 4 * seqlen_k * head_dim  # K + V of one KV head, 16-bit
    return (causal and head_bytes <= _LPT_MAX_HEAD_KV_BYTES
            and (num_tiles <= _LPT_MAX_TILES_PER_SM * sms
                 or kv_heads * head_bytes <= _LPT_MAX_KV_BYTES))


def accepted_spill(head_dim: int, variant: str = "") -> str:
    """Why this head dim's build of AOT variant ``variant`` may spill with the installed Triton
    ("" where it may not)."""
    if triton_version() >= (3, 9):
        return _TRITON_39_ACCEPTED_SPILL.get(head_dim, "")
    return _ACCEPTED_SPILL_36.get((head_dim, variant), "")


# Which problems run persistent, and which of those claim their tiles dynamically
# (HopperFwdConfig.dynamic). H100, bf16, TFLOP/s, same process, 3 passes each (2026-11-26).
#
# d=128 tiles with dropout (the others: _STAGED_HEAD_DIMS below) that see at most this many
# keys (or a band bounded on both sides, e.g. a causal sliding window) walk a static persistent
# schedule, O stored from registers: the CTA's producer loads the next tile's Q and first K/V
# during this tile's tail (measured when every d=128 problem took this rule, without dropout;
# scripts/bench_schedules.py, persistent vs one CTA per tile): B32 H16 L512 401-405 vs
# 381-383, B16 H16 L1k 481-486 vs 473-476, B8 H16 L2k 537-542 vs 529-536, window (1024, 1024)
# at L4k 474-483 vs 462-475, causal window 1024 at L16k 387-394 vs 383-385 (at L4k even), d=64
# causal window 1024 265 vs 256; on longer full tiles even or behind (B4 H16 L4k 564 vs
# 562-568, B1 H8 Lq4k Lk8k 598-607 vs 605-609).
_PERSISTENT_MAX_KEYS = 2048
# Tiles of unequal lengths (varlen: one sequence each; causal: the last query blocks see the
# most keys) unbalance a static schedule; claimed dynamically they balance as with one CTA per
# tile and keep the prefetch (scripts/bench_schedules.py, dynamic vs the previous default,
# one CTA per tile unless noted). Varlen, d=128: 64 documents of 256 causal 122 vs 108, full
# 246 vs 212; 16 of 1024 causal 321 vs 298; 40 of 64-1024 causal 214 vs 194, full 314 vs 272; 12 of
# 256-4096 causal 438 vs 422, full 504-513 vs 487-495. d=64: 256 causal 89 vs 77, full 211
# vs 214 (static persistent, the previous default); 1024 causal 224 vs 198; 40 of 64-1024
# causal 154 vs 134, full 252 vs 235 (static); 12 of 256-4096 causal 317 vs 283, full 375-384
# vs 352-367 (static). Causal d=64 up to this many keys: B64 H32 L256 87 vs 81, B16 H32 L1k
# 222 vs 207, B4 H32 L4k 357-365 vs 352-360, B1 Hq32 Hkv4 L4k (longest first) 358-361 vs 350;
# at L16k 408-410 vs 411-414. Causal d=128 stays one CTA per tile (dynamic: B64 H16 L256 123
# vs 124, B16 H16 L1k 321 vs 329, B4 H16 L4k 492 vs 512, B1 H16 L16k 557 vs 605).
_DYNAMIC_CAUSAL_MAX_KEYS = {64: 4096}
_DYNAMIC_VARLEN_HEAD_DIMS = (64, 128)
# d=128 without dropout: equal tiles (no band, or one bounded on both sides) run persistent with
# O staged in its own shared tile (HopperFwdConfig.o_staging, two stages to make room), and
# causal problems of at most _STAGED_CAUSAL_MAX_KEYS keys claim their tiles that way. H200,
# bf16, TFLOP/s, 7 interleaved rounds (docs/runs/2026-11-29-h200-s32.txt section 4;
# docs/hopper-forward.md "O staged at d=128"), default -> staged: B16 H16 L1k 498 -> 539, B8
# H16 L2k 549 -> 581, B4 H16 L4k 590 -> 614, B2 H16 L8k 601 -> 614, B1 H8 Lq4k Lk8k 626 -> 631,
# B1 H16 L16k 615 -> 617, B8 H8 Lq1k Lk4k 573 -> 593; causal B16 H16 L1k 334 -> 349, B8 H16 L2k
# 436 -> 458, at L4k 516 -> 520, L8k 559 -> 557, L16k 605 -> 580 (the claimed grid loses on
# long causal problems, not profiled: those keep one CTA a tile), Lq4k Lk8k 407 -> 342 and
# Lq1k Lk4k 279 -> 313 (few tiles: the default ran them longest first over all heads,
# lpt_all_heads, the staged variant head by head). Not with Triton 3.9 and softcap
# (hopper_fwd_config).
_STAGED_HEAD_DIMS = (128,)
_STAGED_STAGES = 2
_STAGED_CAUSAL_MAX_KEYS = 2048
# Causal d=128 problems of more keys, up to _STAGED_LPT_CAUSAL_MAX_KEYS, claim their staged tiles
# longest first within groups of heads whose K and V fit in _STAGED_LPT_MIB of L2
# (HopperFwdConfig.lpt). H200, bf16, TFLOP/s, 7 interleaved rounds
# (docs/runs/2026-11-29-h200-s33.txt section 6), one CTA a tile -> claimed staged longest first
# in 16 MiB groups: B4 H16 L4k 519 -> 539, B2 H16 L8k 565 -> 579, B2 Hq32 Hkv8 L4k 529 -> 550,
# B1 Hq32 Hkv8 L8k 583 -> 589; at L16k 612 -> 603, which keeps one CTA a tile. Claimed in head
# order: 532, 567, 536, 573 (and 584 at L16k); in 8 MiB groups 537, 561, 540, 588. The static
# staged grid read 551, 577, 551, 588, but 480 at L16k: it deals tile t to CTA t mod 132, which
# spreads the query blocks evenly only when they divide the grid's stride well.
_STAGED_LPT_CAUSAL_MAX_KEYS = 8192
_STAGED_LPT_MIB = 16
# With Triton >= 3.9 the staged build loses on problems of few equal tiles, so those store O
# from registers (few_tiles_config): persistent, the staged config's two stages. H200, bf16,
# d=128 without a band, TFLOP/s, do_bench best of 2, twice, staged -> O from registers
# (docs/runs/2026-11-30-h200-s35.txt section 5f): Triton 3.9, 128 tiles (B1 H4 Lq4k Lk16k) 533
# -> 637/634, 256 tiles (B1 H8 Lq4k Lk4k) 564/561 -> 597/596, (Lq4k Lk8k) 602/607 -> 624/620,
# (B1 H16 Lq2k Lk16k) 588 -> 621/622, 512 tiles (B1 H8 L8k) 603/609 -> 610/611, 1024 tiles (B2
# H16 Lq4k Lk8k) 629/628 -> 617/624; Triton 3.6, the same six: 641/632/640/642/633/640 staged
# against 627/586/616/624/614/624 from registers (staged wins at every size there, as at 2048
# tiles under both: B4 H16 L4k 621 vs 600 with 3.9, 627 vs 604 with 3.6, section 5e). ncu at
# base clocks, Lq4k Lk8k staged: 288.7 us with 3.6, 299.5 us with 3.9 (same instruction
# count); why the 3.9 build loses more at free clocks and on few tiles is not profiled.
# Banded and causal problems keep their schedules (not measured this way). Decision 050.
_UNSTAGED_39_MAX_TILES_PER_SM = 4


def few_tiles_config(cfg: HopperFwdConfig, banded: bool, tiles_per_sm: float) -> HopperFwdConfig:
    """``cfg``, or (Triton >= 3.9, a 16-bit problem without a band on a static staged grid of
    at most :data:`_UNSTAGED_39_MAX_TILES_PER_SM` tiles per SM) ``cfg`` with O stored from
    registers (see above)."""
    if (triton_version() >= (3, 9) and cfg.persistent and cfg.o_staging and not cfg.dynamic
            and not banded and tiles_per_sm <= _UNSTAGED_39_MAX_TILES_PER_SM):
        return dataclasses.replace(cfg, o_staging=False)
    return cfg


def fwd_tile_config(head_dim: int) -> HopperFwdConfig:
    """The tiles, ring and registers at ``head_dim`` before any schedule is picked (one CTA per
    tile, O staged in Q's buffer): the base the flex forward sizes its ring from."""
    return _CONFIGS[head_dim]


def hopper_fwd_config(head_dim: int, has_upper: bool, has_softcap: bool = False,
                      fp8: bool = False, head_dim_v: int | None = None, *,
                      has_lower: bool = False, varlen: bool = False,
                      seqlen_k: int | None = None, dropout: bool = False) -> HopperFwdConfig:
    """Config for the tile width ``head_dim`` (``head_dim_v``: V's, when narrower; and 8-bit
    inputs with ``fp8``) with the installed Triton, for a problem of ``seqlen_k`` keys (None:
    long). The schedule (the measurements above): varlen at d=64/128 and short causal at d=64
    claim tiles dynamically; other tiles of unequal lengths (banded above but not below:
    causal) run one CTA per tile, where the hardware block scheduler balances them (longest
    first; the static persistent schedule did not: B1 H16 L16k causal 430 vs 596 TFLOP/s);
    d=64 and short or banded d=128 problems walk a static persistent schedule; at d=128 without
    dropout (nor softcap under Triton 3.9), equal tiles and causal problems of at most 8192 keys
    stage O in its own shared tile (``o_staging``, two stages), the causal ones claiming their
    tiles (longest first in head groups from 2049 keys). FP8: a static persistent grid with O
    staged, but one CTA per tile for varlen, and causal problems of more than 8192 keys claiming
    their tiles longest first in head groups (one CTA per tile at d=256).
    ``dropout`` (tiles of :data:`DROPOUT_HEAD_DIMS`): the narrower key blocks of
    :data:`_DROPOUT_BLOCK_N`."""
    if fp8:
        cfg = _FP8_CONFIGS[head_dim]
        long_causal = has_upper and not has_lower and (
            seqlen_k is None or seqlen_k > _FP8_STAGED_CAUSAL_MAX_KEYS)
        if varlen:
            return cfg
        staged = dataclasses.replace(cfg, persistent=True, o_staging=True)
        if long_causal:
            if head_dim == 256:
                return cfg
            return dataclasses.replace(staged, dynamic=True, lpt=_STAGED_LPT_MIB)
        return staged
    if head_dim_v is not None and head_dim_v != head_dim:
        cfg = _CONFIGS_DV[(head_dim, head_dim_v)]
    else:
        cfg = _CONFIGS[head_dim]
    if triton_version() >= (3, 9) and has_softcap and head_dim in _TRITON_39_SOFTCAP_BLOCK_N:
        cfg = dataclasses.replace(cfg, block_n=_TRITON_39_SOFTCAP_BLOCK_N[head_dim])
    if dropout:
        width = (_DROPOUT_LEFT_BLOCK_N if has_lower else {}).get(
            head_dim, _DROPOUT_BLOCK_N.get(head_dim, cfg.block_n))
        cfg = dataclasses.replace(cfg, block_n=min(cfg.block_n, width))
    dynamic = dataclasses.replace(cfg, persistent=True, dynamic=True)
    causal_keys = _DYNAMIC_CAUSAL_MAX_KEYS.get(head_dim, 0)
    if varlen:
        return dynamic if head_dim in _DYNAMIC_VARLEN_HEAD_DIMS and head_dim_v in (
            None, head_dim) else dataclasses.replace(cfg, persistent=False)
    staged = None
    # (Triton 3.9's softcap builds run 64-key blocks, _TRITON_39_SOFTCAP_BLOCK_N; staged, the
    # ALiBi + window + softcap one spilled 56 bytes, 3 accesses in its key loops: `solattn aot`,
    # 2026-11-29. They keep the register epilogue.)
    softcap_39 = has_softcap and triton_version() >= (3, 9)
    if (head_dim in _STAGED_HEAD_DIMS and head_dim_v in (None, head_dim) and not dropout
            and not softcap_39):
        staged = dataclasses.replace(cfg, persistent=True, o_staging=True,
                                     stages=_STAGED_STAGES)
    if has_upper and not has_lower:  # tiles of unequal lengths
        if staged is not None and seqlen_k is not None:
            if seqlen_k <= _STAGED_CAUSAL_MAX_KEYS:
                return dataclasses.replace(staged, dynamic=True)
            if seqlen_k <= _STAGED_LPT_CAUSAL_MAX_KEYS:
                return dataclasses.replace(staged, dynamic=True, lpt=_STAGED_LPT_MIB)
        if seqlen_k is not None and seqlen_k <= causal_keys and head_dim_v in (None, head_dim):
            return dynamic
        return dataclasses.replace(cfg, persistent=False)
    if staged is not None:
        return staged
    if head_dim == 128 and (
            has_lower or (seqlen_k is not None and seqlen_k <= _PERSISTENT_MAX_KEYS)):
        return dataclasses.replace(cfg, persistent=True)
    return cfg
