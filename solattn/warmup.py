"""``solattn warmup``: compile the kernels of the common calls into Triton's on-disk cache, so that
the first call of a new process loads binaries instead of compiling them.

With an empty cache the first causal forward of a process compiles for 12.2 s on the H100, its
backward for 5.0 s, each new variant for 3.6 s. Triton keeps every binary in its cache directory
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``) under a hash of the kernel's source, its
specialization (argument types; which integer arguments are multiples of 16 or equal to 1, as
attributes; the constexpr values), the compile options, the target GPU, ``ptxas`` and the Triton
build. ``JITFunction.run`` computes that key at a process's first launch and loads the binary
when it is there. Each kernel also needs a small C launcher (its argument list packed for
``cuLaunchKernel``), which Triton builds with the host's C compiler at the kernel's first launch
in a process unless the same cache holds it: the warmup builds those too, where the CUDA driver
library is installed (``libcuda.so.1``). That is Triton 3.6; Triton 3.9 launches every kernel
through one launcher of its CUDA utility module (:func:`per_kernel_launchers`), which the
warmup builds into the cache as well.

The keys are not written down a second time here: the warmup runs the real launchers (the code a
call runs after validation, on tiny empty CPU tensors) with a stand-in Triton driver that names
the target GPU, and Triton's ``jit_cache_hook``, which receives every launch's specialization as
``JITFunction.run`` computed it and stops the launch. Each one is then compiled by
``JITFunction.preload``, Triton's replay of a recorded specialization (the JIT's own
``ASTSource``, options and target), in parallel worker processes. ``solattn aot`` reads its
specs off launches replayed the same way (:mod:`solattn.aot_calls`, through :func:`targeting`),
for its own list of calls: every flag set the kernel modules declare, bf16 only.

No GPU is needed (``--arch 90`` on a CPU machine compiles for the H100; the cache directory can
then be copied to machines with the same Triton install and environment, whose first launches
then build only the C launchers, unless the CUDA driver library was installed here).

The portable kernels and the Hopper forward do not specialize on lengths or head counts
(:data:`solattn.kernels.common.SHAPE_ARGS`) and the portable ones on the GQA group only as
"1 or more", so one binary per (dtype, head dim, flags, MHA or GQA) serves every shape, and
the warmup needs none.

Triton's cache key of a kernel depends on the order in which a process hashes kernels (a
callee's constexpr globals join its caller's key only if the callee was hashed first): every
launcher hashes all of solattn's kernels in one fixed order before its first launch
(:mod:`solattn.kernels.keys`), here and in the user's process alike. (Without it, on the H100
2026-11-23, the fp16 and the bf16 d256 Hopper forwards were warmed under keys a fresh process
did not compute.)

Covered: ``flash_attn_func`` forward and backward (and with ``--varlen``
``flash_attn_varlen_func``), causal and not, MHA and GQA/MQA, any lengths, contiguous or packed
inputs whose head dim is a multiple of 16; on sm_90 the kernels the dispatcher picks there (the
Hopper forward and, where it is the default, the Hopper backward). With ``--kvcache``:
``flash_attn_with_kvcache`` decode steps through its single fused launch (one query token per
sequence, or ``seqlen_q * group <= 16``; a contiguous cache, ``cache_seqlens`` a tensor or
None, with or without appending new tokens, any cache length, batch and split count). The same
kernels run ``flash_attn_func`` calls of few query rows (:func:`solattn.configs.small_q_decode`:
up to 8 rows, e.g. decoding without a cache API) and the transformers backend's decode steps:
programs that make such calls warm up with ``--kvcache`` too. Not covered (their first call
still compiles): windows, softcap, ALiBi, ``deterministic=True``, FlexAttention, paged caches,
rotary and the other separate-launch paths of ``flash_attn_with_kvcache``, a ``dout`` whose
last stride is not 1 (``out.sum().backward()``), and strides of 2**31 or more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_HEAD_DIMS = (64, 128, 256)  # the Hopper forward's head dims (solattn.configs' tables)
DEFAULT_DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class Case:
    """One family of calls: ``flash_attn_func`` (``flash_attn_varlen_func`` with ``varlen``) at
    one dtype, head dim (q, k and v alike) and causality, with as many KV heads as query heads
    or (``gqa``) fewer, forward and backward."""

    dtype: str
    head_dim: int
    causal: bool
    gqa: bool = False
    varlen: bool = False
    kvcache: bool = False  # flash_attn_with_kvcache decode steps instead (see _replay_kvcache)

    @property
    def label(self) -> str:
        return (f"{self.dtype} d{self.head_dim} {'causal' if self.causal else 'full'}"
                f"{' gqa' if self.gqa else ''}{' varlen' if self.varlen else ''}"
                f"{' kvcache' if self.kvcache else ''}")


def cases(head_dims=DEFAULT_HEAD_DIMS, dtypes=DEFAULT_DTYPES, gqa=True, varlen=False,
          kvcache=False) -> list[Case]:
    """Every combination, causal and not, MHA and (``gqa``) GQA/MQA; with ``varlen`` the packed
    calls as well, with ``kvcache`` the decode steps. The kernels specialize on a GQA group of 1
    only, so any group > 1 is one case."""
    layouts = [(False, False)] + ([(True, False)] if varlen else []) + \
        ([(False, True)] if kvcache else [])
    return [Case(dt, d, causal, g, lay, kv) for dt in dtypes for d in head_dims
            for lay, kv in layouts
            for g in ((False, True) if gqa else (False,)) for causal in (False, True)]


@dataclass(frozen=True)
class Job:
    """One kernel binary to compile: the launch that needs it and its recorded specialization."""

    label: str            # "<case> <fwd|bwd>: <kernel>", the first case that launched it
    fn: object            # the @triton.jit / @gluon.jit function
    specialization: str   # Triton's JSON (JITFunction.preload's input)
    key: str              # JITFunction.run's in-process key (specialization + options)


class _TargetDriver:
    """Stands in for Triton's active driver while the launchers run on CPU tensors: it names the
    GPU to compile for (``JITFunction.run`` asks the driver for the current device and target).
    Launches never reach it: the ``jit_cache_hook`` stops each one before its compile."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        # A real driver's target on that GPU (GPUTarget("cuda", 90, 32) on the H100): part of
        # the cache key.
        self.target = GPUTarget("cuda", arch, 32)
        # JITFunction keeps a binder per device: this key keeps ours apart from real devices'.
        self.device = f"solattn-warmup-sm{arch}"

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return None

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def targeting(arch: int, hook=None):
    """Inside the block Triton compiles for ``sm_{arch}`` (the stand-in driver) and calls
    ``hook`` as its ``jit_cache_hook`` (None: none). Both are restored on exit. Launchers take
    the ordinary ``kernel[grid]`` path inside (no cached launch plan's compiled kernel: those
    belong to the real driver's devices)."""
    from triton import knobs
    from triton.runtime.driver import driver

    from solattn.launch import ordinary_launches

    # driver.reset_active() would create the real driver, which raises on a machine without a
    # GPU: restore the previous value itself (None: Triton finds the real one when asked).
    prev_driver, prev_hook = driver._active, knobs.runtime.jit_cache_hook
    drv = _TargetDriver(arch)
    driver.set_active(drv)
    knobs.runtime.jit_cache_hook = hook
    try:
        with ordinary_launches():
            yield drv
    finally:
        knobs.runtime.jit_cache_hook = prev_hook
        driver._active = prev_driver


