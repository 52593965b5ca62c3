"""Kernel launches without Triton's per-call launch work: compiled kernels cached per launch plan.

``kernel[grid](*args, **kwargs)`` (Triton's ``JITFunction.run``) does, on every call: read the
runtime knobs, bind the arguments, compute the specialization of each (dtype, 16-byte
divisibility of pointers and ints), build and look up the cache key, check the kernel's globals,
build launch metadata for the (empty) launch hooks and call them, and turn each TMA descriptor
into a ``CUtensorMap``. On the H100's host that is tens of microseconds a launch (BENCHMARKS.md,
"Host time"), more than a small problem's kernel.

The launchers build, once per problem (an ``lru_cache`` keyed by shapes, strides, dtypes and
flags), a :class:`Launch` per kernel: the kernel, its grid, and every argument after the leading
tensors. A :class:`Launch` compiles through the ordinary ``kernel[grid]`` path on its first call
on a device and keeps the compiled kernel Triton returns; later calls hand the tensors'
addresses (ints: no ``data_ptr()`` call and driver query per pointer in the launcher) straight
to that kernel's launcher (its C function where :func:`_compiled` can). The plan's key fixes
every non-tensor argument and every tensor's dtype, so the only specialization left to a call
is whether each pointer is 16-byte aligned: the cached kernel is the all-aligned one, and a call
with an unaligned pointer takes the ordinary path. Also on the ordinary path: Triton's
interpreter, registered launch hooks (profilers), a JIT cache hook, ``TRITON_DEBUG`` /
instrumentation modes, ``solattn warmup``'s stand-in driver (:func:`solattn.warmup.targeting`
runs inside :func:`ordinary_launches`), Triton versions outside the supported range, and any
compiled-kernel object whose launcher does not look as :func:`_shim_ok` expects.

:func:`ordinary_launches` turns the cache off inside a ``with`` block (tests compare both paths
bit for bit; benchmarks time both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from triton.runtime.jit import JITFunction

from solattn.device import interpreting, triton_version

# Triton releases whose launch internals the shim was read against (pyproject: >=3.6,<3.10):
# ``CompiledKernel.run(gridX, gridY, gridZ, stream, function, packed_metadata, launch_metadata,
# launch_enter_hook, launch_exit_hook, *bound_args)`` as ``JITFunction.run`` calls it, the
# ``function`` / ``packed_metadata`` attributes, hook chains with a ``calls`` list, and the
# driver's ``get_current_device`` / ``get_current_stream``.
_SHIM_VERSIONS = ((3, 6), (3, 9))
_LAUNCHER_PARAMS = ("gridX", "gridY", "gridZ", "stream", "function")

_disabled = 0           # > 0 inside ordinary_launches()
_runtime: Any = None    # (triton.knobs, get_current_device, get_current_stream) once resolved
_unsupported = ""       # why the fast path is off for this process ("" while it is on)


# CUDA driver API: the calling thread's stream-capture interaction mode
# (cuThreadExchangeStreamCaptureMode's CUstreamCaptureMode).
_CAPTURE_MODE_RELAXED = 2
_driver_lib: list = []  # [the libcuda handle, or None where it cannot be loaded], once loaded


def _libcuda():
    if not _driver_lib:
        import ctypes

        try:
            _driver_lib.append(ctypes.CDLL("libcuda.so.1"))
        except OSError:
            _driver_lib.append(None)
    return _driver_lib[0]


@contextlib.contextmanager
def relaxed_capture_mode():
    """Inside the ``with`` block this thread's CUDA calls may run while another thread captures
    a CUDA graph. torch captures in the driver's global mode, where a "potentially unsafe" call
    from any other thread (loading a compiled kernel's module, for one) is refused and
    invalidates the capture in progress (``cudaErrorStreamCaptureInvalidated`` at its end); in
    relaxed mode this thread's calls are allowed and the capture is left alone (torch's caching
    allocator does the same around its ``cudaMalloc``). For helper threads that compile and load
    kernels (:func:`solattn.flex.ops._prefetch_backward`). A no-op where libcuda is absent."""
    import ctypes

    lib = _libcuda()
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    if lib is None or lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) != 0:
        yield
        return
    try:
        yield
    finally:
        lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))  # (the previous mode back)


@contextlib.contextmanager
def ordinary_launches():
    """Launch through ``kernel[grid](...)`` inside the ``with`` block (no cached kernels)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def fast_path_status() -> str:
    """``"on"``, or why cached launches are off in this process."""
    _resolve_runtime()
    return _unsupported or "on"


