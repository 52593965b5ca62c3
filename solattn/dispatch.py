"""Which kernel runs a call: one ordered route list per direction, one place that knows about
architectures.

Each direction (:data:`FORWARD`, :data:`FP8_FORWARD`, :data:`BACKWARD`, :data:`FLEX_FORWARD`,
:data:`FLEX_BACKWARD`) lists its routes (:class:`Route`) in order of preference: the decode kernels
for calls of few query rows, the Hopper (Gluon) kernel on sm_90, the portable Triton kernel for
the rest. Every kernel answers the same four questions, named on its route: ``covers`` (can it
run the call), ``preferred`` (is it the measured default), ``plan`` (what it needs prepared, or
why not) and ``run``. The first route that covers the call and is preferred runs it.

Here, and nowhere else:

* the device test: a Hopper route needs a CUDA device of compute capability
  :data:`solattn.device.HOPPER_ARCH` (:func:`hopper_unavailable`);
* forced backends: ``SOLATTN_BACKEND=portable|hopper``, the ``backend=`` argument of the
  internal entry points (:mod:`solattn.core`) or :func:`forced_backend` pick the route of that
  name (a forced kernel that cannot run the call raises ``NotImplementedError``);
* debug output: ``SOLATTN_DEBUG=1`` prints each decision and its reasons to stderr;
* the decision cache (dense calls: by everything the decision reads);
* the compile-failure fallback: a specialized kernel that does not compile on the user's
  Triton/driver warns once and the next route runs its calls for the rest of the process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from solattn.arch import known as known_arch
from solattn.arch import unknown_arch_note
from solattn.configs import small_q_decode
from solattn.device import HOPPER_ARCH, device_arch, interpreting, num_sms
from solattn.launch import PlanCache

BACKENDS = ("portable", "hopper")


# ---------------------------------------------------------------------------------------------
# Debug output and forced backends
# ---------------------------------------------------------------------------------------------

def debugging() -> bool:
    """``SOLATTN_DEBUG`` is set: the kernel decisions are printed (:func:`_debug`)."""
    return os.environ.get("SOLATTN_DEBUG", "0") not in ("", "0")


def _debug(msg: str) -> None:
    if debugging():
        print(f"[solattn] {msg}", file=sys.stderr)


_FORCED: list[str] = []


@contextlib.contextmanager
def forced_backend(name: str):
    """Run the calls inside the ``with`` block on backend ``name`` (``"portable"`` or
    ``"hopper"``), as ``SOLATTN_BACKEND`` would; for benchmarks and tests that compare kernels
    through the public API. A call the forced kernel cannot run raises ``NotImplementedError``."""
    requested_backend(name)  # validate
    _FORCED.append(name)
    try:
        yield
    finally:
        _FORCED.pop()


def requested_backend(backend: str | None = None) -> str | None:
    """The backend this call is forced onto (``backend``, else :func:`forced_backend`'s, else
    ``SOLATTN_BACKEND``), or None: the routes decide."""
    forced = _FORCED[-1] if _FORCED else None
    choice = backend or forced or os.environ.get("SOLATTN_BACKEND") or None
    if choice is not None and choice not in BACKENDS:
        raise ValueError(
            f"backend: expected one of {BACKENDS} (or SOLATTN_BACKEND unset), got {choice!r}"
        )
    return choice


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Route:
    """One kernel a direction may run on. The callables take the kernel's module (imported on
    first use: Gluon may be missing from the installed Triton) and the direction's arguments."""

    name: str                              # "decode" | "hopper" | "portable" (forced by name)
    kernel: str                            # the kernel's module
    run: Callable                          # (module, prepared, **kw) -> the direction's result
    covers: Optional[Callable] = None      # (module, *args) -> (ok, why not); None: every call
    preferred: Optional[Callable] = None   # (module, *args) -> (ok, why): the measured default
    plan: Optional[Callable] = None        # (module, *args) -> (prepared or None, why); None:
    #                                        the arguments are what run takes
    hopper: bool = False                   # a Gluon kernel: sm_90 CUDA devices only
    variant: Optional[Callable] = None     # (*args) -> what a compile specializes on: a compile
    #                                        failure falls back to the next route (else raises)
    per_call: bool = False                 # decided every call ahead of the cached decision (its
    #                                        test reads shapes the cache does not key); never forced
    label: str = ""                        # the kernel in warnings ("Hopper (Gluon) forward")


