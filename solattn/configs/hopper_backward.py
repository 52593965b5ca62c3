"""Configurations of the Hopper backward (:mod:`solattn.kernels.hopper.backward`, launched by
:mod:`solattn.kernels.hopper.backward_plan`): tiles and register splits per head dim, the
accepted spills, and the measured rules of the grid (GQA head splits, longest-first order,
staggered query blocks)."""

from __future__ import annotations

from dataclasses import dataclass

from solattn.device import triton_version


@dataclass(frozen=True)
class HopperBwdConfig:
    """Tiles and register split of :func:`~solattn.kernels.hopper.backward.attn_bwd_kernel`."""

    block_m: int         # queries per step (Q, dO ring tile; columns of S^T)
    block_n: int         # keys per CTA: 64 per consumer warpgroup (a wgmma accumulator's rows)
    stages: int          # depth of the Q / dO ring
    lookahead: int       # next step's products issued before this step's dQ atomics (0-2)
    dq_writer: bool      # dQ atomics by a separate warp from shared memory, or by the consumers
    producer_regs: int   # setmaxnreg of the TMA warp (the consumers get what it leaves)
    dk_from_regs: bool = False   # dK += dS^T Q with dS^T from registers, before the dS^T store
    dq_pad: bool = False         # dQ staging rows padded by 32 bytes (else swizzled)
    # (not dq_pad) The swizzled dQ staging: dq_vec fp32 elements stay together (2: 8-byte
    # groups, 8: 32-byte chunks), permuted with a period of writer_rows rows, which is also
    # the rows the writer warp loads at a time (a slice may not split the period). 2 x 2 leaves
    # the 8 rows of one accumulator store on one bank group; 8 x 4 puts them on 4 (2
    # wavefronts, as dq_pad). writer_rows 4 at d=128 spilled the writer.
    dq_vec: int = 2
    writer_rows: int = 2
    # Grid (heads, key blocks, batch): CTAs start longest first over all KV heads (causal's
    # first key blocks see every query). None: on small causal grids (lpt_grid).
    lpt: bool | None = None
    # Each CTA starts its query blocks at its key block's index (wrapping around), so CTAs that
    # run together add into different dQ rows (kernels.hopper.backward._stagger). None: without
    # a band only (stagger_of). H200, bf16, TFLOP/s staggered vs not, 2 runs, 2026-11-26
    # (bench_hopper_bwd_variants.py): B4 H16 L4096 d128 full 487/483 vs 482/475, B4 H32 L4096
    # d64 full 397/396 vs 391/382, B1 H32 L32768 d128 full 533/527 vs 534/525; causal (not
    # used) 436/413 vs 417/420, 349/340 vs 355/347, 510/500 vs 513/500. Expected up to +7% (the
    # ring's full pieces ran 7% under its causal ones); measured +1% to +4% on short full grids.
    stagger: bool | None = None
    # The consumers synchronize per warpgroup (Triton >= 3.9; off below it whatever this says):
    # their mbarrier arrives one per warp and their wgmma waits warpgroup-local
    # (kernels.hopper.compat: warp_arrive, mma_wait), so the step keeps 2 of its 6 256-thread
    # bar.syncs (the dS^T exchange and, before the dS^T store, the one the membar pass puts
    # there). H200, triton 3.9, bf16, TFLOP/s off -> on, 5 interleaved rounds, 2 runs,
    # 2026-11-28 (docs/runs/2026-11-28-h200-bwd-local-sync.txt): d=128 B4 H16 L4096 490/491
    # -> 507/512, causal 430/433 -> 454/447, B1 H16 L16384 causal 505/500 -> 519/519, GQA
    # B1 H32 Hkv8 L8192 causal 439/442 -> 454/459 (ncu, locked clocks: 1.74 -> 1.63 ms causal,
    # 3.14 -> 2.95 ms full; barrier stalls 3.70 -> 3.04 warps per issue); d=64 (the 128-query
    # step) 434/433 -> 425/424, causal 381/378 -> 379/381, GQA 397/390 -> 394/392 (ncu 2.09 ->
    # 2.12 ms causal, 3.82 -> 3.91 full): on at d=128 only.
    local_sync: bool = False

    def __post_init__(self):
        if self.stages == 1 and self.lookahead:
            # LOOKAHEAD >= 1 waits for step t + 1's Q before step t frees the only slot.
            raise ValueError(f"HopperBwdConfig: stages=1 needs lookahead=0 (the next step's "
                             f"tiles load into the slot this step frees), got "
                             f"lookahead={self.lookahead}")