def _resolve_runtime():
    """Bind Triton's knobs and its driver's device/stream getters once (the fast path's only
    per-call reads of Triton state), or record why the fast path cannot run here."""
    global _runtime, _unsupported
    if _runtime is not None or _unsupported:
        return _runtime
    if interpreting():
        _unsupported = "Triton's interpreter (TRITON_INTERPRET=1) runs the kernels"
        return None
    version = triton_version()
    if not _SHIM_VERSIONS[0] <= version <= _SHIM_VERSIONS[1]:
        _unsupported = f"triton {version[0]}.{version[1]} is outside the shim's {_SHIM_VERSIONS}"
        return None
    from triton import knobs
    from triton.runtime import driver

    active = driver.active
    rt = knobs.runtime
    if not all(hasattr(getattr(rt, h, None), "calls")
               for h in ("launch_enter_hook", "launch_exit_hook")):
        _unsupported = "triton's launch hooks are not hook chains"
        return None
    get_device = active.get_current_device
    if get_device is torch.cuda.current_device:
        # The same value without torch's lazy-initialization check (each fast launch follows
        # an ordinary one, so CUDA is initialized): ~3 us a launch on the H100's host.
        get_device = torch._C._cuda_getDevice
    _runtime = (knobs, get_device, active.get_current_stream)
    return _runtime


def _plain_runtime(knobs) -> bool:
    """No launch hooks (profilers), no JIT cache hook (``solattn warmup`` collects every
    launch's specialization through it), no debug or instrumentation mode: the knobs under which
    the cached kernels were compiled and may be launched without hooks."""
    rt = knobs.runtime
    return not (rt.launch_enter_hook.calls or rt.launch_exit_hook.calls or rt.debug
                or rt.jit_cache_hook is not None or knobs.compilation.instrumentation_mode
                or getattr(rt, "add_stages_inspection_hook", None) is not None)


_checked_launchers: set[type] = set()


def _shim_ok(kernel) -> str:
    """Why ``kernel`` (what ``kernel[grid](...)`` returned) cannot be relaunched directly, or ""."""
    if type(getattr(kernel, "_run", None)) in _checked_launchers:
        return ""
    for attr in ("run", "function", "packed_metadata"):
        if not hasattr(kernel, attr):
            return f"compiled kernel has no {attr!r}"
    try:
        params = list(inspect.signature(kernel.run).parameters)
    except (TypeError, ValueError):
        return "compiled kernel's launcher has no inspectable signature"
    if tuple(params[:len(_LAUNCHER_PARAMS)]) != _LAUNCHER_PARAMS:
        return f"compiled kernel's launcher takes {params[:6]}"
    _checked_launchers.add(type(kernel.run))
    return ""


@dataclass(frozen=True, slots=True)
class _Compiled:
    launch: Any           # Triton's C launch function, or the compiled kernel's launcher
    function: Any         # CUfunction handle on this device
    head: tuple           # the launch's arguments between ``function`` and the tensors
    tail: tuple           # every bound argument after the leading tensors, in signature order
    desc_meta: tuple = ()  # per leading TMA descriptor, the metadata ``launch`` encodes it with
    #                        (``launch`` then takes the encoded arguments: see _tensordesc_split)
    tuple_spec: tuple = ()  # _tuple_spec() of the tuple arguments the kernel was compiled for


