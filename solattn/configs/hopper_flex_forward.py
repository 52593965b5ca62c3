"""Configurations of the Hopper flex forward (:mod:`solattn.kernels.hopper.flex_forward`,
launched by :mod:`solattn.kernels.hopper.flex_forward_plan`): the BlockMask block it walks, the
TMA warp's registers, the tiles (the dense forward's, :mod:`solattn.configs.hopper_forward`)
and the half-block CTAs' budget and threshold."""

from __future__ import annotations

import dataclasses

from solattn.configs.hopper_forward import fwd_tile_config

# Head dims with a config whose key block (128) is the BlockMask block size.
SUPPORTED_HEAD_DIMS = (64, 128)
SPARSE_BLOCK = 128  # the BlockMask (q, kv) block this kernel walks: 2 * BLOCK_M, BLOCK_N
# setmaxnreg of the TMA warp: the block-list walk (list pointers, counts, 64-bit index
# pointers) spilled 88 bytes (35 local accesses in loops) at forward.py's 24 and none at 48
# (`solattn aot --arch 90`, triton 3.6, 2026-11-23); 2 x 128 x 240 + 32 x 48 registers fit.
PRODUCER_REGS = 48
# Half-block CTAs (flex_config(consumers=1)), two an SM: shared memory a CTA (of 228 KiB an SM,
# 1 KiB of it reserved per CTA, and the barriers), and the launch's maxnreg: a CTA is two
# warpgroups (the consumer; the TMA warp, padded to a warpgroup for setmaxnreg), so 64K / (2
# CTAs x 256 threads). Triton gives the consumer (the default partition) the rest of the CTA's
# pool: its SASS raises it to 232 registers, the TMA warp to PRODUCER_REGS, the padding warps 24.
HALF_CTA_SMEM = 112 * 1024
HALF_CTA_MAXNREG = 128
# Half-block CTAs run a call whose plan has 64-key tiles and whose BlockMask lists at most this
# many key blocks per query block on average (FlexParams.mean_kv_blocks). Measured H100, H16
# D128, B = 16384 / L, 2026-11-27 (scripts/bench_half_cta.py, causal documents; forward ms, full
# -> half CTAs): at L4096 2.4 blocks 0.180 -> 0.156, 3.1 0.203 -> 0.179, 4.0 0.233 -> 0.210, 8.9
# 0.37 -> 0.373, 11.8 0.45 -> 0.46; at L16384 4.8 0.262 -> 0.240, 9.4 0.410 -> 0.407, 17.3 0.686
# -> 0.690, 32.6 1.20 -> 1.215, 58.8 2.05 -> 2.12. (bench_flex_trees.py: softcap + causal, 16.5
# and 64.5 blocks, 0.870 -> 0.883-0.901 and 3.06-3.09 -> 3.28-3.29 ms.)
# Two CTAs an SM hide a short tile's set-up and epilogue under each other's products; on long
# tiles each loads its own K and V, twice the L2 traffic of one CTA for both halves.
HALF_CTA_MAX_BLOCKS = 8


# Measured H100 SXM, B4 H16 L4096 D128 bf16, 2026-11-23 (kernel alone, plain do_bench median,
# no heat-up): causal 511 TF/s (128-key tiles; flash_attn_func's dedicated causal kernel in the
# same process: 523 vs 555 us), prefix-LM 517, ALiBi + causal 430, sliding window 1024 434,
# softcap + causal 320 (64-key: the 128-key build spills), 16-document causal 222 (64-key).
# torch 2.11's compiled flex_attention (scripts/bench_flex.py, another session the same day):
# 380, 388, 334, 346, 187, 234. bench_flex.py's own protocol (heated GPU, whole call) read the
# mask-only mods lower in its run (causal 307, prefix-LM 339, window 262): not yet explained.
def flex_config(head_dim: int, block_n: int = SPARSE_BLOCK, consumers: int = 2):
    """forward.py's tile config for ``head_dim`` (one CTA per tile) with the flex producer's
    register budget; ``block_n=64`` (two key tiles per BlockMask block, the ring twice as deep:
    the same shared memory) halves the score and P registers for mods that do not fit beside
    128-key tiles (:func:`solattn.kernels.hopper.flex_forward_plan.prepare`). ``consumers=1``
    (64-key tiles only): half a query block a CTA with the ring sized so that two CTAs share an
    SM (:data:`HALF_CTA_SMEM`)."""
    cfg = fwd_tile_config(head_dim)
    stages = cfg.stages * (cfg.block_n // block_n)
    if consumers == 1:
        stage_bytes = 2 * block_n * head_dim * 2  # K and V, 16-bit
        stages = (HALF_CTA_SMEM - cfg.block_m * head_dim * 2) // stage_bytes
    # (consumer_regs: the second consumer warpgroup's setmaxnreg, unused with one)
    return dataclasses.replace(cfg, block_n=block_n, stages=stages, persistent=False,
                               producer_regs=PRODUCER_REGS, consumers=consumers)