# head dim -> config. dK and dV (2 x 128 x d fp32 over 256 threads) live in the consumers'
# registers; LOOKAHEAD 2 spills at d=128 (docs/hopper-backward.md). H100, bf16, backward only,
# TFLOP/s (scripts/bench_hopper_bwd_variants.py, 3 runs in one process, 2026-11-23):
# d=128 dq_pad vs the 2-row swizzle (LOOKAHEAD 1): 474/488/467 vs 450/448/429 (B4 H16 L4096),
# 428/425/388 vs 380/389/387 (causal), 529/499/503 vs 476/467/461 (B1 H16 L16384 causal);
# with dq_pad, dK from registers measured 466-473 / 395-417 / 485 (no better), LOOKAHEAD 0
# 404-458 / 390-394 / 482-484. With local_sync (H200, triton 3.9, 2026-11-28, 5 rounds) dK from
# registers again lost: 490 vs 507, causal 445 vs 454, L16384 causal 513 vs 524, GQA causal 449
# vs 451. d=64 dK from registers vs from shared memory (LOOKAHEAD 2):
# 366/349/363 vs 368/368/356 (B4 H32 L4096), 321/320/321 vs 315/317/315 (causal); d=64 dq_pad
# spills the writer warp (its 32 per-slice shared addresses are hoisted). d=64 dQ staging
# swizzled in 32-byte chunks over 4 rows (dq_vec=8, writer_rows=4, 40-register workers: spill-
# free) vs the 2-row 8-byte swizzle, dK from registers, LOOKAHEAD 2, 2026-11-23, 2 runs:
# 396/386 vs 376/372 (B4 H32 L4096; cuDNN 453/413), 350/350 vs 319/319 (causal; cuDNN
# 372/357); the 2-row 32-byte swizzle 393/393, 346/346; 40-register workers alone 368, 321;
# dK from shared memory 373/395, 349; LOOKAHEAD 1 391/393, 346. Waiting for S^T alone to run
# P^T and dV under dP^T, and (d=64) K, V in registers, measured 8-25% slower
# (docs/hopper-backward.md, v5). 3 stages instead of 2 (earlier design): +4% on B4 H16 L4096,
# -10% on B1 H16 L16384 causal, -1% to -4% at d=64.
_CONFIGS = {
    64: HopperBwdConfig(block_m=64, block_n=128, stages=2, lookahead=2, dq_writer=True,
                        producer_regs=40, dk_from_regs=True, dq_vec=8, writer_rows=4),
    128: HopperBwdConfig(block_m=64, block_n=128, stages=2, lookahead=1, dq_writer=True,
                         producer_regs=40, dq_pad=True, local_sync=True),
    # d=256: 64 keys a CTA, both warpgroups on all of them, each holding half of dK's and
    # dV's columns (kernels.hopper.backward.acc_layout; 128 registers a thread, as d=128), P^T
    # and dS^T through shared memory. Shared memory: K, V 32 KB each, a Q and a dO tile 32 KB
    # each a stage, dS^T and P^T 8 KB each, the padded dQ staging 66 KB: one stage with the
    # writer warp (216 KB), or two with the consumers adding dQ themselves (214 KB). One stage
    # needs LOOKAHEAD 0 (the next step's Q lands in the slot this step frees at its end).
    # H200, triton 3.6, bf16, backward only, TFLOP/s, 3 interleaved rounds, 2026-11-29, B2 H8
    # L4096 (full / causal): this one 323 / 291; two stages, consumers' dQ atomics, LOOKAHEAD 1
    # 300 / 264 (LOOKAHEAD 0: 270 / 235; decisions/038); portable 159 / 140; cuDNN 363 / 332;
    # FA2 (SDPA) 244 / 205.
    256: HopperBwdConfig(block_m=64, block_n=64, stages=1, lookahead=0, dq_writer=True,
                         producer_regs=40, dq_pad=True),
}