def _tensordesc_split(wrapper, n_desc: int):
    """``(C launch, per-descriptor metadata)`` of Triton 3.6's ``wrap_handle_tensordesc``
    wrapper, or None. The wrapper walks every argument of every launch in Python and encodes
    each descriptor into a ``CUtensorMap`` (``make_tensordesc_arg``); where the kernel's
    descriptors are its first ``n_desc`` arguments and each has metadata, the launch can call
    the C function it wraps with the encodings, which :func:`_encoded` keeps on each
    descriptor object (a descriptor cached by base address is encoded once)."""
    code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or not cells or n_desc == 0:
        return None
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    launcher, indices, metas = (free.get(n) for n in ("launcher", "tensordesc_indices",
                                                      "tensordesc_meta"))
    if (not callable(launcher) or indices != set(range(n_desc)) or not metas
            or len(metas) != n_desc or any(not isinstance(m, dict) for m in metas)):
        return None
    return launcher, tuple(metas)


def _encoded(desc, meta) -> list:
    """The launch arguments of TMA descriptor ``desc`` under kernel metadata ``meta`` (Triton's
    own ``make_tensordesc_arg``), computed once per descriptor object and metadata."""
    enc = desc.__dict__.get("_solattn_encoded")
    if enc is None or enc[0] is not meta:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        enc = desc.__dict__["_solattn_encoded"] = (meta, make_tensordesc_arg(desc, meta))
    return enc[1]


def _compiled(kernel, tail: tuple, n_desc: int = 0) -> _Compiled:
    """How to relaunch ``kernel`` (what ``kernel[grid](...)`` returned, accepted by
    :func:`_shim_ok`). Triton 3.6's launcher (``CudaLauncher.__call__``) allocates no scratch
    when the kernel needs none and calls its C ``launch(gridX, gridY, gridZ, stream, function,
    launch_cooperative_grid, launch_pdl, global_scratch, profile_scratch, packed_metadata,
    launch_metadata, enter_hook, exit_hook, *args)``: such kernels are launched through that C
    function directly (its Python frame, which builds two closures and re-packs ~90 arguments,
    is ~1 us a launch; ``launch`` is the C function, or for kernels taking tensor descriptors
    Triton's wrapper of it, bypassed where :func:`_tensordesc_split` can: ``n_desc`` leading
    descriptors); any other launcher is called as ``JITFunction.run`` calls it."""
    run = kernel.run
    c_launch = getattr(run, "launch", None)
    if (triton_version() == (3, 6) and type(run).__name__ == "CudaLauncher"
            and callable(c_launch) and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0):
        head = (run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata,
                None, None, None)
        split = _tensordesc_split(c_launch, n_desc)
        if split is not None:
            return _Compiled(split[0], kernel.function, head, tail, split[1])
        return _Compiled(c_launch, kernel.function, head, tail)
    return _Compiled(run, kernel.function, (kernel.packed_metadata, None, None, None), tail)


def _tuple_spec(tuples) -> tuple:
    """What Triton specializes a kernel on in tuple arguments whose contents change from call to
    call (a flex call's BlockMask lists and captured tensors): per tensor its dtype and whether
    its address is 16-byte aligned, per int whether it is 1 (a constant), a multiple of 16, and
    32-bit. Equal specs give the same compiled kernel."""
    out = []
    for tup in tuples:
        for x in tup:
            if isinstance(x, torch.Tensor):
                out.append((x.dtype, x.data_ptr() & 15 == 0))
            elif isinstance(x, bool):
                out.append(x)
            elif isinstance(x, int):
                out.append((x == 1, x % 16 == 0, -2**31 <= x < 2**31))
            elif isinstance(x, tuple):
                out.append(_tuple_spec((x,)))
            else:
                out.append(type(x))
    return tuple(out)


