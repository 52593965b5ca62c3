"""Which kernel runs a call: one registry, one place that knows about architectures.

Forward and backward are chosen separately (:func:`select_forward`, :func:`select_backward`):
each Hopper kernel covers its own set of calls, and the portable kernel runs the rest.
``SOLATTN_BACKEND=portable|hopper`` (or the ``backend=`` argument of the internal entry points,
or :func:`forced_backend`) forces a choice for both; ``SOLATTN_DEBUG=1`` prints each decision
and its reason to stderr.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import torch

from solattn.configs import interpreting, small_q_decode
from solattn.launch import PlanCache

BACKENDS = ("portable", "hopper")


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> int:
    """Compute capability as an int (90 for sm_90). CPU tensors (the interpreter) report 90."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``. CPU tensors (the interpreter) report a small GPU
    of 4 SMs, so work-splitting heuristics still split in CPU tests."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def debugging() -> bool:
    """``SOLATTN_DEBUG`` is set: the backend decisions are printed (:func:`_debug`)."""
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
    forced = _FORCED[-1] if _FORCED else None
    choice = backend or forced or os.environ.get("SOLATTN_BACKEND") or None
    if choice is not None and choice not in BACKENDS:
        raise ValueError(
            f"backend: expected one of {BACKENDS} (or SOLATTN_BACKEND unset), got {choice!r}"
        )
    return choice


# Every input of select_forward's (select_backward's) decision -> (kernel name, the debug line
# saying why).
# Emptied when a kernel variant turns out not to compile here (_BROKEN).
_SELECTED = PlanCache()


def select_forward(q: torch.Tensor, v: torch.Tensor, p, backend: str | None = None) -> str:
    """Name of the forward kernel for this call (:class:`solattn.params.AttnParams` ``p``):
    ``"hopper"`` where it covers it, else ``"portable"``."""
    choice = requested_backend(backend)
    key = (q.device, q.dtype, q.shape[-1], v.shape[-1], p.has_alibi, p.varlen, p.has_left,
           p.has_right, p.has_softcap, p.seqused_k is not None, p.paged, p.has_dropout,
           q.shape[:-1].numel() >= 2**31, choice)
    decision = _SELECTED.get(key)
    if decision is None:
        decision = _SELECTED.put(key, _decide_forward(q, v, p, choice))
    _debug(decision[1])
    return decision[0]


def _decide_forward(q, v, p, choice) -> tuple[str, str]:
    arch = device_arch(q.device)
    hopper_ok, why = _hopper_covers(q, v, p, arch)
    if hopper_ok and _hopper_variant(q, v, p) in _BROKEN:
        hopper_ok, why = False, f"did not compile here ({_BROKEN[_hopper_variant(q, v, p)]})"
    if choice == "hopper" and not hopper_ok:
        raise NotImplementedError(f"backend='hopper' cannot run this call: {why}")
    if choice is None:
        if hopper_ok:  # covered: the measured default?
            from solattn.kernels.hopper.forward import preferred

            hopper_ok, why = preferred(q, v, p)
        choice = "hopper" if hopper_ok else "portable"
    return choice, f"forward -> {choice} (arch sm_{arch}; hopper: {why})"


def _hopper_covers(q, v, p, arch) -> tuple[bool, str]:
    """Whether the Hopper forward can run this call here (forced or by default)."""
    if interpreting() or q.device.type != "cuda":
        return False, "needs a CUDA device (not the interpreter)"
    return hopper_covers_on(arch, q, v, p, default=False)


def hopper_covers_on(arch: int, q, v, p, default: bool = True) -> tuple[bool, str]:
    """Whether the Hopper forward runs this call on an ``sm_{arch}`` GPU, and why not: by
    default (``default``: it covers the call and is the measured default,
    :func:`solattn.kernels.hopper.forward.preferred`) or when forced (it covers the call); the
    tensors' device is not looked at (``solattn warmup`` asks on the CPU for the GPU it
    compiles for)."""
    if arch != 90:
        return False, f"needs sm_90, device is sm_{arch}"
    try:
        from solattn.kernels.hopper import forward as hopper_forward
    except ImportError as exc:  # Gluon missing from this Triton
        return False, f"Gluon unavailable ({exc})"
    ok, why = hopper_forward.covers(q, v, p)
    return hopper_forward.preferred(q, v, p) if ok and default else (ok, why)


# ---------------------------------------------------------------------------------------------
# Compile failures: a specialized kernel that does not compile on the user's Triton/driver must
# not break the call. The portable kernel runs instead; the decision is kept for the process.
# ---------------------------------------------------------------------------------------------