# (head dim, AOT variant) -> a spill `solattn aot` reports as measured and accepted.
_ACCEPTED_SPILL = {
    (128, "varlen-causal-softcap-determ"): (
        "8 bytes, 3 local accesses outside the loops (`solattn aot`, 2026-11-28; unsplit and "
        "split; without the band's split columns 16 B, also outside); not timed"),
}

# Dropout at d=128 (the 128-key tile; beside softcap or ALiBi the 64-key one,
# _DROPOUT_SCORES_CONFIGS): the keep mask's draws leave too few registers beside dK and dV for
# a few loop-invariant values (shared-memory addresses), which ptxas reloads from local memory
# in the step loop: a handful of L1 hits beside the step's ~1,700 instructions a thread.
# Measured with those reloads (H200, 2026-11-28, `solattn bench --suite dropout --trees`, B4
# H16 L4096, forward + backward): 342 vs 198 TFLOP/s for the portable backward, causal 304 vs
# 180 (triton 3.9: 350 vs 201, 283 vs 188); and against the 64-key tile, which compiles
# spill-free here (2026-11-29, triton 3.6, decisions/045): 343 vs 292, causal 306 vs 272.
_DROPOUT_128 = ("dropout at d=128: {} local accesses in the step loop ({} B; reloads of "
                "loop-invariant values), measured 1.5-1.7x the portable backward")
_ACCEPTED_SPILL.update({
    (128, "causal-dropout"): _DROPOUT_128.format("6-8", 40),
    (128, "varlen-window-dropout"): _DROPOUT_128.format(12, 56),
    (128, "causal-dropout-determ"): _DROPOUT_128.format("7-10", 48),
    (128, "varlen-window-dropout-determ"): _DROPOUT_128.format(11, 56),
})


# d=256 (one stage, 64 keys a CTA; docs/hopper-backward.md "Head dim 256"), `solattn aot --arch
# 90`, triton 3.6, 2026-11-29, with K and V reached through kernels.hopper.pipeline.step_view:
# every build without ALiBi compiles spill-free; ALiBi's keep a few loop-invariant values in
# local memory (bytes, accesses inside loops, unsplit / split). Measured with them (H200,
# 2026-11-29, `tools/bwd_features.py --head-dim 256`, backward TFLOP/s against the portable
# backward, B2 H8 L4096; varlen: 12 sequences of 256-4096 tokens): causal ALiBi 340 vs 76, varlen
# causal ALiBi 282 vs 80; deterministic causal ALiBi 274 vs 76 (before step_view).
_D256_ALIBI = ("d=256 with ALiBi: {} local accesses in the step loops ({} B, unsplit / split; "
               "loop-invariant values), measured 3.5-4.5x the portable backward")
_ACCEPTED_SPILL.update({
    (256, "causal-alibi"): _D256_ALIBI.format("0 / 6", 8),
    (256, "varlen-causal-alibi"): _D256_ALIBI.format(4, 24),
    (256, "causal-alibi-determ"): _D256_ALIBI.format("0 / 2", 8),
    (256, "varlen-causal-alibi-determ"): _D256_ALIBI.format(0, 8),
})

