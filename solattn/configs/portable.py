"""Portable kernel configurations (kernels/triton: forward, flex, dropout, backward): frozen
dataclasses chosen by pure functions of (arch, head dim, ...).

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
    cfg = all_fwd_configs(arch)[(d, bool(upper_banded))]
    # A ragged head dim in the 32 tile (d=24: strides not multiples of 16): with every feature
    # (varlen, left window, softcap, ALiBi, seqused_k) the 4-warp 128 x 64 tile spills in its
    # loops (sm_90 causal: 160 B, 32 local accesses with triton 3.6; sm_90 non-causal: 144 B, 9
    # with triton 3.9; sm_80: 64 B, 12 with triton 3.9); 8 warps compile spill-free. `solattn
    # aot`, 2026-11-28; not timed (d=16 and d=32 keep their 4 warps).
    if d == 32 and (head_dim % 16 or head_dim_v % 16):
        cfg = dataclasses.replace(cfg, num_warps=8)
    return cfg


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


def flex_bwd_accepted_spill(arch: int, spec: str, head_dim: int, variant: str) -> str:
    """Why ``solattn aot`` may report a spill of a portable flex backward kernel ("" where it
    may not). The dQ kernel of a relative-bias table that requires grad (an atomic per score
    into the table) under a document mask, d=128 on sm_90 with triton 3.9: 24 B, 2 local
    accesses in its loop, launched as a call specializes it (`solattn aot`, 2026-11-28; 16 B
    outside the loop with triton 3.6). A learnable bias of that shape runs this binary on every
    GPU the Hopper flex backward does not cover it on. Not timed against a spill-free build."""
    if (spec == "bwd_flex_dq" and arch == 90 and head_dim == 128
            and variant == "doc+relbias-grad" and triton_version() >= (3, 9)):
        return "24 B: 2 loop accesses (an atomic per score into a learnable table), triton 3.9"
    return ""