class Launch:
    """One kernel launch of one problem with everything but the leading tensors fixed.

    ``Launch(kernel, grid, args, descriptors=n, **kwargs)`` then ``launch(*tensors)`` does what
    ``kernel[grid](*tensors, *args, **kwargs)`` does. ``args`` are the positional arguments after
    the tensors (scalars: strides, lengths, scales); ``kwargs`` the constexprs and launch options
    (``num_warps``, ``num_stages``). The first ``descriptors`` tensors are TMA descriptors (their
    specialization is their block shape and layout, fixed with the plan); the last ``tuples``
    are tuple arguments (tensors and ints, passed as they are: a cached launch checks that
    their :func:`_tuple_spec` is the compiled kernel's); the others are torch tensors. Whoever
    builds a ``Launch`` keys it by everything that determines ``grid``, ``args``, ``kwargs`` and
    the tensors' dtypes (see the module docstring).
    """

    __slots__ = ("kernel", "grid", "args", "kwargs", "descriptors", "tuples", "_compiled",
                 "_matched")

    def __init__(self, kernel, grid, args=(), *, descriptors: int = 0, tuples: int = 0,
                 **kwargs):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.args = tuple(args)
        self.kwargs = kwargs
        self.descriptors = descriptors
        self.tuples = tuples
        self._compiled: dict[int, _Compiled] = {}  # device index -> compiled kernel
        # device index -> (the compiled kernel, per tuple argument (the tuple object of the last
        # call whose specialization matched that kernel's, its offset in the flat spec)); held,
        # so their identities are not reused, and dropped with the kernel when it is replaced
        self._matched: dict[int, tuple] = {}

    def __call__(self, *tensors):
        global _runtime, _unsupported
        if not _disabled and _runtime is not None:
            knobs, get_device, get_stream = _runtime
            device = get_device()
            compiled = self._compiled.get(device)
            if compiled is not None and _plain_runtime(knobs):
                # Pointers go to the launcher as ints: it would otherwise call each tensor's
                # data_ptr() and ask the driver (cuPointerGetAttribute) whether it is device
                # memory, which the callers' validation (CUDA tensors on one device) settled.
                d, end = self.descriptors, len(tensors) - self.tuples
                ptrs = [t.data_ptr() for t in tensors[d:end]]
                misaligned = 0
                for ptr in ptrs:
                    misaligned |= ptr
                tuples = tensors[end:]
                if misaligned & 15 == 0 and (not tuples
                                             or self._tuples_match(device, compiled, tuples)):
                    g0, g1, g2 = self.grid
                    descs = tensors[:d]
                    if compiled.desc_meta:
                        descs = [a for t, m in zip(descs, compiled.desc_meta)
                                 for a in _encoded(t, m)]
                    compiled.launch(g0, g1, g2, get_stream(device), compiled.function,
                                    *compiled.head, *descs, *ptrs, *tuples, *compiled.tail)
                    return
        kernel = self.kernel[self.grid](*tensors, *self.args, **self.kwargs)
        if (_disabled or kernel is None or not isinstance(self.kernel, JITFunction)
                or _resolve_runtime() is None):
            # (a stand-in for the kernel, e.g. a test's spy, sees every launch; None: a JIT
            # cache hook handled the launch, nothing was compiled)
            return
        knobs, get_device, _ = _runtime
        if _plain_runtime(knobs) and self._aligned(tensors):
            why = _shim_ok(kernel)
            if why:  # this Triton's internals differ: ordinary launches for the process
                _runtime, _unsupported = None, why
                return
            compiled = _compiled(kernel, self._tail(len(tensors)), self.descriptors)
            if self.tuples:
                compiled = dataclasses.replace(
                    compiled, tuple_spec=_tuple_spec(tensors[len(tensors) - self.tuples:]))
            self._compiled[get_device()] = compiled

    def _tuples_match(self, device, compiled, tuples) -> bool:
        """``_tuple_spec(tuples) == compiled.tuple_spec``, skipping the tuples that are the very
        objects which matched last time at the same place of the flat spec (a BlockMask's
        lists, built once: ``KernelLists``). Each element of a tuple argument is one entry of
        the flat spec."""
        spec = compiled.tuple_spec
        memo = self._matched.get(device)
        if memo is None or memo[0] is not compiled or len(memo[1]) != len(tuples):
            memo = self._matched[device] = (compiled, [None] * len(tuples))
        matched = memo[1]
        start = 0
        for i, tup in enumerate(tuples):
            end = start + len(tup)
            seen = matched[i]
            if seen is None or seen[0] is not tup or seen[1] != start:
                if _tuple_spec((tup,)) != spec[start:end]:
                    return False
                matched[i] = (tup, start)
            start = end
        return start == len(spec)

    def _aligned(self, tensors) -> bool:
        """Every torch tensor's pointer 16-byte aligned: Triton's specialization ("D") of the
        kernel the cache holds."""
        misaligned = 0
        for t in tensors[self.descriptors:len(tensors) - self.tuples]:
            misaligned |= t.data_ptr()
        return misaligned & 15 == 0

    def _tail(self, n_tensors: int) -> tuple:
        """The bound arguments after the tensors, in the kernel's signature order (constexprs
        included, as ``JITFunction.run`` passes them to the launcher)."""
        params = list(inspect.signature(self.kernel.fn).parameters.values())
        tail = list(self.args)
        for param in params[n_tensors + len(self.args):]:
            if param.name in self.kwargs:
                tail.append(self.kwargs[param.name])
            elif param.default is not inspect.Parameter.empty:
                tail.append(param.default)
            else:
                raise TypeError(f"{self.kernel}: missing argument {param.name!r}")
        return tuple(tail)