# Dropout at d=256 (64 keys a CTA): as at d=128, the Philox draws leave too few registers
# beside dK and dV, and ptxas parks a few values in local memory while they run (16-48 B with
# triton 3.6, reloaded in the same step); `solattn aot --arch 90`, 2026-11-29, counts the local
# accesses inside loops (unsplit / split builds, the dQ writer warps' loops included).
# Measured with them (H200, 2026-11-29, `tools/bwd_features.py
# --head-dim 256 --only dropout`, backward TFLOP/s against the portable backward, p 0.1, B2 H8
# L4096; varlen: 12 sequences of 256-4096 tokens): causal 306 vs 103, varlen window (1024, 1024)
# 277 vs 120, varlen window softcap 30 + ALiBi 246 vs 58, deterministic causal 296 vs 103,
# deterministic varlen window 265 vs 120 (docs/runs/2026-11-29-h200-s29.txt).
_DROPOUT_256 = ("dropout at d=256: {} local accesses in the step loop ({} B; values parked "
                "during the Philox draws), measured {}")
_ACCEPTED_SPILL.update({
    (256, "causal-dropout"): _DROPOUT_256.format("6 / 10", 16, "3.0x the portable backward"),
    (256, "varlen-window-dropout"): _DROPOUT_256.format(6, 16, "2.3x the portable backward"),
    (256, "varlen-window-softcap-alibi-dropout"): _DROPOUT_256.format(
        9, 48, "4.2x the portable backward"),
    (256, "causal-dropout-determ"): _DROPOUT_256.format(8, 16, "2.9x the portable backward"),
    (256, "varlen-window-dropout-determ"): _DROPOUT_256.format(8, 16,
                                                               "2.2x the portable backward"),
    (256, "varlen-window-softcap-alibi-dropout-determ"): _DROPOUT_256.format(
        24, "32-40", "not timed (its non-deterministic build: 4.2x the portable backward)"),
})

# The same with triton >= 3.9 (its CUDA 13 ptxas), every entry as `solattn aot --arch 90`
# compiled it on 2026-11-28 (unsplit and split builds alike; the deterministic ones again on
# 2026-11-29 with the two dQ writer warps, which left the d=64 ones spill-free); none of them
# timed under 3.9 but the d=256 ones below.
# Every variant not listed compiles spill-free with it (before the TMA epilogue, 2026-11-23,
# all of them did), so a new spill fails the gate.
_COLD_39 = ("triton 3.9's ptxas keeps {} bytes in local memory outside the loops (a few "
            "accesses a CTA, none in a step loop; spill-free with triton 3.6)")
_WRITER_39 = ("triton 3.9's ptxas keeps 16 bytes of the deterministic dQ writer warps (40 "
              "registers) in local memory: {} in their step loops, none in the consumers' "
              "wgmma loop (spill-free with triton 3.6)")
_ACCEPTED_SPILL_39 = {
    (128, "causal"): _COLD_39.format(8),
    (128, "alibi"): _COLD_39.format(8),
    (128, "causal-alibi"): _COLD_39.format(8),
    (128, "causal-softcap-alibi"): _COLD_39.format(8),
    (128, "window"): _COLD_39.format(8),
    (64, "causal"): _COLD_39.format(8),
    (64, "window"): _COLD_39.format(8),
    (64, "causal-alibi"): _COLD_39.format(8),
    (64, "causal-softcap-alibi"): _COLD_39.format(8),
    (128, "causal-determ"): _WRITER_39.format("two reloads per step"),
    (128, "window-determ"): _WRITER_39.format("one reload per step (the split build: 8 bytes, "
                                              "none in a loop)"),
    (128, "causal-dropout"): _DROPOUT_128.format("16-26", "72-120"),
    (128, "varlen-window-dropout"): _DROPOUT_128.format(24, "88-96"),
    (128, "causal-dropout-determ"): _DROPOUT_128.format("16-18", 80),
}
# d=256 with triton 3.9 (step_view, as above; before it every d=256 build spilled 40-77
# accesses in its loops), the same compile. Measured with these spills (H200, 2026-11-29,
# `tools/bwd_features.py --head-dim 256` under triton 3.9): causal ALiBi 332 vs 73 TFLOP/s for
# the portable backward, varlen causal ALiBi 280 vs 77, causal softcap 30 + ALiBi 315 vs 68,
# deterministic window (1024, 1024) 662 vs 349 (over the full square), window 761 vs 348.
_D256_ALIBI_39 = ("d=256 with ALiBi, triton 3.9: {} local accesses in the step loops ({} B, "
                  "unsplit / split; loop-invariant values), measured 3.6-4.6x the portable "
                  "backward")
