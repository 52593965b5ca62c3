"""Ahead-of-time compilation of every kernel configuration, on a machine without a GPU.

``solattn aot --arch 90 [--arch 80]`` compiles, with Triton's own compiler and the ``ptxas`` bundled
in the Triton wheel, each configuration the dispatcher can choose, then reads the cubin:
registers, spill bytes (stack frame / local memory), shared memory, and which tensor-core and copy
instructions the SASS contains (HMMA, HGMMA, UTMALDG, LDGSTS). A compile failure is an error, and
so is a spill that costs time: any local-memory access (``LDL``/``STL``) inside an innermost loop
of the SASS (the key/query loops), and any spill at all in a Gluon kernel. Local-memory accesses
outside the innermost loops (a few values saved before a loop and reloaded after it, once per
program) are reported as ``cold`` with their count and accepted. CI runs this so that GPU code
that no longer compiles, or spills where it matters, cannot land.

Two more checks per architecture (the limits of :mod:`solattn.arch`): a kernel's shared
memory must fit one block's limit on that part (99 KB on sm_86/89/120), and a kernel meant to use
the tensor cores must contain that part's tensor-core instructions (HMMA; HGMMA on sm_90;
the tcgen05 ``UTC*MMA`` family on sm_100). sm_80 and sm_90 compile every spec; the other
architectures a representative subset (:data:`REPRESENTATIVE`), to keep CI's time in check.

Results are cached per spec by content (:mod:`solattn.aot_cache`): the source files the kernel
imports, the spec's signature, constexprs and options, the architecture and the Triton version.
A kernel whose sources did not change is not compiled again; ``SOLATTN_AOT_CACHE=0`` turns the
cache off. The cache lives in ``$SOLATTN_CI_CACHE/aot`` (default ``~/.cache/solattn-ci/aot``).

Each spec is a real launch: :mod:`solattn.aot_calls` runs the launchers (the code a call runs
after validation) on tiny CPU tensors, for the flag sets kernel modules declare as data
(``AOT_VARIANTS``), through the path ``solattn warmup`` uses (a stand-in driver that names the
GPU and Triton's ``jit_cache_hook``), and reads each launch's signature, constexprs,
specialization attributes and options as ``JITFunction.run`` computed them. Kernel modules
never import this tool.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from solattn.aot_cache import ResultCache
from solattn.aot_calls import AotSpec as AotSpec  # re-exported: the ladder builds specs
from solattn.arch import ARCHS, WGMMA_OPS, arch_limits, tensor_op_count
from solattn.kernels.sass import bin_dir, hot_local_accesses

SASS_OPS = ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "UTMASTG", "LDGSTS")
# tcgen05.mma (sm_100): UTCHMMA (16-bit), UTCQMMA (FP8), UTCIMMA (int8), ...; counted by name.
_UTC_MMA = re.compile(r"\bUTC\w*MMA\b")


def make_signature(fn, *, pointers: dict, constexprs: dict, floats=(), unit=()):
    """Signature of a ``@triton.jit`` function: ``pointers`` {name: "*bf16"}, ``constexprs``
    {name: value}, ``floats`` names of fp32 scalars, ``unit`` names of int arguments that are 1
    (contiguous last-dim strides: Triton specializes an int equal to 1 the same way at run time).
    Every other argument is an ``i32`` scalar. Returns ``(signature, constexprs)``.
    """
    params = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    sig, consts = {}, dict(constexprs)
    for name in params:
        if name in pointers:
            sig[name] = pointers[name]
        elif name in consts:
            sig[name] = "constexpr"
        elif name in unit:
            sig[name] = "constexpr"
            consts[name] = 1
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    missing = set(constexprs) - set(params)
    if missing:
        raise KeyError(f"constexprs not in {fn}: {sorted(missing)}")
    return sig, consts


@dataclass
class AotResult:
    spec: AotSpec
    arch: int
    ok: bool
    error: str = ""
    registers: int = 0
    spill_bytes: int = 0
    hot_spills: int = 0  # LDL/STL instructions inside an innermost loop
    shared: int = 0
    sass_ops: dict = field(default_factory=dict)
    cached: bool = False  # read from the AOT cache, not compiled in this run

    # the fields a cache entry holds (everything but the spec)
    CACHED = ("ok", "error", "registers", "spill_bytes", "hot_spills", "shared", "sass_ops")

    @property
    def spilled(self) -> bool:
        """A spill inside an innermost loop, or any spill in a Gluon kernel; not a spill the
        spec lists as measured and accepted."""
        if self.spec.accepted_spill:
            return False
        return self.hot_spills > 0 or (self.spec.gluon and self.spill_bytes > 0)

    def problems(self) -> list[str]:
        """Why this result fails the gate: a compile error, a costly spill (:attr:`spilled`),
        shared memory beyond one block's limit on the part, no tensor-core instruction in a
        kernel meant to use them."""
        if not self.ok:
            return [self.error]
        out = ["spill in a loop"] if self.spilled else []
        limit = arch_limits(self.arch).smem_per_block
        if self.shared > limit:
            out.append(f"shared memory {self.shared} B > sm_{self.arch}'s {limit} B a block")
        want = WGMMA_OPS if self.spec.gluon else arch_limits(self.arch).tensor_ops
        if self.spec.tensor_cores and not tensor_op_count(self.arch, self.sass_ops, want):
            want = "/".join(want).replace("\\w*", "*")
            out.append(f"no tensor-core instruction ({want}) in the SASS")
        return out

    @property
    def failed(self) -> bool:
        return bool(self.problems())

    def line(self) -> str:
        s = self.spec
        if not self.ok:
            return f"FAIL  sm_{self.arch} {s.name:<22} {s.config:<40} {self.error}"
        ops = " ".join(f"{k}x{v}" for k, v in self.sass_ops.items() if v) or "-"
        if self.sass_ops.get("LDL/STL"):
            ops += f" ({self.hot_spills} in loops)"
        problems = self.problems()
        flag = "cold " if self.spill_bytes else "ok   "
        if self.spill_bytes and s.accepted_spill:
            flag = "kept "
            ops += f" [spill accepted: {s.accepted_spill}]"
        if problems:
            flag = "SPILL" if self.spilled else "FAIL "
        extra = "".join(f" [{p}]" for p in problems if p != "spill in a loop")
        return (
            f"{flag} sm_{self.arch} {s.name:<22} {s.config:<40} regs={self.registers:<3} "
            f"spill={self.spill_bytes:<5} smem={self.shared:<6} sass: {ops}{extra}"
        )


def compile_spec(spec: AotSpec, arch: int) -> AotResult:
    """Compile one spec for ``sm_{arch}`` and read its resources and SASS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if spec.launch:
        consts, attrs = spec.launch
    else:
        params = list(spec.signature)
        consts = {(params.index(n),): v for n, v in spec.constexprs.items()}
        # Arguments the kernel declares do_not_specialize never get the attribute at run time.
        plain = {p.name for p in getattr(spec.fn, "params", ()) if p.do_not_specialize}
        attrs = {
            (params.index(n),): [["tt.divisibility", 16]]
            for n in spec.pointer_args + spec.divisible_args if n not in plain
        }
    try:
        if spec.gluon:
            from triton.experimental.gluon._runtime import GluonASTSource

            src = GluonASTSource(spec.fn, spec.signature, consts, attrs)
        else:
            src = ASTSource(spec.fn, spec.signature, consts, attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(spec.options))
    except Exception as exc:  # report, do not stop the sweep
        msg = " ".join(str(exc).split())[:300]
        return AotResult(spec, arch, False, error=f"{type(exc).__name__}: {msg}")
    res = AotResult(spec, arch, True, shared=int(kernel.metadata.shared))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        cuobjdump = os.path.join(bin_dir(), "cuobjdump")
        usage = subprocess.run(
            [cuobjdump, "-res-usage", path], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", usage)
    if m:
        res.registers = int(m.group(1))
        res.spill_bytes = int(m.group(2)) + int(m.group(3))
    # Local-memory traffic is the spill that matters; a stack frame with no LDL/STL is harmless,
    # but count it anyway (strict): the report says which.
    res.sass_ops = {op: len(re.findall(rf"\b{op}\b", sass)) for op in SASS_OPS}
    for op in sorted(set(_UTC_MMA.findall(sass))):
        res.sass_ops[op] = len(re.findall(rf"\b{op}\b", sass))
    res.sass_ops["LDL/STL"] = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    res.hot_spills = hot_local_accesses(sass)
    if res.sass_ops["LDL/STL"] == 0 and res.spill_bytes:
        res.spill_bytes = 0  # a stack frame that is never touched by local loads/stores
    return res


# sm_80 and sm_90 compile every spec. The other architectures (the seeds' GPUs: sm_86, sm_89,
# sm_100, sm_120) compile, per kernel, the variants below at the head-dim tiles 64, 128 and
# 256: the plainest and the most feature-laden flag set, whose registers and shared memory bound
# the others'. Of the flex kernels, the forward with gathered mods (the most shared memory).
# About 24 specs an architecture.
FULL_ARCHS = (80, 90)
REPRESENTATIVE = {
    "fwd_portable": ("plain", "causal all-features"),
    "bwd_preprocess": ("dlse",),
    "bwd_dkdv": ("masks",),
    "bwd_dq": ("masks",),
    "decode_splitkv": ("contiguous", "paged16-all wide"),
    "combine": ("",),
    "fwd_flex": ("doc+relbias",),  # gathered mods: the most shared memory (sm_80: 113 KB at d=64)
}
_REPRESENTATIVE_DIMS = (0, 64, 128, 256)  # 0: a spec without a head-dim tile


def collect_specs(arch: int) -> list[AotSpec]:
    """Every spec for ``sm_{arch}``, read off the launches of :func:`solattn.aot_calls.calls`:
    all of them on :data:`FULL_ARCHS`, else the :data:`REPRESENTATIVE` subset."""
    from solattn import aot_calls

    specs = aot_calls.specs(arch, aot_calls.calls(arch))
    if arch in FULL_ARCHS:
        return specs
    return [s for s in specs if s.variant in REPRESENTATIVE.get(s.name, ())
            and s.head_dim in _REPRESENTATIVE_DIMS]


def check_archs(archs: list[int]) -> None:
    """Raise ``ValueError`` for an architecture without a row in :mod:`solattn.arch`
    (its limits are what the gate checks)."""
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise ValueError(f"--arch: expected compute capabilities from {sorted(ARCHS)}, got {bad}")


def ptxas_refusal(arch: int) -> str:
    """Why the ptxas this Triton uses for ``sm_{arch}`` cannot compile for it ("" if it can,
    or if this Triton's compiler module cannot be asked): its ``--help`` lists the GPU names it
    accepts."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        path = get_ptxas(arch).path
        name = sm_arch_from_capability(arch)
        text = subprocess.run([path, "--help"], capture_output=True, text=True).stdout
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    except Exception:  # an older or newer compiler module: let the compile itself report
        return ""
    if f"'{name}'" in text or "Allowed values" not in text:
        return ""
    release = re.search(r"release ([\d.]+)", version)
    return (f"the ptxas of this Triton (CUDA {release.group(1) if release else '?'}, "
            f"{os.path.basename(path)}) does not accept {name}")


# (arch, spec) pairs of the current run, visible to forked workers (specs hold jit functions,
# which are not pickled: workers get an index and send back the result's fields).
_JOBS: list[tuple[int, AotSpec]] = []


def _compile_job(i: int) -> dict:
    arch, spec = _JOBS[i]
    res = compile_spec(spec, arch)
    return {name: getattr(res, name) for name in AotResult.CACHED}


@dataclass
class AotStats:
    cached: int = 0
    compiled: int = 0
    seconds: float = 0.0


def compile_all(jobs: list[tuple[int, AotSpec]], procs: int | None = None, echo=None
                ) -> tuple[list[AotResult], AotStats]:
    """Results of ``jobs`` ((arch, spec) pairs) in their order: from the cache where the
    spec's key (:func:`solattn.aot_cache.spec_key`) is there, else compiled in ``procs`` worker
    processes (default: the CPU count) and stored. ``echo(result)`` is called on each, in order."""
    t0 = time.perf_counter()
    cache = ResultCache.from_env(AotResult.CACHED, tool=(compile_spec,))
    hits = [cache.get(spec, arch) for arch, spec in jobs]
    _JOBS[:] = jobs
    todo = [i for i, hit in enumerate(hits) if hit is None]
    procs = max(1, min(procs or os.cpu_count() or 1, len(todo)))
    pool = None
    if procs == 1:
        fresh = map(_compile_job, todo)
    else:
        import multiprocessing

        pool = multiprocessing.get_context("fork").Pool(procs)
        fresh = pool.imap(_compile_job, todo)
    results = []
    try:
        for (arch, spec), hit in zip(jobs, hits):
            res = AotResult(spec, arch, **(hit if hit is not None else next(fresh)))
            res.cached = hit is not None
            if not res.cached and res.ok:  # a compile error is compiled again next time
                cache.put(spec, arch, {name: getattr(res, name) for name in AotResult.CACHED})
            results.append(res)
            if echo is not None:
                echo(res)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    stats = AotStats(cached=sum(r.cached for r in results),
                     compiled=sum(not r.cached for r in results),
                     seconds=time.perf_counter() - t0)
    return results, stats


def run(archs: list[int], only: str | None = None, jobs: int | None = None) -> int:
    """Compile every spec for every arch (:func:`collect_specs`), print one line each; 1 on any
    failure (:attr:`AotResult.failed`), 2 for an architecture :mod:`solattn.arch` does not
    list. An architecture the installed Triton's ptxas cannot
    compile for is reported and left out, never silently.

    ``jobs`` worker processes (default: the CPU count) compile in parallel; lines keep the
    specs' order. The last lines say how many results came from the cache and the wall time.
    """
    import sys

    import triton

    try:
        check_archs(archs)
    except ValueError as exc:
        print(f"solattn aot: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    pairs, refused = [], []
    for arch in dict.fromkeys(archs):
        why = ptxas_refusal(arch)
        if why:
            refused.append(arch)
            print(f"NOT COMPILED sm_{arch}: {why} (triton {triton.__version__})", flush=True)
            continue
        pairs += [(arch, spec) for spec in collect_specs(arch) if not only or only in spec.name]
    ResultCache.from_env(AotResult.CACHED).prune()
    results, stats = compile_all(pairs, jobs, echo=lambda r: print(r.line(), flush=True))
    bad = sum(r.failed for r in results)
    print(f"aot: {bad} kernel(s) failed (compile error, spill in a loop, shared memory or no "
          "tensor-core instruction)" if bad else
          "aot: all kernels compiled, no spills in loops (cold spills: see 'cold' lines), "
          "shared memory within each part's limit, tensor cores used")
    if refused:
        print(f"aot: not compiled with triton {triton.__version__}: "
              + ", ".join(f"sm_{a}" for a in refused))
    where = ResultCache.from_env(AotResult.CACHED).where
    print(f"aot: {len(results)} specs for {', '.join(f'sm_{a}' for a in dict.fromkeys(archs))}:"
          f" {stats.cached} cached, {stats.compiled} compiled; "
          f"{time.perf_counter() - t0:.1f} s wall (cache: {where})")
    return 1 if bad else 0