@dataclass(frozen=True)
class Direction:
    """The routes of one direction, in order of preference, and the key of its decision cache
    (None: decided every call, as the flex routes' plans keep their own outcomes per call
    signature, :func:`solattn.kernels.hopper.pipeline.kept_decision`)."""

    name: str
    routes: tuple
    key: Optional[Callable] = None         # (*args) -> everything the decision reads
    query: int = 0                         # where q is among the arguments (its device decides)
    per_call: tuple = field(init=False, repr=False)  # the routes decided every call

    def __post_init__(self):
        object.__setattr__(self, "per_call", tuple(r for r in self.routes if r.per_call))


@functools.lru_cache(maxsize=None)
def arch_of(device: torch.device) -> int:
    """:func:`solattn.device.device_arch`; a part :mod:`solattn.arch` does not list runs
    the most conservative config tables, and ``SOLATTN_DEBUG=1`` says so (once per device)."""
    arch = device_arch(device)
    if device.type == "cuda" and not known_arch(arch):
        _debug(unknown_arch_note(arch))
    return arch


_MODULES: dict = {}


def _module(route: Route):
    mod = _MODULES.get(route.kernel)
    if mod is None:
        mod = _MODULES[route.kernel] = importlib.import_module(route.kernel)
    return mod


def hopper_unavailable(arch: int, device: torch.device | None = None) -> str:
    """Why the Hopper (Gluon) kernels cannot run on an ``sm_{arch}`` GPU ("" when they can); with
    ``device``, also on that device (not the CPU, not under Triton's interpreter). The one place
    that tests the architecture for them."""
    if device is not None and (interpreting() or device.type != "cuda"):
        return "needs a CUDA device (not the interpreter)"
    if arch != HOPPER_ARCH:
        return f"needs sm_{HOPPER_ARCH}, device is sm_{arch}"
    return ""


# Small-q decode: a CUDA call of few query rows runs on the split-KV decode kernels.
_PREFILL_ROWS = 128  # query rows per CTA of the prefill forwards (small_q_decode's grid size)