_ACCEPTED_SPILL_39.update({
    (256, "window"): _COLD_39.format(8),
    (256, "alibi"): _COLD_39.format(8),
    (256, "alibi-determ"): _COLD_39.format(8),
    (256, "causal-alibi"): _D256_ALIBI_39.format("7 / 3", "48 / 16"),
    (256, "causal-softcap-alibi"): _D256_ALIBI_39.format("0 / 3", "16 / 8"),
    (256, "varlen-causal-alibi"): _D256_ALIBI_39.format(3, 24),
    # dropout (as for triton 3.6 above; the same run under triton 3.9: causal 312 vs 97, varlen
    # window 269 vs 115, varlen window softcap + ALiBi 216 vs 65, deterministic causal 297 vs 97,
    # deterministic varlen window 258 vs 114; deterministic with ALiBi under a band runs the
    # portable backward: deterministic_covered)
    (256, "causal-dropout"): _DROPOUT_256.format("2 / 3", "16 / 8", "3.2x the portable "
                                                 "backward"),
    (256, "varlen-window-dropout"): _DROPOUT_256.format(4, 32, "2.3x the portable backward"),
    (256, "varlen-window-softcap-alibi-dropout"): _DROPOUT_256.format(
        42, 128, "3.3x the portable backward"),
    (256, "causal-dropout-determ"): _DROPOUT_256.format(2, "24 / 16", "3.1x the portable "
                                                        "backward"),
    (256, "varlen-window-dropout-determ"): _DROPOUT_256.format(22, 64, "2.3x the portable "
                                                               "backward"),
    (256, "window-determ"): ("triton 3.9's ptxas keeps 24 bytes of the deterministic dQ writer "
                             "warps (40 registers) in local memory at d=256: 6 accesses in "
                             "their step loops, none in the consumers' wgmma loop (spill-free "
                             "with triton 3.6); measured 1.9x the portable backward (one writer "
                             "warp, 4 accesses)"),
})


def accepted_spill(head_dim: int, variant: str) -> str:
    """Why AOT variant ``variant`` (a key of
    :data:`~solattn.kernels.hopper.backward_plan.AOT_VARIANTS`) may spill with the installed
    Triton ("" where it may not): :data:`_ACCEPTED_SPILL_39` with triton >= 3.9, else
    :data:`_ACCEPTED_SPILL`."""
    table = _ACCEPTED_SPILL_39 if triton_version() >= (3, 9) else _ACCEPTED_SPILL
    return table.get((head_dim, variant), "")


# d=64 without a score transform: 128 queries a step (FlashAttention-4's 128 x 128 tile at
# d<=64). The two warpgroups then split dQ's rows (kernels.hopper.backward.acc_layout): per
# 128 queries 32 wgmmas (S^T, dP^T 64x128, dV, dK 64x64 from registers, dQ 64x64) instead of
# 48 (dQ as 64x32 products, each reading its whole dS operand from shared memory: ncu put the
# old loop at 91.5 M shared-load wavefronts against FA4's 10.7 M, docs/design/fa4-profile.md),
# and the step's fixed costs (waits, barriers, the -lse/-Delta columns) are paid half as often.
# LOOKAHEAD 1: with 2, the next step's S^T and dP^T (64 registers each) beside dK, dV and the
# operands spill 256 B in the loop (solattn aot, sm_90, triton 3.6); 1 and 0 compile
# spill-free, 166 KB of shared memory. Softcap and ALiBi (and the flex backward's mods) keep
# the 64-query step: at 128 their extra [128, 128] tiles spill in the loop (softcap 32 B,
# causal + softcap 56 B, causal + ALiBi 16 B, the same 3.6 compile).
_WIDE_CONFIGS = {
    64: HopperBwdConfig(block_m=128, block_n=128, stages=2, lookahead=1, dq_writer=True,
                        producer_regs=40, dk_from_regs=True, dq_vec=8, writer_rows=4),
}


