"""Gluon names that moved between Triton 3.6 and 3.9, under one stable name each.

The Hopper kernels import these instead of the Gluon originals, so one module tracks the drift
(``pyproject.toml`` supports ``triton>=3.6,<3.10``). Each alias is the Gluon builtin itself,
picked once at import: a ``@gluon.jit`` function calls a module-global builtin like the original,
and the compiled code is the same. Unchanged across 3.6-3.9 and used directly: ``mbarrier.init``,
``mbarrier.wait``, ``mbarrier.arrive``, ``tma.store_wait``, ``fence_async_shared``,
``warpgroup_mma``, ``warpgroup_mma_wait``, and ``mbarrier.expect(bar, nbytes)`` when the byte
count is passed by position (its keyword is ``bytes`` in 3.6, ``bytes_per_cta`` from 3.7 on).
"""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma

__all__ = ["barrier", "reinterpret", "tma_load", "tma_store", "warp_specialize"]

# TMA global -> shared ``(desc, coord, barrier, result, pred=True)``: ``async_load`` from 3.8;
# ``async_copy_global_to_shared`` up to 3.8, and a stub raising RuntimeError in 3.9.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# TMA shared -> global ``(desc, coord, src)``: ``async_store`` from 3.8;
# ``async_copy_shared_to_global`` up to 3.8, a RuntimeError stub in 3.9.
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# CTA-wide barrier ``()``: ``gl.barrier`` from 3.7 (keyword ``cluster=False``);
# ``gl.thread_barrier`` in 3.6, gone in 3.7.
barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# ``warp_specialize([(default_fn, args), (worker_fn, args), ...], worker_num_warps,
# worker_num_regs)`` is positionally the same in 3.6-3.9; 3.7 made ``worker_num_regs`` optional
# (None: no setmaxnreg). The alias is the one place to adapt if the signature moves again.
warp_specialize = gl.warp_specialize


@builtin
def reinterpret(smem, dtype, shape, layout, _semantic=None):
    """``smem`` viewed as ``dtype[shape]`` in ``layout`` (same bytes): the shared memory
    descriptor's ``reinterpret`` from 3.9, ``_reinterpret`` up to 3.8 (gone in 3.9)."""
    method = getattr(smem, "reinterpret", None) or smem._reinterpret
    return method(dtype, shape, layout, _semantic=_semantic)
