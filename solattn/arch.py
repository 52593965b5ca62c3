"""What each GPU architecture allows a kernel: one table, read by the config tables
(:mod:`solattn.configs`), the AOT gate (:mod:`solattn.aot`) and docs/gpus.md.

Limits are per compute capability, from the CUDA C++ Programming Guide's "Technical
Specifications per Compute Capability" table: the opt-in maximum of shared memory one block may
use (``cudaDevAttrMaxSharedMemoryPerBlockOptin``: 163 KB on sm_80, 99 KB on sm_86/89/120,
227 KB on sm_90/100), the shared memory and threads one SM holds. The tensor-core SASS ops are
what ptxas emits for a 16-bit ``tl.dot`` on that part (read from ``solattn aot`` output): the
AOT gate fails a kernel that should use the tensor cores and contains none of them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

KB = 1024


@dataclass(frozen=True)
class Arch:
    """One compute capability's limits and the config tables its parts run."""

    cc: int                  # compute capability as an int: 86 for sm_86
    parts: str               # the GPUs of this capability the tables were written for
    smem_per_block: int      # bytes one block may use (opt-in maximum)
    smem_per_sm: int         # bytes of shared memory one SM holds (blocks share it)
    threads_per_sm: int      # resident threads an SM holds (1536 on the GeForce-class parts)
    # SASS ops (regular expressions, whole words) that prove a kernel uses the tensor cores:
    # mma.sync is HMMA everywhere; wgmma is HGMMA (16-bit) / QGMMA (FP8) on sm_90; tcgen05.mma
    # is the UTC*MMA family on sm_100 (UTCHMMA 16-bit, UTCQMMA FP8, UTCIMMA int8). Triton keeps
    # mma.sync where the newer instruction does not fit the tile (few rows: decode).
    tensor_ops: tuple[str, ...]
    # Which portable config tables (solattn.configs) the parts run: "sm90" the Hopper tables,
    # "sm80" the Ampere ones (register-bound tiles of mma.sync, see configs/portable.py), "sm86" the
    # Ampere tiles re-fitted to 99 KB of shared memory a block.
    tables: str


_HMMA = (r"HMMA",)
ARCHS: dict[int, Arch] = {
    a.cc: a for a in (
        Arch(80, "A100", 163 * KB, 164 * KB, 2048, _HMMA, "sm80"),
        Arch(86, "RTX 3090, A10, A40", 99 * KB, 100 * KB, 1536, _HMMA, "sm86"),
        Arch(89, "RTX 4090, L4, L40S", 99 * KB, 100 * KB, 1536, _HMMA, "sm86"),
        Arch(90, "H100, H200", 227 * KB, 228 * KB, 2048, (r"HGMMA", r"QGMMA", r"HMMA"), "sm90"),
        Arch(100, "B200, GB200", 227 * KB, 228 * KB, 2048, (r"UTC\w*MMA", r"HMMA"), "sm80"),
        Arch(120, "RTX 5090, RTX 5060 (Laptop)", 99 * KB, 100 * KB, 1536, _HMMA, "sm86"),
    )
}

# A part the table does not list runs the tables of the smallest limits (the 99 KB class: the
# fewest bytes a block, the fewest threads an SM), and says so under SOLATTN_DEBUG=1.
CONSERVATIVE = 86


def known(cc: int) -> bool:
    """Whether ``sm_{cc}`` has its own row in :data:`ARCHS`."""
    return cc in ARCHS


def unknown_arch_note(cc: int) -> str:
    """What a part the table does not list runs (``SOLATTN_DEBUG=1`` prints it)."""
    base = ARCHS[CONSERVATIVE]
    return (f"sm_{cc} is not in solattn.arch ({', '.join(f'sm_{a}' for a in ARCHS)}): "
            f"the portable kernels run the most conservative tables, sm_{CONSERVATIVE}'s "
            f"({base.smem_per_block // KB} KB of shared memory a block); not checked by "
            f"`solattn aot` for this part")


@functools.lru_cache(maxsize=None)
def arch_limits(cc: int) -> Arch:
    """The row of ``sm_{cc}``; an unknown capability gets the conservative row's limits under
    its own number (see :data:`CONSERVATIVE`)."""
    if cc in ARCHS:
        return ARCHS[cc]
    base = ARCHS[CONSERVATIVE]
    return Arch(cc, f"unknown (the sm_{CONSERVATIVE} limits)", base.smem_per_block,
                base.smem_per_sm, base.threads_per_sm, base.tensor_ops, base.tables)


# The Gluon (Hopper) kernels are written for wgmma: mma.sync alone would mean a wrong lowering.
WGMMA_OPS = (r"HGMMA", r"QGMMA")


def tensor_op_count(cc: int, sass_ops: dict, ops: tuple[str, ...] | None = None) -> int:
    """How many of ``sass_ops`` (op name -> count, as :mod:`solattn.aot` reads them) are
    tensor-core instructions of ``sm_{cc}`` (or of the patterns ``ops``)."""
    pats = [re.compile(rf"{p}$") for p in ops or arch_limits(cc).tensor_ops]
    return sum(n for op, n in sass_ops.items() if any(p.match(op) for p in pats))