# Dropout beside softcap or ALiBi: the keep mask's Philox draws, the score transform's tiles
# and dK, dV (128 registers a thread at d=128) do not fit the consumers' registers with 128 keys
# a CTA (d=128: 110 local accesses in the step loop, `solattn aot --arch 90`, 2026-11-28;
# d=64 with triton 3.9's ptxas: 7-16), so those calls take d=256's 64-key tile (both
# warpgroups on every key, dK and dV split by columns: 32 registers each at d=128), which
# compiles spill-free at d=128 (triton 3.6 and 3.9) and at d=64 (3.9), deterministic builds
# included, but for 3.9's d=128 deterministic causal softcap build (24 B: one access in the
# consumers' loop, one in each dQ writer's; not an AOT variant, timed in tools/bwd_features.py).
# Shared memory at d=128: 147 KB with two Q / dO stages (LOOKAHEAD 1). At d=64 with triton 3.6
# the 128-key tile compiles spill-free and keeps those calls.
_DROPOUT_SCORES_CONFIGS = {
    64: HopperBwdConfig(block_m=64, block_n=64, stages=2, lookahead=1, dq_writer=True,
                        producer_regs=40, dq_pad=True),
    128: HopperBwdConfig(block_m=64, block_n=64, stages=2, lookahead=1, dq_writer=True,
                         producer_regs=40, dq_pad=True, local_sync=True),
}


def dropout_scores_tile(head_dim: int, scores: bool, dropout: bool) -> bool:
    """Whether a call at ``head_dim`` that transforms scores (``scores``: softcap, ALiBi) and
    draws a keep mask (``dropout``) takes the 64-key tile (:data:`_DROPOUT_SCORES_CONFIGS`)
    with the installed Triton."""
    return (scores and dropout
            and (head_dim == 128 or head_dim == 64 and triton_version() >= (3, 9)))


def hopper_bwd_config(head_dim: int, scores: bool = False,
                      dropout: bool = False) -> HopperBwdConfig:
    """Config of :func:`~solattn.kernels.hopper.backward.attn_bwd_kernel` for ``head_dim``
    (64, 128 or 256). ``scores``: the call transforms scores beyond a band (softcap, ALiBi, or
    the flex backward's mods; as :func:`solattn.configs.portable.bwd_config`'s); ``dropout``:
    it draws a keep mask. Either keeps d=64 at 64 queries a step (``_WIDE_CONFIGS``); both take
    the 64-key tile where :func:`dropout_scores_tile` says."""
    if dropout_scores_tile(head_dim, scores, dropout):
        return _DROPOUT_SCORES_CONFIGS[head_dim]
    if not (scores or dropout) and head_dim in _WIDE_CONFIGS:
        return _WIDE_CONFIGS[head_dim]
    return _CONFIGS[head_dim]


# GQA: one CTA holds a key block's dK/dV over all query heads of its group, so the grid has
# (key blocks) x h_kv x batch CTAs. With few of them (short sequences, few KV heads) some SMs
# idle and, causal, the first key blocks (every query) run far longer than the last (only the
# diagonal): B1 Hq32 Hkv4 L4096 d64 causal (a 1.1B Llama's layer) is 128 CTAs on 132 SMs.
# Split, the group runs on several CTAs per key block (each over a part of the query heads,
# K/V read in place), each writing fp32 partial dK/dV that bwd_dkdv_reduce_kernel sums.
#
# When the default splits (default_gqa_splits): causal, and no more unsplit CTAs than SMs; then
# into the fewest parts that give every SM a CTA (gqa_head_splits), the grid longest first
# (lpt_grid). H200, bf16, backward only, TFLOP/s by split count 1 / 2 / 4 / 8, in key-block
# grid order and longest first (LPT) (cuDNN), 2026-11-26 (scripts/bench_hopper_bwd_gqa.py,
# BENCHMARKS.md):
#   B1 Hq32 Hkv4 L4096 d64 causal (128 CTAs): grid 204 / 247 / 296 / 315, LPT 203 / 372 / 358 /
#     344 (331)
#   B1 Hq32 Hkv4 L4096 d64 full   (128 CTAs): grid 397 / 403 / 399 / 386, LPT 398 / 405 / 396 /
#     379 (417)
#   B1 Hq32 Hkv8 L4096 d128 causal (256 CTAs): grid 330 / 385 / 400, LPT 438 / 435 / 404 (425)
#   B2 Hq32 Hkv8 L2048 d128 causal (256 CTAs): grid 282 / 320 / 325, LPT 382 / 366 / 336 (354)
# The split pays where causal's unequal key blocks leave SMs idle in a grid of one wave or
# less, and once every SM has a CTA the LPT order balances the rest (more parts only add
# partials to sum); full attention's equal CTAs gain nothing.