def _small_q(mod, q, k, v, p) -> tuple[bool, str]:
    """Whether a CUDA call of few query rows goes to the decode kernels
    (:func:`solattn.configs.small_q_decode`): 16-bit, batched (not varlen or paged), no dropout,
    the output in q's dtype, every key used (no ``seqused_k``). A forced backend keeps its
    kernel; under Triton's interpreter (the CPU tests) calls take the prefill kernels."""
    if (not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or p.varlen
            or p.paged or p.has_dropout or p.out_dtype is not None or p.seqused_k is not None):
        return False, ""
    b, s_q, h, _ = q.shape
    ok = small_q_decode(s_q, k.shape[1], b * h * -(-s_q // _PREFILL_ROWS), num_sms(q.device))
    return ok, "few query rows: configs.small_q_decode"


def _hopper_fwd_variant(q, k, v, p) -> tuple:
    """What the Hopper forward specializes on (dtype, head dims, constexpr flags; a float32
    output takes the register epilogue)."""
    return ("hopper_fwd", q.dtype, q.shape[-1], v.shape[-1], p.has_left, p.has_right,
            p.has_softcap, p.has_alibi, p.varlen, p.seqused_k is not None,
            p.out_dtype not in (None, q.dtype))


def _hopper_bwd_variant(dout, q, k, v, out, lse, p) -> tuple:
    """What the Hopper backward specializes on (dtype, head dim, constexpr flags)."""
    return ("hopper_bwd", q.dtype, q.shape[-1], p.has_left, p.has_right, p.has_softcap,
            p.varlen, p.has_alibi)


def _forward_key(q, k, v, p) -> tuple:
    return (q.device, q.dtype, q.shape[-1], v.shape[-1], p.has_alibi, p.varlen, p.has_left,
            p.has_right, p.has_softcap, p.seqused_k is not None, p.paged, p.has_dropout,
            q.shape[:-1].numel() >= 2**31)


def _backward_key(dout, q, k, v, out, lse, p) -> tuple:
    # The dtypes, head dims, flags and scalars (launch_key, causal) and, for the int32 row
    # limit, the shapes.
    return (q.device, q.dtype, q.shape, v.shape, p.causal, p.launch_key)


_HOPPER_FORWARD = "solattn.kernels.hopper.forward_plan"

# forward: (q, k, v, p) -> (out, lse)
FORWARD = Direction("forward", (
    Route("decode", "solattn.kernels.triton.decode", covers=_small_q, per_call=True,
          run=lambda mod, a, return_lse: mod.decode_forward(*a, return_lse)),
    Route("hopper", _HOPPER_FORWARD, hopper=True, label="Hopper (Gluon) forward",
          covers=lambda mod, q, k, v, p: mod.covers(q, v, p),
          preferred=lambda mod, q, k, v, p: mod.preferred(q, v, p),
          variant=_hopper_fwd_variant,
          run=lambda mod, a, return_lse: mod.attn_fwd(*a, return_lse=return_lse)),
    Route("portable", "solattn.kernels.triton.forward",
          run=lambda mod, a, return_lse: mod.attn_fwd(*a, return_lse=return_lse,
                                                      arch=arch_of(a[0].device))),
), key=_forward_key)

# FP8 forward (float8_e4m3fn q, k, v): the Hopper kernel alone.
FP8_FORWARD = Direction("fp8 forward", (
    Route("hopper", _HOPPER_FORWARD, hopper=True, label="Hopper (Gluon) FP8 forward",
          covers=lambda mod, q, k, v, p: mod.covers(q, v, p),
          run=lambda mod, a, return_lse: mod.attn_fwd(*a, return_lse=return_lse)),
), key=_forward_key)

# backward: (dout, q, k, v, out, lse, p) -> (dq, dk, dv)
BACKWARD = Direction("backward", (
    Route("hopper", "solattn.kernels.hopper.backward_plan", hopper=True,
          label="Hopper (Gluon) backward",
          covers=lambda mod, dout, q, k, v, out, lse, p: mod.covers(q, v, lse, p),
          preferred=lambda mod, dout, q, k, v, out, lse, p: mod.preferred(q, p),
          variant=_hopper_bwd_variant,
          run=lambda mod, a, dlse, grads: mod.attn_bwd(*a, dlse=dlse, grads=grads)),
    Route("portable", "solattn.kernels.triton.backward",
          run=lambda mod, a, dlse, grads: mod.attn_bwd(*a, dlse=dlse,
                                                       arch=arch_of(a[1].device))),
), key=_backward_key, query=1)


# Flex forward: whether the Hopper flex kernel runs flex calls by default where it applies (it
# does). Faster than the portable flex kernel on every catalogue mod measured (H100,
# 2026-11-23, B4 H16 L4096 D128 bf16, kernel time: causal 511 vs 348 TFLOP/s, window 434 vs
# 317, document 222 vs 103, prefix-LM 517 vs 352, ALiBi 430 vs 309, softcap 320 vs 258); whole
# calls agree with the kernel since the eager path bypasses the custom ops (H200, 2026-11-26:
# docs/journal/2026-11-26.md).
def _flex_fwd_preferred(mod, *args) -> tuple[bool, str]:
    return True, "default: faster than the portable flex kernel on every catalogue mod measured"


# Flex backward, likewise: faster than the portable flex backward on every catalogue mod it
# runs (H200, 2026-11-26, B4 H16 L4096 D128 bf16, whole calls: causal 430 vs 304 TFLOP/s,
# window 363 vs 269, document 212 vs 169, prefix-LM 434 vs 301, ALiBi 411 vs 221, softcap 356
# vs 185; docs/journal/2026-11-26.md).
def _flex_bwd_preferred(mod, *args) -> tuple[bool, str]:
    return True, "default: faster than the portable flex backward on every catalogue mod run"


# flex forward: (q, k, v, fp) as (b, s, h, d) views -> (out (B, H, L, Ev), lse (B, H, L))
FLEX_FORWARD = Direction("flex forward", (
    Route("hopper", "solattn.kernels.hopper.flex_forward_plan", hopper=True,
          label="Hopper (Gluon) flex forward", preferred=_flex_fwd_preferred,
          plan=lambda mod, q, k, v, fp: mod.prepare(q, k, v, fp),
          run=lambda mod, prepared, fp: mod.attn_fwd_flex(prepared, fp)),
    Route("portable", "solattn.kernels.triton.forward",
          run=lambda mod, a, fp: mod.attn_fwd_flex(*a, arch=arch_of(a[0].device))),
))

# flex backward: (dout, q, k, v, out, lse, fp) as (b, s, h, d) views -> (dq, dk, dv, grads)
FLEX_BACKWARD = Direction("flex backward", (
    Route("hopper", "solattn.kernels.hopper.flex_backward_plan", hopper=True,
          label="Hopper (Gluon) flex backward", preferred=_flex_bwd_preferred,
          plan=lambda mod, do, q, k, v, out, lse, fp: mod.prepare(q, k, v, do, fp),
          run=lambda mod, prepared, out, lse, fp, dlse: mod.attn_bwd_flex(
              prepared, out, lse, fp, dlse=dlse)),
    Route("portable", "solattn.kernels.triton.backward",
          run=lambda mod, a, out, lse, fp, dlse: mod.attn_bwd_flex(
              *a, dlse=dlse, arch=arch_of(a[1].device))),
), query=1)


# ---------------------------------------------------------------------------------------------
# Choosing
# ---------------------------------------------------------------------------------------------

# (direction, *its key, forced choice) -> (route, the debug line saying why), or the
# NotImplementedError a forced route that cannot run raises. Emptied when a kernel variant
# turns out not to compile here (_BROKEN).
_DECISIONS = PlanCache()

# kernel variant -> the error's last line (one entry per variant that failed to compile)
_BROKEN: dict[tuple, str] = {}
_WARNED: set[str] = set()


def _try(route: Route, args: tuple, arch: int, device, forced: bool):
    """``(prepared, why)`` where ``route`` runs the call (``prepared`` None where it does not):
    the device, a failed compile of its variant, ``covers``, ``preferred`` (unless forced),
    ``plan``."""
    if route.hopper:
        why = hopper_unavailable(arch, device)
        if why:
            return None, why
    try:
        mod = _module(route)
    except ImportError as exc:  # Gluon missing from this Triton
        return None, f"Gluon unavailable ({exc})"
    if route.variant is not None:
        broken = _BROKEN.get(route.variant(*args))
        if broken is not None:
            return None, f"did not compile here ({broken})"
    why = "covered"
    if route.covers is not None:
        ok, why = route.covers(mod, *args)
        if not ok:
            return None, why
    if not forced and route.preferred is not None:
        ok, why = route.preferred(mod, *args)
        if not ok:
            return None, why
    if route.plan is not None:
        return route.plan(mod, *args)
    return args, why


def _decide(direction: Direction, args: tuple, choice, arch: int, device):
    """``(route, prepared, debug line)`` of a call, or the ``NotImplementedError`` a forced
    backend that cannot run it raises."""
    reasons = []
    for route in direction.routes:
        if route.per_call or (choice is not None and route.name != choice):
            continue
        prepared, why = _try(route, args, arch, device, forced=choice is not None)
        if route.hopper or route.covers or route.preferred or route.plan:  # not a catch-all
            reasons.append(f"{route.name}: {why}")
        if prepared is not None:
            line = f"{direction.name} -> {route.name} (arch sm_{arch}; {'; '.join(reasons)})"
            return route, prepared, line
        if choice is not None:
            return NotImplementedError(f"backend={choice!r} cannot run this {direction.name}: "
                                       f"{why}")
    return NotImplementedError(f"backend={choice!r} cannot run this {direction.name}: no "
                               f"{choice} kernel")


def choose(direction: Direction, args: tuple, backend: str | None = None):
    """``(route, prepared)``: the route that runs this call of ``direction`` (``args`` its
    arguments) and what its ``run`` takes. Raises ``NotImplementedError`` where a forced backend
    cannot run the call."""
    choice = requested_backend(backend)
    if choice is None:
        for route in direction.per_call:
            ok, why = route.covers(_module(route), *args)
            if ok:
                _debug(f"{direction.name} -> {route.name} ({why})")
                return route, args
    device = args[direction.query].device
    if direction.key is None:
        decision = _decide(direction, args, choice, arch_of(device), device)
        if isinstance(decision, NotImplementedError):
            raise decision
        route, prepared, line = decision
    else:
        key = (direction.name, *direction.key(*args), choice)
        decision = _DECISIONS.get(key)
        if decision is None:
            decision = _decide(direction, args, choice, arch_of(device), device)
            if not isinstance(decision, NotImplementedError):
                decision = decision[0], decision[2]  # (prepared: the arguments themselves)
            decision = _DECISIONS.put(key, decision)
        if isinstance(decision, NotImplementedError):
            raise NotImplementedError(*decision.args)  # (a new one: the kept one stays clean)
        (route, line), prepared = decision, args
    _debug(line)
    return route, prepared


def selected(direction: Direction, *args, backend: str | None = None) -> str:
    """The name of the route that runs this call of ``direction`` (:func:`choose`)."""
    return choose(direction, args, backend)[0].name


def default_route(direction: Direction, arch: int, *args) -> tuple[str, str]:
    """``(route name, why)``: the kernel a call of ``direction`` runs by default on an
    ``sm_{arch}`` GPU; the tensors' device is not looked at (``solattn warmup`` asks on the CPU
    for the GPU it compiles for), and the per-call routes (decode) are left out."""
    decision = _decide(direction, args, None, arch, None)
    return decision[0].name, decision[2]


# ---------------------------------------------------------------------------------------------
# Running, and the compile-failure fallback
# ---------------------------------------------------------------------------------------------

def _compile_errors() -> tuple[type, ...]:
    """Exceptions that mean "this kernel cannot be built or loaded here" (never a wrong input):
    front-end/IR errors, ptxas failures, and shared memory or registers beyond the device's."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors

    return tuple(e for e in (CompilationError, getattr(errors, "PTXASError", None),
                             getattr(errors, "OutOfResources", None)) if e is not None)


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():
        lines = [ln.strip() for ln in str(cause).strip().splitlines() if ln.strip()]
    return f"{type(cause or exc).__name__}: {lines[-1] if lines else ''}"


def _run(direction: Direction, args: tuple, backend: str | None, **kw):
    """Run the call on the route :func:`choose` picks. If a route with a ``variant`` fails to
    compile (or to load) with this Triton, the next route runs the call, one warning per kernel
    names the Triton version and the error, and the variant is not tried again in this process;
    a forced backend raises instead."""
    route, prepared = choose(direction, args, backend)
    while True:
        try:
            return route.run(_module(route), prepared, **kw)
        except _compile_errors() as exc:
            if route.variant is None:
                raise
            import triton

            why = _last_line(exc)
            msg = (f"solattn: the {route.label} kernel failed to compile with triton "
                   f"{triton.__version__}: {why}")
            _BROKEN[route.variant(*args)] = why
            _DECISIONS.clear()
            if requested_backend(backend) is not None:
                raise RuntimeError(msg) from exc
            failed = route
            route, prepared = choose(direction, args, backend)
            if failed.label not in _WARNED:
                _WARNED.add(failed.label)
                warnings.warn(f"{msg}. Falling back to the {route.name} kernel (slower) for "
                              "this process.", RuntimeWarning, stacklevel=4)
            _debug(f"{direction.name}: {failed.name} failed to compile ({why})")


def run_forward_kernel(q, k, v, p, *, return_lse: bool, backend: str | None = None):
    """The forward of validated, non-empty inputs -> ``(out, lse)`` (:data:`FORWARD`, or
    :data:`FP8_FORWARD` for float8_e4m3fn inputs)."""
    direction = FP8_FORWARD if q.dtype == torch.float8_e4m3fn else FORWARD
    return _run(direction, (q, k, v, p), backend, return_lse=return_lse)


def run_backward_kernel(dout, q, k, v, out, lse, p, *, dlse=None, backend: str | None = None,
                        grads=None):
    """The backward of validated, non-empty inputs -> ``(dq, dk, dv)`` (:data:`BACKWARD`).
    ``grads``: output tensors the Hopper kernel may write into
    (:func:`solattn.kernels.hopper.backward_plan.attn_bwd`); the caller copies what it did not."""
    return _run(BACKWARD, (dout, q, k, v, out, lse, p), backend, dlse=dlse, grads=grads)


def run_flex_forward(q, k, v, fp):
    """Flex forward of validated ``(b, s, h, d)`` views and their
    :class:`~solattn.flex.ops.FlexParams` -> ``(out (B, H, L, Ev), lse (B, H, L))``
    (:data:`FLEX_FORWARD`)."""
    return _run(FLEX_FORWARD, (q, k, v, fp), None, fp=fp)


def run_flex_backward(dout, q, k, v, out, lse, dlse, fp):
    """Flex backward of ``(b, s, h, d)`` views -> ``(dq, dk, dv, [fp32 gradients of the
    score_mod's captured tensors that require grad])`` (:data:`FLEX_BACKWARD`)."""
    return _run(FLEX_BACKWARD, (dout, q, k, v, out, lse, fp), None, out=out, lse=lse, fp=fp,
                dlse=dlse)