class _Base:
    """Stands in for a tensor as the base of a cached TMA descriptor: its address and dtype
    (all a descriptor reads of its base), without keeping the tensor's memory alive."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype):
        self._ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self._ptr


# Addresses a DescriptorCache (one tensor role of one plan) keeps: a model calls each plan once
# per layer with that layer's tensors, and the caching allocator hands the same addresses back
# step after step, so the cache must hold every layer's (a 1.1B Llama's 22 layers' q, ...) or
# each call misses and re-encodes its descriptors (docs/journal/2026-11-27.md). An entry
# is about a kilobyte (the descriptor and its encoded tensor map).
DESCRIPTOR_CACHE_SIZE = 256


class DescriptorCache:
    """TMA descriptors of one tensor role of one plan, by base address.

    ``make(base)`` builds the descriptor (shape, strides, block shape and layout are the plan's);
    a hit skips the descriptor's construction and validation, and a new 16-byte aligned address
    copies the first descriptor's validated fields with the new base (construction validates
    rank, block shape, strides and layout, which are the plan's, and the base's alignment: ~4
    us a descriptor on the H100's host, paid by every call whose tensors are new, such as a
    decode step's growing cache). At most ``size`` addresses are kept (default
    :data:`DESCRIPTOR_CACHE_SIZE`), then the cache starts over.
    """

    __slots__ = ("_make", "_by_ptr", "_size", "_fields")

    def __init__(self, make, size: int | None = None):
        self._make, self._by_ptr, self._fields = make, {}, None
        self._size = DESCRIPTOR_CACHE_SIZE if size is None else size

    def __call__(self, t):
        ptr = t.data_ptr()
        desc = self._by_ptr.get(ptr)
        if desc is None:
            if len(self._by_ptr) >= self._size:
                self._by_ptr.clear()
            base = _Base(ptr, t.dtype)
            fields = self._fields
            if fields is not None and ptr & 15 == 0 and fields[1]["base"].dtype == t.dtype:
                desc = object.__new__(fields[0])
                desc.__dict__.update(fields[1])
                desc.base = base
            else:
                desc = self._make(base)
                if self._fields is None and hasattr(desc, "__dict__"):
                    self._fields = (type(desc), dict(desc.__dict__))
            self._by_ptr[ptr] = desc
        return desc


_PLAN_CACHES: list[PlanCache] = []


def clear_plans() -> None:
    """Empty every plan cache: plans are derived from config tables and kernel objects, so code
    that replaces those at run time (tests that patch them) clears the plans built before."""
    for cache in _PLAN_CACHES:
        cache.clear()


class PlanCache(dict):
    """Launch plans by key, at most ``size`` of them: emptied when full (keys that keep changing,
    such as varlen maximum lengths, would otherwise grow it without bound; a dropped plan costs
    one ordinary launch to rebuild)."""

    def __init__(self, size: int = 256):
        super().__init__()
        self.size = size
        _PLAN_CACHES.append(self)

    def put(self, key, plan):
        if len(self) >= self.size:
            self.clear()
        self[key] = plan
        return plan


def contiguous_strides(shape) -> tuple[int, ...]:
    """Strides of ``torch.empty(shape)`` (row-major; a dimension of size 0 counts as 1, as in
    torch), so a plan knows the strides of the buffers a call allocates."""
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
