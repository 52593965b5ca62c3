"""Reading a compiled kernel's SASS (``cuobjdump -sass`` text): where its innermost loops are
and whether local memory (a register spill) is read or written inside them.

`solattn aot` fails a kernel on such accesses, and the Hopper flex kernels' host plans refuse a
mod whose compiled kernel has them; both read the SASS here, with the ``cuobjdump`` bundled in
the Triton wheel (:func:`bin_dir`).
"""

from __future__ import annotations

import os
import re


def innermost_loops(sass: str) -> list[tuple[int, int, list[str]]]:
    """``(start, end, [instruction text])`` of each innermost loop of ``sass`` (``cuobjdump
    -sass`` text): an address range ``[target, branch]`` of a backward ``BRA`` that contains no
    other such range."""
    ins = [(int(m.group(1), 16), m.group(2))
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b[^;]*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    inner = sorted({lp for lp in loops
                    if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)})
    return [(lo, hi, [t for a, t in ins if lo <= a <= hi]) for lo, hi in inner]


def hot_local_accesses(sass: str) -> int:
    """``LDL``/``STL`` instructions of ``sass`` (``cuobjdump -sass`` text) that lie inside an
    innermost loop (:func:`innermost_loops`)."""
    inner = [(lo, hi) for lo, hi, _ in innermost_loops(sass)]
    return sum(1 for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
               if re.search(r"\b(?:LDL|STL)\b", m.group(2))
               and any(lo <= int(m.group(1), 16) <= hi for lo, hi in inner))


def bin_dir() -> str:
    """The folder of the CUDA tools (``cuobjdump``, ``ptxas``) bundled in the Triton wheel."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
