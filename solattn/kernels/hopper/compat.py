"""Gluon names that moved between Triton 3.6 and 3.9, under one stable name each.

The Hopper kernels import these instead of the Gluon originals, so one module tracks the drift
(``pyproject.toml`` supports ``triton>=3.6,<3.10``). Each alias is the Gluon builtin itself,
picked once at import: a ``@gluon.jit`` function calls a module-global builtin like the original,
and the compiled code is the same. Unchanged across 3.6-3.9 and used directly: ``mbarrier.init``,
``mbarrier.wait``, ``mbarrier.arrive``, ``tma.store_wait``, ``fence_async_shared``,
``warpgroup_mma``, ``warpgroup_mma_wait``, and ``mbarrier.expect(bar, nbytes)`` when the byte
count is passed by position (its keyword is ``bytes`` in 3.6, ``bytes_per_cta`` from 3.7 on).
Two synchronization forms exist only from 3.9 (``HAS_LOCAL_SYNC``): ``warp_arrive`` and the
warpgroup-local ``mma_wait``.
"""

from __future__ import annotations

import inspect

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma, warpgroup_mma_wait
from triton.language.core import _aggregate, base_value
from triton.language.core import tuple as tl_tuple
from triton.runtime.jit import JITCallable, constexpr_function

__all__ = ["barrier", "bundle", "HAS_LOCAL_SYNC", "mma_wait", "reinterpret", "tma_load",
           "tma_store", "Value", "warp_arrive", "warp_specialize"]

# TMA global -> shared ``(desc, coord, barrier, result, pred=True)``: ``async_load`` from 3.8;
# ``async_copy_global_to_shared`` up to 3.8, and a stub raising RuntimeError in 3.9.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# TMA shared -> global ``(desc, coord, src)``: ``async_store`` from 3.8;
# ``async_copy_shared_to_global`` up to 3.8, a RuntimeError stub in 3.9.
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# The consumers' synchronization without partition-wide ``bar.sync`` (Triton >= 3.9, where
# ``gl.inline_asm`` takes a shared memory descriptor and the wgmma wait op has the
# ``warpGroupLocal`` attribute; 3.6-3.8 have neither, and both names raise there):
# - ``warp_arrive(bar)``: one arrival per warp on an mbarrier (lane 0, after ``bar.warp.sync``,
#   which orders the lanes' earlier writes before its release), in place of Gluon's one-thread
#   ``mbarrier.arrive`` and the ``bar.sync`` of every thread of the partition before it; the
#   barrier then counts one arrival per warp.
# - ``mma_wait(n, deps, local)``: ``warpgroup_mma_wait(n, deps=deps)``; with ``local`` the wait
#   covers the calling warpgroup's own products only. In a partition of more than 4 warps the
#   lowering otherwise follows every wait with a ``bar.sync`` of all its warps, so that every
#   warpgroup's products are complete. Without it, a shared memory hazard across the
#   warpgroups (a store into a buffer another warpgroup's wgmma reads) gets its ``bar.sync``
#   from the membar pass, in front of the store, which follows the wait in program order.
HAS_LOCAL_SYNC = hasattr(gl, "inline_asm")

if HAS_LOCAL_SYNC:
    @gluon.jit
    def warp_arrive(bar):
        gl.inline_asm("{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
                      "bar.warp.sync -1; "
                      "@p mbarrier.arrive.release.cta.shared::cta.b64 _, [$0]; }",
                      "r", [bar], is_pure=False)
else:
    @builtin
    def warp_arrive(bar, _semantic=None):
        raise NotImplementedError("per-warp mbarrier arrives need Triton >= 3.9 (gl.inline_asm)")


@builtin
def mma_wait(num_outstanding, deps, local=False, _semantic=None):
    out = warpgroup_mma_wait(num_outstanding, deps=deps, _semantic=_semantic)
    if getattr(local, "value", local):
        if not HAS_LOCAL_SYNC:
            raise NotImplementedError("warpgroup-local wgmma waits need Triton >= 3.9")
        first = out[0] if isinstance(out, tuple) else out
        first.handle.set_attr("warpGroupLocal", _semantic.builder.get_unit_attr())
    return out


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



def bundle(cls):
    """``@bundle class Ring: smem: gl.shared_memory_descriptor; ...; STAGES: gl.constexpr``: a
    struct of Gluon values (tensors, shared memory and TMA descriptors, constexprs) that
    ``@gluon.jit`` functions and ``warp_specialize`` partitions take as one argument, built in a
    jit function as ``Ring(smem, ready, empty, STAGES)`` (fields in declaration order, or by
    keyword). It flattens into its fields in that order wherever it is passed, so a bundle
    carries the same values as the arguments it replaces. The constructor is generated: a
    value that is not a Gluon value (a constexpr argument, ``None``, a literal) is stored as a
    constexpr; a field typed :data:`Value` takes a tensor or such a constant (a pointer that
    may be absent). A class with its own ``__init__`` keeps it.

    Built on ``gluon.aggregate`` (3.8 on) or ``triton.language.core._aggregate`` (3.6, the
    decorator Gluon's own code imports there); both read the field types from the class's
    annotations, resolved here when the defining module postpones them."""
    cls.__annotations__ = inspect.get_annotations(cls, eval_str=True)
    if "__init__" not in vars(cls):
        names = tuple(cls.__annotations__)
        # The fields' names and types, read by the constructor so that they join the cache key
        # of every kernel that builds this bundle: Triton hashes an aggregate through its
        # constructor's source and the constexprs that source reads, and the generated
        # constructor's source is the same for every bundle (without this, a changed field type
        # reused the binaries compiled before the change).
        fields_key = gl.constexpr(repr(
            [(n, getattr(t, "__name__", repr(t))) for n, t in cls.__annotations__.items()]))

        def __init__(self, *args, **kwargs):
            assert fields_key is not None
            values = dict(zip(names, args), **kwargs)
            if len(args) > len(names) or set(values) != set(names):
                raise TypeError(f"{cls.__name__}{names}: got {len(args)} positional and "
                                f"{sorted(kwargs)} keyword arguments")
            for name in names:
                value = values[name]
                setattr(self, name, _gluon_value(value))

        cls.__init__ = __init__
    if not isinstance(vars(cls)["__init__"], JITCallable):
        cls.__init__ = constexpr_function(vars(cls)["__init__"])
    return _aggregate_impl(cls)


@constexpr_function
def _gluon_value(value):
    """``value`` as a bundle stores it: a Gluon value as it is, a tuple with each element so
    stored (a launch passes a tuple argument's specialized entries -- an int equal to 1 -- as
    plain ints, which a bundle could not flatten into a ``warp_specialize`` partition), anything
    else as a constexpr."""
    if isinstance(value, tl_tuple):
        return tl_tuple([_gluon_value(v) for v in value.values])
    return value if isinstance(value, Value) else gl.constexpr(value)


# A bundle field that holds a tensor or a constexpr standing in for one (``None`` for an absent
# pointer, ``0`` for an offset that is 0 in some specializations).
Value = base_value

# ``gluon.aggregate`` from 3.8; up to 3.9 also ``triton.language.core._aggregate``.
_aggregate_impl = getattr(gluon, "aggregate", None) or _aggregate