# kernel variant -> the error's last line (one entry per variant that failed to compile)
_BROKEN: dict[tuple, str] = {}
_WARNED: set[str] = set()


def _compile_errors() -> tuple[type, ...]:
    """Exceptions that mean "this kernel cannot be built or loaded here" (never a wrong input):
    front-end/IR errors, ptxas failures, and shared memory or registers beyond the device's."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors

    return tuple(e for e in (CompilationError, getattr(errors, "PTXASError", None),
                             getattr(errors, "OutOfResources", None)) if e is not None)


def _hopper_bwd_variant(q, p) -> tuple:
    """What the Hopper backward specializes on (dtype, head dim, constexpr flags)."""
    return ("hopper_bwd", q.dtype, q.shape[-1], p.has_left, p.has_right, p.has_softcap,
            p.varlen, p.has_alibi)


def _hopper_variant(q, v, p) -> tuple:
    """What the Hopper forward specializes on (dtype, head dims, constexpr flags; a float32
    output takes the register epilogue)."""
    return ("hopper_fwd", q.dtype, q.shape[-1], v.shape[-1], p.has_left, p.has_right,
            p.has_softcap, p.has_alibi, p.varlen, p.seqused_k is not None,
            p.out_dtype not in (None, q.dtype))


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():
        lines = [ln.strip() for ln in str(cause).strip().splitlines() if ln.strip()]
    return f"{type(cause or exc).__name__}: {lines[-1] if lines else ''}"


_PREFILL_ROWS = 128  # query rows per CTA of the prefill forwards (small_q_decode's grid size)


def _small_q(q, k, p) -> bool:
    """Whether a CUDA call of few query rows goes to the decode kernels
    (:func:`solattn.configs.small_q_decode`): 16-bit, batched (not varlen or paged), no dropout,
    the output in q's dtype, every key used (no ``seqused_k``). A forced backend keeps its
    kernel; under Triton's interpreter (the CPU tests) calls take the prefill kernels."""
    if (not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or p.varlen
            or p.paged or p.has_dropout or p.out_dtype is not None or p.seqused_k is not None):
        return False
    b, s_q, h, _ = q.shape
    return small_q_decode(s_q, k.shape[1], b * h * -(-s_q // _PREFILL_ROWS), num_sms(q.device))


def run_forward_kernel(q, k, v, p, *, return_lse: bool, backend: str | None = None):
    """Launch the forward kernel :func:`select_forward` picks -> ``(out, lse)``; calls of few
    query rows (:func:`_small_q`) run on the decode kernels.

    If the Hopper kernel fails to compile (or to load) with this Triton, the call runs on the
    portable kernel, one warning per kernel names the Triton version and the error, and the
    variant is not tried again in this process. A forced ``backend="hopper"`` (or
    ``SOLATTN_BACKEND=hopper``) raises instead.
    """
    if _small_q(q, k, p) and requested_backend(backend) is None:
        from solattn.kvcache import decode_forward

        _debug("forward -> decode kernels (few query rows: configs.small_q_decode)")
        return decode_forward(q, k, v, p, return_lse)
    name = select_forward(q, v, p, backend)
    if name == "hopper":
        from solattn.kernels.hopper.forward import attn_fwd as hopper_fwd

        try:
            return hopper_fwd(q, k, v, p, return_lse=return_lse)
        except _compile_errors() as exc:
            import triton

            why = _last_line(exc)
            msg = (f"solattn: the Hopper (Gluon) forward kernel failed to compile with triton "
                   f"{triton.__version__}: {why}")
            _BROKEN[_hopper_variant(q, v, p)] = why
            _SELECTED.clear()
            if requested_backend(backend) == "hopper":
                raise RuntimeError(msg) from exc
            if "hopper_fwd" not in _WARNED:
                _WARNED.add("hopper_fwd")
                warnings.warn(f"{msg}. Falling back to the portable Triton kernel (slower) for "
                              "this process.", RuntimeWarning, stacklevel=3)
            _debug(f"forward -> portable (hopper failed to compile: {why})")
    from solattn.kernels.triton.forward import attn_fwd

    return attn_fwd(q, k, v, p, return_lse=return_lse, arch=device_arch(q.device))


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

def _hopper_bwd_covers(q, v, lse, p, arch) -> tuple[bool, str]:
    if interpreting() or q.device.type != "cuda":
        return False, "needs a CUDA device (not the interpreter)"
    if arch != 90:
        return False, f"needs sm_90, device is sm_{arch}"
    try:
        from solattn.kernels.hopper import backward as hopper_backward
    except ImportError as exc:  # Gluon missing from this Triton
        return False, f"Gluon unavailable ({exc})"
    return hopper_backward.covers(q, v, lse, p)


def hopper_bwd_default_on(arch: int, q, v, lse, p) -> tuple[bool, str]:
    """Whether the Hopper backward runs this call by default on an ``sm_{arch}`` GPU (it covers
    the call and is the measured default), and why not; the tensors' device is not looked at
    (``solattn warmup`` asks on the CPU for the GPU it compiles for)."""
    if arch != 90:
        return False, f"needs sm_90, not sm_{arch}"
    try:
        from solattn.kernels.hopper import backward as hopper_backward
    except ImportError as exc:  # Gluon missing from this Triton
        return False, f"Gluon unavailable ({exc})"
    ok, why = hopper_backward.covers(q, v, lse, p)
    return hopper_backward.preferred(q, p) if ok else (ok, why)


def select_backward(q: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, p,
                    backend: str | None = None) -> str:
    """Name of the backward kernel for this call: ``"hopper"`` where it covers the call and is
    the measured default (:func:`solattn.kernels.hopper.backward.preferred`), else
    ``"portable"``. A forced ``"hopper"`` runs it wherever it covers the call."""
    choice = requested_backend(backend)
    # The decision reads the dtypes, head dims, flags and scalars (launch_key, causal) and, for
    # the int32 row limit, the shapes; cached as select_forward's is.
    key = ("backward", q.device, q.dtype, q.shape, v.shape, p.causal, p.launch_key, choice)
    decision = _SELECTED.get(key)
    if decision is None:
        decision = _SELECTED.put(key, _decide_backward(q, v, lse, p, choice))
    if isinstance(decision, NotImplementedError):
        raise decision
    _debug(decision[1])
    return decision[0]


def _decide_backward(q, v, lse, p, choice) -> tuple[str, str] | NotImplementedError:
    """select_backward's decision, or the error a forced ``"hopper"`` that cannot run raises."""
    arch = device_arch(q.device)
    hopper_ok, why = _hopper_bwd_covers(q, v, lse, p, arch)
    if hopper_ok and _hopper_bwd_variant(q, p) in _BROKEN:
        hopper_ok, why = False, f"did not compile here ({_BROKEN[_hopper_bwd_variant(q, p)]})"
    if choice == "hopper" and not hopper_ok:
        return NotImplementedError(f"backend='hopper' cannot run this backward: {why}")
    if choice is None:
        if hopper_ok:
            from solattn.kernels.hopper.backward import preferred

            hopper_ok, why = preferred(q, p)
        choice = "hopper" if hopper_ok else "portable"
    return choice, f"backward -> {choice} (arch sm_{arch}; hopper: {why})"


def run_backward_kernel(dout, q, k, v, out, lse, p, *, dlse=None, backend: str | None = None,
                        grads=None):
    """Launch the backward kernel :func:`select_backward` picks -> ``(dq, dk, dv)``; a Hopper
    kernel that fails to compile falls back to the portable one as in
    :func:`run_forward_kernel`. ``grads``: output tensors the Hopper kernel may write into
    (:func:`solattn.kernels.hopper.backward.attn_bwd`); the caller copies what it did not."""
    name = select_backward(q, v, lse, p, backend)
    if name == "hopper":
        from solattn.kernels.hopper.backward import attn_bwd as hopper_bwd

        try:
            return hopper_bwd(dout, q, k, v, out, lse, p, dlse=dlse, grads=grads)
        except _compile_errors() as exc:
            import triton

            why = _last_line(exc)
            msg = (f"solattn: the Hopper (Gluon) backward kernel failed to compile with triton "
                   f"{triton.__version__}: {why}")
            _BROKEN[_hopper_bwd_variant(q, p)] = why
            _SELECTED.clear()
            if requested_backend(backend) == "hopper":
                raise RuntimeError(msg) from exc
            if "hopper_bwd" not in _WARNED:
                _WARNED.add("hopper_bwd")
                warnings.warn(f"{msg}. Falling back to the portable Triton kernel (slower) for "
                              "this process.", RuntimeWarning, stacklevel=3)
            _debug(f"backward -> portable (hopper failed to compile: {why})")
    from solattn.kernels.triton.backward import attn_bwd

    return attn_bwd(dout, q, k, v, out, lse, p, dlse=dlse, arch=device_arch(q.device))