def gqa_head_splits(n_ctas: int, group_size: int, num_sms: int) -> int:
    """Query-head splits of a GQA group for a grid of ``n_ctas`` (key blocks x h_kv x batch)
    CTAs: the smallest divisor ``s`` of ``group_size`` giving more CTAs than SMs (``n_ctas * s
    > num_sms``), else ``group_size`` (one query head per CTA)."""
    for s in range(1, group_size + 1):
        if group_size % s == 0 and n_ctas * s > num_sms:
            return s
    return group_size


def default_gqa_splits(n_ctas: int, group_size: int, causal: bool, num_sms: int) -> int:
    """The default query-head splits of a GQA group (the measured rule above): 1 unless the
    call is causal and its unsplit grid has at most ``num_sms`` CTAs, else
    :func:`gqa_head_splits`."""
    if group_size == 1 or not causal or n_ctas > num_sms:
        return 1
    return gqa_head_splits(n_ctas, group_size, num_sms)


# Key blocks a grid's y dimension holds (CUDA: 65535), which the LPT grid puts there.
_MAX_GRID_Y = 65535
# Causal grids of at most this many CTAs per SM (unsplit) run longest first (lpt_grid). H200,
# bf16, backward TFLOP/s in key-block grid order vs LPT, 2026-11-26 (bench_hopper_bwd_gqa.py
# --many-waves and the table above): 256 CTAs +33% / +35% (B1 Hq32 Hkv8 L4096 d128, B2 L2048);
# 1024-4096 CTAs -4% to +5% (B4 H16 L4096 d128 418 -> 439, B1 H16 L16384 d128 508 -> 494,
# B4 H32 L4096 d64 355 -> 351, B4 Hq32 Hkv8 L4096 d128 423 -> 429, B1 Hq32 Hkv8 L16384 d128
# 506 -> 485): no clear winner there, so grid order.
_LPT_MAX_CTAS_PER_SM = 2
# GQA causal grids (a CTA walks every query head of its group: 4-8x an MHA CTA's work, so the
# last wave's unequal key blocks cost that much more) of at most this many waves and key blocks
# run longest first too. H200, bf16, backward TFLOP/s unsplit, key-block order vs LPT (cuDNN),
# 2026-11-27 (scripts/bench_hopper_bwd_gqa.py --shape): B4 Hq32 Hkv4 L4096 d64 causal, 512
# CTAs (the 1.1B model's layer at batch 4) 304 vs 376 (372); B8 Hq32 Hkv4 L2048 d64, 512 CTAs
# 272 vs 287 (310); B4 Hq32 Hkv8 L4096 d128, 1024 CTAs 429 vs 451 (454); 2026-11-29 (`solattn
# bench --suite backward --config hopper_bwd_config.lpt=True`, triton 3.6, 7 and 9 interleaved
# rounds): B1 Hq32 Hkv8 L8192 d128, 512 CTAs of 64 key blocks, 446 vs 473 and 443 vs 465.
# Longer sequences lost: B1 Hq32 Hkv8 L16384 d128 (1024 CTAs, 128 key blocks) 506 vs 485
# (2026-11-26, above).
_LPT_GQA_MAX_CTAS_PER_SM = 8
_LPT_GQA_MAX_BLOCKS = 64
# Causal grids of 64-key blocks (d=256) of at most this many key blocks run longest first too:
# a d=256 CTA's work per query block is twice d=128's over half the keys, so its unequal
# causal CTAs are long. H200, B2 H8 L4096 d256 causal (1024 CTAs, 64 key blocks), key-block
# order vs LPT, `solattn bench --suite backward --config hopper_bwd_config.lpt=True`: 340 vs
# 353 (triton 3.6, 2026-11-29), 332 vs 347 (3.9), 334 vs 343 and 327 vs 350 (3.6, 7 and 9
# rounds). Longer d=256 sequences not measured. The rule follows the tile: the 64-key tile of
# dropout beside softcap or ALiBi at d=128 and 64 (_DROPOUT_SCORES_CONFIGS) takes it too,
# measured only with it (tools/bwd_features.py, 2026-11-29).
_LPT_D256_MAX_BLOCKS = 64