# Decode steps the kvcache cases replay: (label, new tokens appended, split count, whether
# cache_seqlens is given). Several splits (the merge inside the kernel) and one split (the
# kernel writes the output) are two binaries, and so are a step with and without an append,
# and with and without cache_seqlens (none: the whole cache, as in flash_attn_func's few-row
# calls, decode.decode_forward, and the transformers backend's decode steps); the split
# count's value and every length are not specialized on (decode.DECODE_SHAPE_ARGS).
_DECODE_STEPS = (("decode", 0, 1, True), ("decode split", 0, 3, True),
                 ("decode+append", 1, 1, True), ("decode+append split", 1, 3, True),
                 ("few-row forward", 0, 1, False), ("few-row forward split", 0, 3, False))


def _replay_kvcache(case: Case, arch: int, state: dict) -> None:
    """Run the single-launch decode step of ``flash_attn_with_kvcache`` (one query token, a
    contiguous cache, ``cache_seqlens`` as a tensor, no rotary) on empty CPU tensors, as a call
    on an ``sm_{arch}`` GPU would."""
    from solattn.kernels.triton.decode import fused_decode
    from solattn.params import AttnParams

    dtype, d = DTYPES[case.dtype], case.head_dim
    heads, heads_kv = (8, 2) if case.gqa else (2, 2)
    q = torch.empty(1, 1, heads, d, dtype=dtype)
    k_cache, v_cache = (torch.empty(1, 256, heads_kv, d, dtype=dtype) for _ in range(2))
    lens = torch.zeros(1, dtype=torch.int32)
    p = AttnParams(scale=d ** -0.5, causal=case.causal, group_size=heads // heads_kv)
    for label, s_new, splits, seqlens in _DECODE_STEPS:
        state["now"] = label
        k, v = (torch.empty(1, s_new, heads_kv, d, dtype=dtype) if s_new else None
                for _ in range(2))
        fused_decode(q, k_cache, v_cache, k, v, p, cache_seqlens=lens if seqlens else None,
                     cache_batch_idx=None,
                     cache_leftpad=None, block_table=None, num_splits=splits, arch=arch,
                     need_lse=False)


def _replay(case: Case, arch: int, state: dict) -> None:
    """Run ``case``'s forward and backward launchers on empty CPU tensors, as a call on an
    ``sm_{arch}`` GPU would (the forward the dispatcher picks there); ``state["now"]`` says
    which of the two is launching ("fwd", "bwd")."""
    from solattn.core import make_params
    from solattn.dispatch import BACKWARD, FORWARD, default_route
    from solattn.kernels.triton.backward import attn_bwd
    from solattn.kernels.triton.forward import attn_fwd

    if case.kvcache:
        return _replay_kvcache(case, arch, state)
    dtype, d, rows = DTYPES[case.dtype], case.head_dim, 64
    heads, heads_kv = 2, 1 if case.gqa else 2
    if case.varlen:
        q = torch.empty(rows, heads, d, dtype=dtype)
        k, v = (torch.empty(rows, heads_kv, d, dtype=dtype) for _ in range(2))
        cu = torch.tensor([0, rows // 2, rows], dtype=torch.int32)
        p = make_params(q, k, causal=case.causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=rows // 2, max_seqlen_k=rows // 2)
    else:
        q = torch.empty(1, rows, heads, d, dtype=dtype)
        k, v = (torch.empty(1, rows, heads_kv, d, dtype=dtype) for _ in range(2))
        p = make_params(q, k, causal=case.causal)
    state["now"] = "fwd"
    if default_route(FORWARD, arch, q, k, v, p)[0] == "hopper":
        from solattn.kernels.hopper.forward_plan import attn_fwd as hopper_fwd

        out, lse = hopper_fwd(q, k, v, p, return_lse=True)
        if not case.varlen:
            # The binary depends on the problem's size too: the schedule on the key count
            # (hopper_fwd_config: equal tiles persistent, short causal calls claiming tiles at
            # d=64 and d=128, at d=128 up to 8192 keys longest first in head groups, longer
            # causal ones one CTA per tile), and causal calls of few tiles run them longest
            # first over all heads (lpt_all_heads). The call above compiled the one this tiny
            # problem picks (with Triton >= 3.9 O from registers: few_tiles_config); these,
            # every other (the jobs are deduplicated).
            from solattn.configs.hopper_forward import (
                _STAGED_LPT_CAUSAL_MAX_KEYS,
                LPT_ALL_HEADS,
                hopper_fwd_config,
            )

            for seqlen_k in (rows, _STAGED_LPT_CAUSAL_MAX_KEYS, None):  # (None: long)
                cfg = hopper_fwd_config(d, p.has_right, p.has_softcap, seqlen_k=seqlen_k)
                for lpt in (cfg.lpt, LPT_ALL_HEADS) if p.causal else (cfg.lpt,):
                    hopper_fwd(q, k, v, p, return_lse=True,
                               config=dataclasses.replace(cfg, lpt=lpt))
    else:
        out, lse = attn_fwd(q, k, v, p, return_lse=True, arch=arch)
    state["now"] = "bwd"
    hopper_default = default_route(BACKWARD, arch, None, q, k, v, out, lse, p)[0] == "hopper"
    if case.varlen and not hopper_default:
        # Packed sequences of at most 1024 keys run the portable backward, longer ones the
        # Hopper one where it covers them (hopper.backward_plan.preferred): both binaries.
        attn_bwd(torch.empty_like(out), q, k, v, out, lse, p, arch=arch)
        long_p = dataclasses.replace(p, max_seqlen_k=1 << 20)  # (any long sequence)
        hopper_default = default_route(BACKWARD, arch, None, q, k, v, out, lse,
                                       long_p)[0] == "hopper"
        if not hopper_default:
            return
    if hopper_default:
        from solattn.kernels.hopper.backward_plan import attn_bwd as hopper_bwd
        from solattn.kernels.hopper.backward_plan import config_of

        hopper_bwd(torch.empty_like(out), q, k, v, out, lse, p)
        if p.causal:
            # Causal grids run in key-block order or, when small, longest first (lpt_grid), and
            # GQA groups split over CTAs on the smallest (fp32 partial dK/dV, one kernel for
            # every split count, and their reduce): every binary another shape may take.
            cfg = config_of(q.shape[-1], p)
            for lpt in (False, True):
                hopper_bwd(torch.empty_like(out), q, k, v, out, lse, p, gqa_splits=1,
                           config=dataclasses.replace(cfg, lpt=lpt))
            if p.group_size > 1:
                hopper_bwd(torch.empty_like(out), q, k, v, out, lse, p,
                           gqa_splits=p.group_size)
    else:
        attn_bwd(torch.empty_like(out), q, k, v, out, lse, p, arch=arch)


def collect_jobs(arch: int, case_list: list[Case]) -> list[Job]:
    """The distinct kernel binaries ``case_list`` launches on ``sm_{arch}``, in launch order."""
    from solattn.device import interpreting

    if interpreting():
        raise RuntimeError("solattn warmup: TRITON_INTERPRET=1 runs kernels in Triton's "
                           "interpreter, which compiles nothing: unset it")
    jobs: dict[tuple, Job] = {}
    state: dict = {}

    def hook(*, key, fn, compile, **_):
        fn = fn.jit_function
        ident = (fn.__module__, fn.__name__, key)
        if ident not in jobs:
            family = fn.__module__.split(".")[-2]  # "triton" (portable) or "hopper"
            label = f"{state['case'].label} {state['now']}: {family} {fn.__name__}"
            twins = sum(j.label.startswith(label) for j in jobs.values())
            label += f" #{twins + 1}" if twins else ""  # a kernel's 2nd pass (dK, then dV)
            jobs[ident] = Job(label, fn, compile["specialization_data"], key)
        return True  # handled: JITFunction.run neither compiles nor launches

    with targeting(arch, hook) as drv:
        try:
            for case in case_list:
                state["case"] = case
                _replay(case, arch, state)
        finally:
            for job in jobs.values():  # the stand-in device's binders
                job.fn.device_caches.pop(drv.device, None)
    return list(jobs.values())


# The current run's jobs, visible to forked workers (jit functions are not pickled: a worker
# gets an index and sends back numbers and text).
_JOBS: list[Job] = []


def launcher_support() -> str:
    """"" where Triton can build C launchers here (the CUDA driver library is installed), else
    why not. Also builds (or finds in the cache) Triton's own CUDA utility module, which every
    process that launches a kernel loads."""
    try:
        from triton.backends.nvidia.driver import CudaUtils, libcuda_dirs

        libcuda_dirs()
    except (ImportError, AssertionError, OSError) as exc:  # no driver library, no ldconfig
        return " ".join(str(exc).split()) or type(exc).__name__
    CudaUtils()
    return ""


def per_kernel_launchers() -> bool:
    """Whether this Triton compiles a C launcher for each kernel signature (``CudaLauncher``
    builds one from ``make_launcher``'s source: Triton 3.6). Triton 3.9 has none to build: its
    ``CudaLauncher`` launches through the one ``launch`` of the CUDA utility module, which it
    reads from the active driver (the stand-in one has no such module)."""
    from triton.backends.nvidia import driver as nvidia_driver

    return hasattr(nvidia_driver, "make_launcher")


def _compile_job(i: int, launchers: bool = True) -> tuple[int, float, bool, str]:
    """Compile job ``i`` (and with ``launchers`` its C launcher) into the cache ->
    ``(i, seconds, kernel already cached, error or "")``."""
    from triton import knobs

    hits = []
    knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)
    t0 = time.perf_counter()
    try:
        kernel = _JOBS[i].fn.preload(_JOBS[i].specialization)
        if launchers:
            from triton.backends.nvidia.driver import CudaLauncher

            CudaLauncher(kernel.src, kernel.metadata)
    except Exception as exc:  # report, do not stop the others
        return i, time.perf_counter() - t0, False, f"{type(exc).__name__}: " + " ".join(
            str(exc).split())[:300]
    finally:
        knobs.compilation.listener = None
    return i, time.perf_counter() - t0, bool(hits and hits[-1]), ""


def compile_jobs(arch: int, jobs: list[Job], n_procs: int | None = None, *, echo=print) -> int:
    """Compile ``jobs`` for ``sm_{arch}`` into Triton's cache in ``n_procs`` worker processes
    (default: the CPU count), printing one progress line per kernel as it finishes; returns the
    number that failed."""
    import functools

    _JOBS[:] = jobs
    n_procs = max(1, min(n_procs or os.cpu_count() or 1, len(jobs)))
    t0 = time.perf_counter()
    failed = cached = 0
    no_launchers = launcher_support()
    per_kernel = per_kernel_launchers()
    if no_launchers and per_kernel:
        echo(f"C launchers not built ({no_launchers}): a process's first launch of each kernel "
             "builds its own (about 1 s each)")
    job = functools.partial(_compile_job, launchers=per_kernel and not no_launchers)
    with targeting(arch):
        if n_procs == 1:
            results = map(job, range(len(jobs)))
        else:
            import multiprocessing

            pool = multiprocessing.get_context("fork").Pool(n_procs)
            results = pool.imap_unordered(job, range(len(jobs)))
        try:
            for done, (i, secs, hit, error) in enumerate(results, 1):
                what = "FAILED" if error else ("cached" if hit else f"compiled in {secs:5.1f}s")
                echo(f"[{done:>3}/{len(jobs)}, {len(jobs) - done:>3} left, "
                     f"{time.perf_counter() - t0:6.1f}s] {what:<18} {jobs[i].label}"
                     + (f"\n    {error}" if error else ""))
                failed += bool(error)
                cached += hit
        finally:
            if n_procs > 1:
                pool.close()
                pool.join()
            for job in jobs:
                job.fn.device_caches.pop(f"solattn-warmup-sm{arch}", None)
    echo(f"sm_{arch}: {len(jobs)} kernels in {time.perf_counter() - t0:.1f}s "
         f"({len(jobs) - cached - failed} compiled, {cached} already cached, {failed} failed)")
    return failed


def default_arch() -> int:
    """The compute capability of the visible GPU (90 for an H100)."""
    if not torch.cuda.is_available():
        raise ValueError("--arch: no CUDA GPU is visible, name the GPU to compile for "
                         "(e.g. --arch 90 for the H100, 80 for the A100)")
    from solattn.device import device_arch

    return device_arch(torch.device("cuda", torch.cuda.current_device()))


def run(archs=None, *, head_dims=DEFAULT_HEAD_DIMS, dtypes=DEFAULT_DTYPES, gqa=True,
        varlen=False, kvcache=False, only=None, list_only=False, jobs=None) -> int:
    """``solattn warmup``: compile (``list_only``: list) the kernels of :func:`cases` whose
    label contains ``only``, for each compute capability in ``archs`` (default: the visible
    GPU's); 0 when every kernel is in the cache afterwards."""
    from triton import knobs

    archs = list(archs) if archs else [default_arch()]
    case_list = cases(head_dims, dtypes, gqa, varlen, kvcache)
    failed = 0
    for arch in archs:
        selected = [j for j in collect_jobs(arch, case_list) if not only or only in j.label]
        print(f"solattn warmup: sm_{arch}, {'/'.join(dtypes)}, head dims "
              f"{'/'.join(map(str, head_dims))}{', gqa' if gqa else ''}"
              f"{', varlen' if varlen else ''}{', kvcache' if kvcache else ''}: "
              f"{len(selected)} kernels -> {knobs.cache.dir}", flush=True)
        if list_only:
            for job in selected:
                print(f"  {job.label}")
            continue
        failed += compile_jobs(arch, selected, jobs, echo=lambda s: print(s, flush=True))
    return 1 if failed else 0
