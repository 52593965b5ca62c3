"""Configurations of the Hopper flex backward (:mod:`solattn.kernels.hopper.flex_backward`,
launched by :mod:`solattn.kernels.hopper.flex_backward_plan`): the BlockMask block it walks, the
worker warps' registers, the loop reloads a mod may add, and the accepted spills (its tiles are
the dense backward's, :mod:`solattn.configs.hopper_backward`)."""

from __future__ import annotations

# Head dims with a config whose key block (128) is the BlockMask block size.
SUPPORTED_HEAD_DIMS = (64, 128)
SPARSE_BLOCK = 128  # the BlockMask block this kernel walks: BLOCK_N keys, SPARSE_M // BLOCK_M steps
# setmaxnreg of the TMA and dQ-writer warps: their block-list walk (two 64-bit index pointers,
# the counts) needs more than the dense kernel's 40. The consumers keep 232 either way (the
# workers' warpgroup frees 4 x 32 x (168 - WORKER_REGS) registers, rounded to 8 per thread).
WORKER_REGS = 40
# Local-memory accesses inside the step loop that a mod may add and still run here (else the
# portable kernels run it): the gathered document ids at d=128 reload 6 values per step
# (`solattn aot`, triton 3.6), against ~1500 instructions a step.
HOT_RELOADS_ACCEPTED = 8


# (head dim, AOT variant) -> why `solattn aot` may report a spill there. Triton 3.6: the
# document mask's loop reloads stay within HOT_RELOADS_ACCEPTED, which prepare() accepts too.
# Triton 3.9 (its CUDA 13 ptxas) spills every d=128 variant. With the mods' query indices split
# into the lane's part and a per-register constant (kernels.hopper.columns.split_cols; 2026-11-28,
# `solattn aot --arch 90`, local accesses in the loop before -> after, MHA / GQA build): causal
# 8 -> 2 / 0, ALiBi + causal 19 / 24 -> 3 / 2, softcap + window 21 / 18 -> 2 / 0, document 24 / 6
# -> 10 / 0, so prepare() now runs all of them here but the MHA document mask (portable).
# With the block lists and captured tensors specialized as a call launches them (their row
# stride 1 a constexpr), the dQ writer warp reloads one or two 4-byte words a key block in its
# loop of 32 (d=64) / 64 (d=128) fp32x4 atomic adds; the consumers' step loop spills nothing.
# These are the binaries real calls get (prepare() accepts them: within HOT_RELOADS_ACCEPTED);
# `solattn aot --arch 90`, triton 3.6, 2026-11-28; not timed against a spill-free build.
_WRITER_RELOADS = "8 B: 1-2 reloads a key block in the dQ writer warp's atomic loop, triton 3.6"
_ACCEPTED_SPILL = {
    (128, "document"): f"<= {HOT_RELOADS_ACCEPTED} reloads a step of the gathered document ids",
    # Since the partitions take bundles (2026-11-28): a few scalars saved before the step loop
    # and reloaded after it, none inside it; not yet timed against the spill-free build.
    (128, "softcap+window"): "16 B outside the step loop (0 loop reloads), triton 3.6",
    (64, "causal"): _WRITER_RELOADS,
    (128, "causal"): _WRITER_RELOADS,
    (128, "alibi+causal"): _WRITER_RELOADS,
    (64, "softcap+window"): _WRITER_RELOADS,
}


def accepted_spill(head_dim: int, variant: str) -> str:
    """Why AOT variant ``variant`` (a key of
    :data:`solattn.kernels.hopper.flex_backward_plan.AOT_VARIANTS`) may spill with the installed
    Triton ("" where it may not)."""
    from solattn.device import triton_version

    if head_dim == 128 and triton_version() >= (3, 9):
        return ("triton 3.9's ptxas spills the d=128 consumers; prepare() sends calls with more "
                f"than {HOT_RELOADS_ACCEPTED} loop reloads to the portable kernels")
    if triton_version() >= (3, 9):
        # With the lists specialized as launched, every d=64 variant: 8-16 B, 2-4 local accesses
        # in loops (`solattn aot --arch 90`, 2026-11-28; not timed).
        return (f"triton 3.9: 8-16 B, 2-4 loop reloads at d=64, within the {HOT_RELOADS_ACCEPTED}"
                " prepare() accepts")
    return _ACCEPTED_SPILL.get((head_dim, variant), "")