def lpt_grid(cfg: HopperBwdConfig, n_ctas: int, n_blocks: int, splits: int, causal: bool,
             num_sms: int, group_size: int = 1, deterministic: bool = False) -> bool:
    """Whether :func:`~solattn.kernels.hopper.backward.attn_bwd_kernel` runs with the LPT grid
    for a grid of ``n_ctas`` unsplit CTAs (``n_blocks`` key blocks) split ``splits`` ways:
    ``HopperBwdConfig.lpt`` if set, else every ``deterministic`` call, causal grids of at most
    :data:`_LPT_MAX_CTAS_PER_SM` waves, whose unequal key blocks leave SMs idle at the end in
    key-block order, every split group (made for such grids), GQA grids (``group_size``
    query heads a KV head) of at most :data:`_LPT_GQA_MAX_CTAS_PER_SM` waves and
    :data:`_LPT_GQA_MAX_BLOCKS` key blocks, and grids of 64-key blocks (d=256; dropout beside
    softcap or ALiBi) of at most :data:`_LPT_D256_MAX_BLOCKS` key blocks.

    Deterministic calls (why they take the LPT order; its measured cost:
    :func:`~solattn.kernels.hopper.backward_plan.preferred`):
    the key blocks of one head hand each shared query block on in order, one hand-off (1-2 us)
    apart. In key-block order a head's key blocks
    start together (all of them in one wave; in later waves as fast as the SMs free up), so key
    block ``n`` waits about ``n`` hand-offs before its first add, again in every wave where
    unequal (causal) CTAs free SMs in bursts: up to ~0.5 ms of SM time per head of 32 key
    blocks against its ~3-6 ms of work. In the LPT order a head's key blocks start about a
    wave's fraction of a CTA's life apart and no block waits for the one below."""
    gqa = (group_size > 1 and n_ctas <= _LPT_GQA_MAX_CTAS_PER_SM * num_sms
           and n_blocks <= _LPT_GQA_MAX_BLOCKS)
    wide = cfg.block_n == 64 and n_blocks <= _LPT_D256_MAX_BLOCKS
    on = cfg.lpt if cfg.lpt is not None else deterministic or causal and (
        splits > 1 or n_ctas <= _LPT_MAX_CTAS_PER_SM * num_sms or gqa or wide)
    return on and n_blocks <= _MAX_GRID_Y


def stagger_of(cfg: HopperBwdConfig, p) -> bool:
    """Whether :func:`~solattn.kernels.hopper.backward.attn_bwd_kernel` staggers its CTAs' query
    blocks: never for deterministic calls, else ``cfg.stagger`` if set, else for calls without a
    band (no causal, no window), where every CTA of a head walks the same query blocks."""
    if p.deterministic:
        return False  # the deterministic dQ order keeps every CTA's walk in the same phase
    if cfg.stagger is not None:
        return cfg.stagger
    return not (p.has_left or p.has_right)
