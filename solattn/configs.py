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


# Portable forward, sm_90 / sm_80 / sm_89 / sm_120 (any CUDA arch the dispatcher sees).
# key: padded max(head_dim_qk, head_dim_v) -> (block_m, block_n, num_warps, num_stages)
# Provenance: H100 80GB HBM3, triton 3.6.0, bf16, B4 H16 L4096, swept 2026-11-22 by
# scripts/gpu_check.sh (sweep section; table in BENCHMARKS.md). Larger head dims trade
# block_n for registers: at d=256 a 128x64 tile with 8 warps is the largest that does not spill.
_FWD_TABLE_SM90 = {
    16: (128, 64, 4, 3),
    32: (128, 64, 4, 3),
    64: (128, 64, 4, 3),
    128: (128, 64, 8, 3),
    256: (64, 64, 4, 2),
}

# Ampere-class (sm_80/86/89) and newer non-Hopper parts: smaller shared memory (99-163 KB), so
# the same tiles with one stage less at d >= 128. Chosen from the shared-memory budget (AOT:
# `solattn aot --arch 80` reports the bytes); not measured on an Ampere GPU.
_FWD_TABLE_SM80 = {
    16: (128, 64, 4, 3),
    32: (128, 64, 4, 3),
    64: (128, 64, 4, 3),
    128: (128, 64, 8, 2),
    256: (64, 64, 4, 2),
}

# Triton's interpreter runs every program instance in Python: small tiles keep tests fast, and
# 16 still exercises ragged tails, multi-block loops and the masked/unmasked split.
_FWD_INTERPRET = FwdConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def fwd_config(arch: int, head_dim: int, head_dim_v: int) -> FwdConfig:
    """Config of the portable forward for compute capability ``arch`` (e.g. 90) and head dims."""
    if interpreting():
        return _FWD_INTERPRET
    d = padded_head_dim(max(head_dim, head_dim_v))
    table = _FWD_TABLE_SM90 if arch == 90 else _FWD_TABLE_SM80
    return FwdConfig(*table[d])


def all_fwd_configs(arch: int) -> dict[int, FwdConfig]:
    """Every (padded head dim -> config) the dispatcher can pick on ``arch`` (for ``solattn aot``)."""
    table = _FWD_TABLE_SM90 if arch == 90 else _FWD_TABLE_SM80
    return {d: FwdConfig(*cfg) for d, cfg in table.items()}
