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

Kernel modules declare which flag sets to compile as data (``AOT_VARIANTS``); the builders at
the end of this module turn them, with the config tables of :mod:`solattn.configs`, into
:class:`AotSpec`s (:data:`SPEC_BUILDERS`). Kernel modules never import this tool.
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
from solattn.arch import ARCHS, WGMMA_OPS, arch_limits, tensor_op_count
from solattn.dispatch import hopper_unavailable
from solattn.kernels.sass import bin_dir, hot_local_accesses

SASS_OPS = ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "UTMASTG", "LDGSTS")
# tcgen05.mma (sm_100): UTCHMMA (16-bit), UTCQMMA (FP8), UTCIMMA (int8), ...; counted by name.
_UTC_MMA = re.compile(r"\bUTC\w*MMA\b")


@dataclass(frozen=True)
class AotSpec:
    """One kernel configuration to compile.

    ``signature`` maps every argument name to a Triton type string (``"*bf16"``, ``"i32"``,
    ``"fp32"``, ``"constexpr"``, or a Gluon ``"tensordesc<...>"``); ``constexprs`` maps the
    constexpr arguments' names to values. Build both with :func:`make_signature`.
    """

    name: str
    config: str
    fn: object
    signature: dict
    constexprs: dict
    options: dict = field(default_factory=dict)
    gluon: bool = False
    pointer_args: tuple = ()
    divisible_args: tuple = ()  # int args assumed multiples of 16, as Triton specializes at launch
    # A spill measured and accepted for this config with this Triton (the measurement, e.g. the
    # spill-free alternative's TFLOP/s): reported as "spill (accepted: ...)", never a failure.
    accepted_spill: str = ""
    # The kernel multiplies tiles (tl.dot): its SASS must hold the part's tensor-core ops.
    tensor_cores: bool = True
    # The variant (flag set) and padded head dim it compiles: REPRESENTATIVE picks by them.
    variant: str = ""
    head_dim: int = 0


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
    """Every spec for ``sm_{arch}``: all of them on :data:`FULL_ARCHS`, else the
    :data:`REPRESENTATIVE` subset."""
    specs = [spec for build in SPEC_BUILDERS for spec in build(arch)]
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


# ---------------------------------------------------------------------------------------------
# Spec builders: one per kernel family, from the kernel module's AOT_VARIANTS and the configs
# the dispatcher can pick on ``arch``. Pointers are bf16 (fp16 compiles to the same code).
# ---------------------------------------------------------------------------------------------

def _strides_divisible(sig, unit, skip=("stride_a",)):
    """Stride arguments Triton specializes as multiples of 16 at launch (every real layout)."""
    return tuple(n for n in sig if n.startswith("stride_") and n not in unit
                 and not n.startswith(skip))


def fwd_portable_specs(arch: int) -> list[AotSpec]:
    """Per forward table entry (head dim, upper-banded): each of the kernel's AOT_VARIANTS."""
    from solattn.configs import all_fwd_configs, dropout_fwd_config
    from solattn.kernels.triton.forward import AOT_VARIANTS, attn_fwd_kernel

    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32",
                "ALIBI": "*fp32", "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32",
                "SEQUSED_K": "*i32", "BLOCK_TABLE": "*i32", "SEED": "*i64"}
    unit = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
    specs = []
    for (d, upper), table_cfg in all_fwd_configs(arch).items():
        for vname, variant in AOT_VARIANTS.items():
            flags = dict(variant)
            # the launcher's config for the variant (dropout: dropout_fwd_config)
            cfg = dropout_fwd_config(table_cfg) if flags.get("HAS_DROPOUT") else table_cfg
            hd = d * 3 // 4 if flags.pop("RAGGED_HEAD_DIM", False) and d > 16 else d
            consts = dict(HEAD_DIM=hd, HEAD_DIM_V=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          BLOCK_D=d, BLOCK_DV=d, IS_VARLEN=False, HAS_SEQUSED_K=False,
                          PAGE_SIZE=1, PAGE_MODE=0, HAS_LOWER=False, HAS_UPPER=upper,
                          HAS_SOFTCAP=False, HAS_ALIBI=False, STORE_LSE=True, HAS_DROPOUT=False)
            consts.update(flags)
            sig, consts = make_signature(attn_fwd_kernel, pointers=pointers, constexprs=consts,
                                         floats=("qk_scale", "softcap_prescale", "dropout_scale"),
                                         unit=unit)
            specs.append(AotSpec(
                name="fwd_portable", fn=attn_fwd_kernel, signature=sig, constexprs=consts,
                config=(f"d{hd} bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} "
                        f"s{cfg.num_stages} {'causal ' if upper else ''}{vname}"),
                options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                pointer_args=tuple(pointers), variant=f"{'causal ' if upper else ''}{vname}",
                head_dim=d,
                # a block table's row stride is its page count: any int
                divisible_args=_strides_divisible(sig, unit, ("stride_a", "stride_bt"))))
    return specs


def bwd_portable_specs(arch: int) -> list[AotSpec]:
    """The preprocess kernel, and per backward table entry the dK/dV kernel (each pass when
    split) and the dQ kernel over the backward module's AOT_VARIANTS."""
    from solattn.configs import all_bwd_configs
    from solattn.kernels.triton.backward import (
        AOT_VARIANTS,
        attn_bwd_dkdv_kernel,
        attn_bwd_dq_kernel,
        attn_bwd_preprocess_kernel,
    )

    def spec(name, fn, pointers, consts, unit, config, warps, stages, variant, d,
             tensor_cores=True):
        sig, consts = make_signature(fn, pointers=pointers, constexprs=consts,
                                     floats=("sm_scale", "qk_scale", "softcap_prescale",
                                             "dropout_scale"), unit=unit)
        return AotSpec(name=name, fn=fn, signature=sig, constexprs=consts, config=config,
                       options=dict(num_warps=warps, num_stages=stages),
                       pointer_args=tuple(pointers), variant=variant, head_dim=d,
                       tensor_cores=tensor_cores,
                       divisible_args=_strides_divisible(sig, unit, ("stride_a", "stride_gl")))

    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32",
           "DELTA": "*fp32", "DK": "*bf16", "DV": "*bf16", "ALIBI": "*fp32",
           "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32", "SEQUSED_K": "*i32", "SEED": "*i64"}
    dq_ptr = {n: t for n, t in ptr.items() if n not in ("DK", "DV")}
    dq_ptr["DQ"] = "*bf16"
    unit_kv = ("stride_qd", "stride_kd", "stride_vd", "stride_dod", "stride_dqd", "stride_dkd",
               "stride_dvd")
    unit_q = ("stride_qd", "stride_kd", "stride_vd", "stride_dod", "stride_dqd")
    specs = [spec("bwd_preprocess", attn_bwd_preprocess_kernel,
                  {"O": "*bf16", "DO": "*bf16", "DLSE": "*fp32", "DELTA": "*fp32"},
                  dict(HEAD_DIM_V=128, BLOCK_M=64, BLOCK_DV=128, HAS_DLSE=True),
                  ("stride_od", "stride_dod"), "dv128 bm64 w4 dlse", 4, 1, "dlse", 0,
                  tensor_cores=False)]
    for (d, scores), cfg in all_bwd_configs(arch).items():
        ragged = d * 3 // 4 if d > 16 else d  # d=96 in the 128 tile, etc.
        if scores:
            names = ["all-features"]
        elif d <= 32:
            names = ["masks"]
        else:  # near the register limit, where ptxas's choices are not monotone in the flags
            names = ["plain", "causal", "masks", "causal-dropout"]
        passes = ({"dk-pass ": (True, False), "dv-pass ": (False, True)} if cfg.split_dkdv
                  else {"": (True, True)})
        for vname in names:
            flags = AOT_VARIANTS[vname]
            hd = ragged if vname in ("masks", "all-features") else d
            for pname, (cdk, cdv) in passes.items():
                consts = dict(HEAD_DIM=hd, HEAD_DIM_V=hd, BLOCK_M=cfg.block_m,
                              BLOCK_N=cfg.block_n, BLOCK_M_EDGE=cfg.edge_block_m, BLOCK_D=d,
                              BLOCK_DV=d, ATOMIC_DQ=cfg.atomic_dq,
                              COMPUTE_DK=cdk, COMPUTE_DV=cdv, STAGES=cfg.num_stages,
                              EDGE_STAGES=cfg.edge_num_stages, **flags)
                specs.append(spec(
                    "bwd_dkdv", attn_bwd_dkdv_kernel,
                    dict(ptr, DQ="*fp32" if cfg.atomic_dq else "*bf16"), consts, unit_kv,
                    f"d{hd} bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
                    f"{'atomic-dq ' if cfg.atomic_dq else ''}{pname}{vname}", cfg.num_warps,
                    cfg.num_stages, vname, d))
            if vname not in ("masks", "all-features", "causal-dropout"):
                continue
            consts = dict(HEAD_DIM=hd, HEAD_DIM_V=hd, BLOCK_M=cfg.dq_block_m,
                          BLOCK_N=cfg.dq_block_n, BLOCK_D=d, BLOCK_DV=d, **flags)
            specs.append(spec(
                "bwd_dq", attn_bwd_dq_kernel, dq_ptr, consts, unit_q,
                f"d{hd} bm{cfg.dq_block_m} bn{cfg.dq_block_n} w{cfg.dq_num_warps} "
                f"s{cfg.dq_num_stages} {vname}", cfg.dq_num_warps, cfg.dq_num_stages,
                vname, d))
    return specs


def decode_specs(arch: int) -> list[AotSpec]:
    """Head dims 64 and 128 (the serving models' dims): decode tiles (block_m 16) in each of the
    decode module's AOT_VARIANTS, the wide-query tile in AOT_WIDE_VARIANT."""
    from solattn.configs import all_decode_configs
    from solattn.kernels.triton.decode import AOT_VARIANTS, AOT_WIDE_VARIANT, decode_kernel

    base_ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*fp32", "LSE": "*fp32",
                 "ALIBI": "*fp32", "CACHE_SEQLENS": "*i32", "CACHE_BATCH_IDX": "*i32",
                 "LEFTPAD": "*i32", "BLOCK_TABLE": "*i32", "K_NEW": "*bf16", "V_NEW": "*bf16",
                 "OUT": "*bf16", "LSE_OUT": "*fp32", "SEMAPHORES": "*i32"}
    unit = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
    specs = []
    for (d, bm), cfg in all_decode_configs(arch).items():
        if d not in (64, 128):
            continue
        for vname, (flags, o_type) in AOT_VARIANTS.items():
            if bm > 16 and vname != AOT_WIDE_VARIANT:
                continue
            consts = dict(HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          BLOCK_D=d, BLOCK_DV=d, HAS_BATCH_IDX=False, HAS_LEFTPAD=False,
                          HAS_LOWER=False, HAS_UPPER=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
                          APPEND=False, FUSE_COMBINE=False)
            consts.update(flags)
            pointers = dict(base_ptrs, O=o_type)
            sig, consts = make_signature(decode_kernel, pointers=pointers, constexprs=consts,
                                         floats=("qk_scale", "softcap_prescale"), unit=unit)
            specs.append(AotSpec(
                name="decode_splitkv", fn=decode_kernel, signature=sig, constexprs=consts,
                config=f"d{d} bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} "
                       f"s{cfg.num_stages} {vname}",
                options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                pointer_args=tuple(pointers), divisible_args=_strides_divisible(sig, unit),
                variant=f"{vname}{' wide' if bm > 16 else ''}", head_dim=d))
    return specs


def combine_specs(arch: int) -> list[AotSpec]:
    from solattn.configs import combine_num_warps
    from solattn.kernels.triton.combine import AOT_HEAD_DIMS, combine_kernel, rows_per_program

    pointers = {"OP": "*fp32", "LP": "*fp32", "O": "*bf16", "LSE": "*fp32"}
    specs = []
    for d in AOT_HEAD_DIMS:
        rows = rows_per_program(d)
        consts = dict(HEAD_DIM=d, BLOCK_R=rows, BLOCK_D=d, STORE_LSE=True)
        sig, consts = make_signature(combine_kernel, pointers=pointers, constexprs=consts,
                                     unit=("stride_opd", "stride_od"))
        specs.append(AotSpec(name="combine", fn=combine_kernel, signature=sig, constexprs=consts,
                             config=f"d{d} br{rows} w{combine_num_warps(arch, d)}",
                             options=dict(num_warps=combine_num_warps(arch, d)),
                             pointer_args=tuple(pointers), head_dim=d, tensor_cores=False,
                             divisible_args=tuple(n for n in sig if n.startswith("stride_")
                                                  and sig[n] == "i32")))
    return specs


def _bf16_desc(block: list[int]) -> str:
    """Signature string of a Gluon host descriptor argument over bf16 rank-4 tiles of ``block``
    (128-byte swizzle: what the JIT specializes on)."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return f"tensordesc<bf16{block},{layout!r}>"


# The Hopper forward kernels' scalar arguments (both dtypes), in signature order.
_FWD_HOPPER_SCALARS = {
    "num_tiles": "i32", "n_m": "i32", "num_heads": "i32", "grid_size": "i32",
    "seqlen_q": "i32", "seqlen_k": "i32", "group_size": "i32",
    "qk_scale": "fp32", "softcap_prescale": "fp32", "left": "i32", "right": "i32",
}


def _fwd_hopper_consts(d: int, cfg) -> dict:
    """The constexprs the 16-bit and FP8 Hopper forwards share, for head dim (tile) ``d`` and
    a ``HopperFwdConfig``, every feature flag off."""
    return dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                HAS_LOWER=False, HAS_UPPER=False, HAS_SOFTCAP=False, STORE_LSE=True,
                HAS_SEQUSED_K=False, IS_VARLEN=False, REGISTER_EPILOGUE=cfg.persistent,
                CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
                CONSUMERS=cfg.consumers)


def _fwd_hopper_config_name(dims: str, cfg, vname: str) -> str:
    return (f"{dims} bm{2 * cfg.block_m} bn{cfg.block_n} s{cfg.stages} "
            f"{'persistent' if cfg.persistent else 'grid=tiles'} {vname}")


def fwd_hopper_specs(arch: int) -> list[AotSpec]:
    """Per Hopper head dim, each of the Hopper forward's AOT_VARIANTS (sm_90 only)."""
    if hopper_unavailable(arch):
        return []

    from solattn.configs.hopper_forward import accepted_spill, hopper_fwd_config
    from solattn.kernels.hopper.forward import (
        HEAD_DIM_TILES,
        SUPPORTED_HEAD_DIMS,
        attn_fwd_kernel,
    )
    from solattn.kernels.hopper.forward_plan import (
        AOT_EXTRA_VARIANTS,
        AOT_VARIANTS,
        alibi_covered,
    )

    variants = [(d, d, vname, flags) for d in SUPPORTED_HEAD_DIMS
                for vname, flags in AOT_VARIANTS.items()]
    variants += [(d, d_v, vname, flags) for (d, d_v), extra in AOT_EXTRA_VARIANTS.items()
                 for vname, flags in extra.items()
                 if alibi_covered() or not flags.get("HAS_ALIBI")]  # (else: portable)
    specs = []
    for d_real, dv_real, vname, flags in variants:
        d, d_v = HEAD_DIM_TILES[(d_real, dv_real)]
        flags = dict(flags)
        cfg = hopper_fwd_config(d, flags.get("HAS_UPPER", False),
                                flags.get("HAS_SOFTCAP", False), head_dim_v=d_v,
                                has_lower=flags.get("HAS_LOWER", False),
                                varlen=flags.get("IS_VARLEN", False),
                                seqlen_k=flags.pop("seqlen_k", None))
        consts = dict(_fwd_hopper_consts(d, cfg), HEAD_DIM_V=d_v, V_COLS=dv_real,
                      HAS_ALIBI=False, ALIBI_BATCHED=False, LPT=cfg.lpt)
        consts.update(flags)
        # (the kernel's last parameter: last in the signature)
        consts["DYNAMIC"] = consts.pop("DYNAMIC", cfg.persistent and cfg.dynamic)
        alibi = consts["HAS_ALIBI"]
        if not alibi:
            consts["ALIBI"] = None  # no slopes: a constexpr None, as the launcher passes it
        sig = {
            "q_desc": _bf16_desc([1, 1, cfg.block_m, d]),
            "k_desc": _bf16_desc([1, 1, cfg.block_n, d]),
            "v_desc": _bf16_desc([1, 1, cfg.block_n, d_v]),
            "o_desc": _bf16_desc([1, 1, cfg.block_m, d_v]),
            "O": "*bf16", "LSE": "*fp32", "SEQUSED_K": "*i32",
            "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32", "SCHED": "*i32",
            **_FWD_HOPPER_SCALARS, "ALIBI": "*fp32" if alibi else "constexpr",
        }
        sig.update({name: "constexpr" for name in consts if name not in sig})
        dims = f"d{d_real}" if d_real == dv_real else f"d{d_real}/{dv_real}"
        specs.append(AotSpec(
            name="fwd_hopper", fn=attn_fwd_kernel, signature=sig, constexprs=consts,
            config=_fwd_hopper_config_name(dims, cfg, vname),
            options=dict(num_warps=4), gluon=True,
            pointer_args=("O", "LSE", "SEQUSED_K", "CU_SEQLENS_Q", "CU_SEQLENS_K", "SCHED")
            + (("ALIBI",) if alibi else ()),
            accepted_spill=accepted_spill(d, flags)))
    return specs


def fwd_hopper_fp8_specs(arch: int) -> list[AotSpec]:
    """Per Hopper FP8 head dim, each of the FP8 forward's AOT_FP8_VARIANTS (sm_90 only)."""
    if hopper_unavailable(arch):
        return []
    from triton.experimental.gluon import language as gl

    from solattn.configs.hopper_forward import (
        _FP8_CONFIGS,
        fp8_band_only_head_dims,
        hopper_fwd_config,
    )
    from solattn.kernels.hopper.forward import (
        attn_fwd_fp8_kernel,
        fp8_v_transpose_kernel,
        fp8_v_transpose_varlen_kernel,
    )
    from solattn.kernels.hopper.forward_plan import _FP8_TRANSPOSE_BLOCK, AOT_FP8_VARIANTS

    def desc(dtype: str, block: list[int]) -> str:
        width = 8 if dtype == "fp8e4nv" else 16
        swizzle = min(128, block[-1] * width // 8)
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=width, rank=4)
        return f"tensordesc<{dtype}{block},{layout!r}>"

    specs = []
    for d in _FP8_CONFIGS:
        for vname, flags in AOT_FP8_VARIANTS.items():
            if d in fp8_band_only_head_dims() and (flags.get("HAS_SOFTCAP")
                                                 or flags.get("HAS_LOWER")):
                continue
            cfg = hopper_fwd_config(d, flags.get("HAS_UPPER", False),
                                    flags.get("HAS_SOFTCAP", False), fp8=True)
            consts = dict(_fwd_hopper_consts(d, cfg), **flags)
            if consts["IS_VARLEN"]:  # O from registers (_make_plan)
                consts["REGISTER_EPILOGUE"] = True
            sig = {
                "q_desc": desc("fp8e4nv", [1, 1, cfg.block_m, d]),
                "k_desc": desc("fp8e4nv", [1, 1, cfg.block_n, d]),
                "v_desc": desc("fp8e4nv", [1, 1, d, cfg.block_n]),
                "o_desc": desc("bf16", [1, 1, cfg.block_m, d]),
                "O": "*bf16", "LSE": "*fp32", "SEQUSED_K": "*bf16",
                "CU_SEQLENS_Q": "*i32" if consts["IS_VARLEN"] else "*bf16",
                "CU_SEQLENS_K": "*i32" if consts["IS_VARLEN"] else "*bf16",
                "Q_DESCALE": "*fp32", "K_DESCALE": "*fp32", "V_DESCALE": "*fp32",
                **_FWD_HOPPER_SCALARS,
            }
            sig.update({name: "constexpr" for name in consts})
            specs.append(AotSpec(
                name="fwd_hopper_fp8", fn=attn_fwd_fp8_kernel, signature=sig,
                constexprs=consts,
                config=_fwd_hopper_config_name(f"d{d}", cfg, vname),
                options=dict(num_warps=4), gluon=True,
                pointer_args=("O", "LSE", "SEQUSED_K", "CU_SEQLENS_Q", "CU_SEQLENS_K",
                              "Q_DESCALE", "K_DESCALE", "V_DESCALE")))
        sig, consts = make_signature(
            fp8_v_transpose_kernel, pointers={"V": "*u8", "VT": "*u8"},
            constexprs=dict(HEAD_DIM=d, BLOCK_K=_FP8_TRANSPOSE_BLOCK))
        specs.append(AotSpec(
            name="fwd_hopper_fp8_v", fn=fp8_v_transpose_kernel, signature=sig,
            constexprs=consts, config=f"d{d} bk{_FP8_TRANSPOSE_BLOCK} w4",
            options=dict(num_warps=4), pointer_args=("V", "VT"), tensor_cores=False,
            divisible_args=("s_pad", "stride_vb", "stride_vs", "stride_vh")))
        sig, consts = make_signature(
            fp8_v_transpose_varlen_kernel,
            pointers={"V": "*u8", "VT": "*u8", "CU_SEQLENS_K": "*i32"},
            constexprs=dict(HEAD_DIM=d, BLOCK_K=_FP8_TRANSPOSE_BLOCK,
                            TAIL=max(c.block_n for c in _FP8_CONFIGS.values())))
        specs.append(AotSpec(
            name="fwd_hopper_fp8_v", fn=fp8_v_transpose_varlen_kernel, signature=sig,
            constexprs=consts, config=f"d{d} bk{_FP8_TRANSPOSE_BLOCK} w4 varlen",
            options=dict(num_warps=4), pointer_args=("V", "VT", "CU_SEQLENS_K"),
            tensor_cores=False, divisible_args=("s_pad", "stride_vs", "stride_vh")))
    return specs


def _hopper_bwd_operands(cfg, d: int, dkv: str) -> dict:
    """Argument types of the Hopper backward kernels' first operands (dense and flex): the TMA
    descriptors of Q, K, V, dO, LSE, Delta and the dK/dV outputs (bf16: their TMA epilogue) for
    ``cfg``'s tiles at head dim ``d``, then dQ (fp32) and dK/dV in ``dkv``."""
    from solattn.kernels.hopper.backward_plan import COL_LAYOUT

    return {"q_desc": _bf16_desc([1, 1, cfg.block_m, d]),
            "k_desc": _bf16_desc([1, 1, cfg.block_n, d]),
            "v_desc": _bf16_desc([1, 1, cfg.block_n, d]),
            "do_desc": _bf16_desc([1, 1, cfg.block_m, d]),
            "lse_desc": f"tensordesc<fp32[{cfg.block_m}],{COL_LAYOUT!r}>",
            "delta_desc": f"tensordesc<fp32[{cfg.block_m}],{COL_LAYOUT!r}>",
            "dk_desc": _bf16_desc([1, 1, cfg.block_n, d]),
            "dv_desc": _bf16_desc([1, 1, cfg.block_n, d]),
            "DQ": "*fp32", "DK": f"*{dkv}", "DV": f"*{dkv}"}


def bwd_hopper_specs(arch: int) -> list[AotSpec]:
    """Per Hopper backward head dim, each of its AOT_VARIANTS unsplit and split (GQA groups
    over several CTAs), and the split's dK/dV reduce (sm_90 only)."""
    if hopper_unavailable(arch):
        return []

    from solattn.configs.hopper_backward import accepted_spill, hopper_bwd_config
    from solattn.kernels.hopper.backward import (
        CONVERT_ROWS,
        PREPROCESS_ROWS,
        REDUCE_ELEMENTS,
        SUPPORTED_HEAD_DIMS,
        attn_bwd_kernel,
        bwd_dkdv_reduce_kernel,
        bwd_dq_convert_kernel,
        bwd_preprocess_kernel,
    )
    from solattn.kernels.hopper.backward_plan import (
        AOT_VARIANTS,
        alibi_covered,
        deterministic_covered,
    )

    specs = []
    for varlen, turns in ((False, False), (True, False), (False, True)):
        sig, consts = make_signature(
            bwd_preprocess_kernel, floats=("lse_unit",),
            pointers={"O": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DLSE": "*fp32",
                      "LSE_INIT": "*fp32", "DELTA_INIT": "*fp32", "DQ_ACC": "*fp32",
                      "CU_SEQLENS_Q": "*i32"},
            constexprs=dict(HEAD_DIM=128, BLOCK_M=PREPROCESS_ROWS, HAS_DLSE=True,
                            IS_VARLEN=varlen, ROW_PAD=64, ZERO_TURNS=turns),
            unit=("stride_od", "stride_dod"))
        specs.append(AotSpec(
            name="bwd_hopper_preprocess", fn=bwd_preprocess_kernel, signature=sig,
            constexprs=consts,
            config=(f"d128 bm{PREPROCESS_ROWS} w8 dlse{' varlen' if varlen else ''}"
                    f"{' turns' if turns else ''}"),
            options=dict(num_warps=8),
            pointer_args=("O", "DO", "LSE", "DLSE", "LSE_INIT", "DELTA_INIT", "DQ_ACC",
                          "CU_SEQLENS_Q"), tensor_cores=False))
    # (variant, dK/dV pointer type): every variant unsplit (kv_splits == 1, a constant at run
    # time) in the inputs' dtype, and split (GQA groups over several CTAs: attn_bwd's
    # gqa_splits, kv_splits a runtime value) with fp32 partial dK/dV and the LPT grid.
    variants = [(vname, flags, dkv) for dkv in ("bf16", "fp32")
                for vname, flags in AOT_VARIANTS.items()]
    for d in SUPPORTED_HEAD_DIMS:
        for varlen in (False, True):
            block_r = REDUCE_ELEMENTS // d
            sig, consts = make_signature(
                bwd_dkdv_reduce_kernel,
                pointers={"PK": "*fp32", "PV": "*fp32", "DK": "*bf16", "DV": "*bf16",
                          "CU_SEQLENS_K": "*i32"},
                constexprs=dict(HEAD_DIM=d, BLOCK_R=block_r, IS_VARLEN=varlen))
            specs.append(AotSpec(
                name="bwd_hopper_reduce", fn=bwd_dkdv_reduce_kernel, signature=sig,
                constexprs=consts, config=f"d{d} br{block_r} w4{' varlen' if varlen else ''}",
                options=dict(num_warps=4),
                pointer_args=("PK", "PV", "DK", "DV", "CU_SEQLENS_K"), tensor_cores=False))
        sig, consts = make_signature(
            bwd_dq_convert_kernel, pointers={"DQ_ACC": "*fp32", "DQ": "*bf16"},
            constexprs=dict(HEAD_DIM=d, BLOCK_M=CONVERT_ROWS))
        specs.append(AotSpec(
            name="bwd_hopper_dq_convert", fn=bwd_dq_convert_kernel, signature=sig,
            constexprs=consts, config=f"d{d} bm{CONVERT_ROWS} w4", options=dict(num_warps=4),
            pointer_args=("DQ_ACC", "DQ"), tensor_cores=False))
        cfg = hopper_bwd_config(d)
        for vname, flags, dkv in variants:
            if flags.get("HAS_ALIBI") and not alibi_covered(d):
                continue  # (covers(): the portable backward runs it)
            if flags.get("DETERMINISTIC") and not deterministic_covered(
                    d, flags.get("HAS_LOWER", False) or flags.get("HAS_UPPER", False),
                    flags.get("HAS_SOFTCAP", False), flags.get("HAS_ALIBI", False),
                    flags.get("IS_VARLEN", False)):
                continue  # (covers(): the portable backward runs it)
            consts = dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          STAGES=cfg.stages, HAS_LOWER=False, HAS_UPPER=False,
                          HAS_SOFTCAP=False, IS_VARLEN=False,
                          LOOKAHEAD=cfg.lookahead, DQ_WRITER=cfg.dq_writer,
                          PRODUCER_REGS=cfg.producer_regs, DK_FROM_REGS=cfg.dk_from_regs,
                          DQ_PAD=cfg.dq_pad, DQ_VEC=cfg.dq_vec, WRITER_ROWS=cfg.writer_rows,
                          LPT=dkv == "fp32" or flags.get("DETERMINISTIC", False))  # lpt_grid
            consts.update(flags)
            # stagger_of: without a band, never deterministic
            determ = consts.pop("DETERMINISTIC", False)
            consts["STAGGER"] = not (consts["HAS_LOWER"] or consts["HAS_UPPER"] or determ)
            # (in the kernel's parameter order, which the signature follows: last)
            consts["HAS_ALIBI"] = consts.pop("HAS_ALIBI", False)
            # attn_bwd: dK/dV by TMA where they are the outputs of one (non-packed) batch
            consts["TMA_EPILOGUE"] = dkv == "bf16" and not consts["IS_VARLEN"]
            consts["DETERMINISTIC"] = determ
            sig = {**_hopper_bwd_operands(cfg, d, dkv),
                   "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32", "ALIBI": "*fp32"}
            for name in ("num_heads", "num_heads_kv", "seqlen_q", "seqlen_q_pad", "seqlen_k",
                         "group_size", "kv_splits", "left", "right"):
                sig[name] = "i32"
            if dkv != "fp32":
                consts["kv_splits"] = 1  # Triton's specialization of an int argument equal to 1
            sig.update(qk_scale="fp32", softcap_prescale="fp32", sm_scale="fp32",
                       alibi_unit="fp32", alibi_sb="i32", alibi_sh="i32")
            sig.update({name: "constexpr" for name in consts})
            specs.append(AotSpec(
                name="bwd_hopper", fn=attn_bwd_kernel, signature=sig, constexprs=consts,
                config=(f"d{d} bm{cfg.block_m} bn{cfg.block_n} s{cfg.stages} "
                        f"la{cfg.lookahead} {'dq-warp' if cfg.dq_writer else 'dq-red'}"
                        f"{' dk-rs' if cfg.dk_from_regs else ''}"
                        f"{' dq-pad' if cfg.dq_pad else ''}"
                        f"{f' dq-swz{cfg.dq_vec}x{cfg.writer_rows}' if cfg.dq_vec != 2 else ''}"
                        f" {vname}{' split fp32-dkv lpt' if dkv == 'fp32' else ''}"),
                options=dict(num_warps=8), gluon=True,
                pointer_args=("DQ", "DK", "DV", "CU_SEQLENS_Q", "CU_SEQLENS_K", "ALIBI"),
                accepted_spill=accepted_spill(d, vname)))
    return specs


def _flex_mods(score_name, mask_name):
    """``(score ModFns, score capture types, mask ModFns, mask capture types)`` of two mods of
    :mod:`solattn.flex.examples` (traced and generated here, on the CPU)."""
    import torch

    from solattn.flex.examples import mods
    from solattn.flex.registry import _REGISTRY, MASK, SCORE, resolve

    catalogue = mods(4096, 8, 2, "cpu", requires_grad=True)
    out = []
    for name, pick, kind in ((score_name, 0, SCORE), (mask_name, 1, MASK)):
        fn = catalogue[name][pick] if name else None
        if fn is None:
            out += [None, ()]
            continue
        key, caps = resolve(fn, kind)
        types = []
        for t in caps:
            elem = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                    torch.int64: "i64", torch.int32: "i32", torch.bool: "i1"}[t.dtype]
            types += [f"*{elem}"] + ["i32"] * (2 * t.dim())
        fns = _REGISTRY[key]
        out += [None if fns.noop else fns, tuple(types)]
    return out


_LIST = ("*i32", "*i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32")  # common.sparse_blocks
_FLEX_HEAD_DIMS = (64, 128)


def fwd_flex_specs(arch: int) -> list[AotSpec]:
    """The flex forward kernel per AOT_FLEX_VARIANTS at head dims 64 and 128."""
    from solattn.configs import flex_fwd_config
    from solattn.kernels.triton.forward import AOT_FLEX_VARIANTS, attn_fwd_flex_kernel

    unit = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
    specs = []
    for vname, (score_name, mask_name) in AOT_FLEX_VARIANTS.items():
        score, score_types, mask, mask_types = _flex_mods(score_name, mask_name)
        for d in _FLEX_HEAD_DIMS:
            cfg = flex_fwd_config(arch, d, d)
            pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32",
                        "KV_LIST": _LIST, "FULL_KV_LIST": _LIST, "SCORE_ARGS": score_types,
                        "MASK_ARGS": mask_types, "SEED": "*i64"}
            consts = dict(HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          BLOCK_D=d, BLOCK_DV=d, SPARSE_M=128, SPARSE_N=128,
                          SCORE_MOD=score.fwd if score else None,
                          MASK_MOD=mask.fwd if mask else None, STORE_LSE=True,
                          HAS_DROPOUT=False)
            sig, consts = make_signature(attn_fwd_flex_kernel, pointers=pointers,
                                         constexprs=consts,
                                         floats=("sm_scale", "qk_scale", "dropout_scale"),
                                         unit=unit)
            specs.append(AotSpec(
                name="fwd_flex", fn=attn_fwd_flex_kernel, signature=sig, constexprs=consts,
                config=(f"d{d} bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} "
                        f"s{cfg.num_stages} {vname}"),
                options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                pointer_args=("Q", "K", "V", "O", "LSE"), variant=vname, head_dim=d,
                divisible_args=_strides_divisible(sig, unit)))
    return specs


def _grad_types(score) -> tuple:
    """Argument types of a score_mod's captured-tensor gradients (the backward's ``GRADS``): an
    fp32 buffer and its strides per captured tensor that requires grad."""
    types = ()
    for i in score.grad_captures if score else ():
        types += ("*fp32",) + ("i32",) * score.captures[i].ndim
    return types


def bwd_flex_specs(arch: int) -> list[AotSpec]:
    """The flex dK/dV (each pass when split) and dQ kernels per AOT_FLEX_VARIANTS at head dims
    64 and 128, with the backward table the dispatcher picks (``scores`` with a score_mod)."""
    from solattn.configs import bwd_config
    from solattn.kernels.triton.backward import (
        AOT_FLEX_VARIANTS,
        attn_bwd_dkdv_flex_kernel,
        attn_bwd_dq_flex_kernel,
    )

    floats = ("sm_scale", "qk_scale", "dropout_scale")
    specs = []
    for vname, (score_name, mask_name) in AOT_FLEX_VARIANTS.items():
        score, score_types, mask, mask_types = _flex_mods(score_name, mask_name)
        grad_types = _grad_types(score)
        mods = dict(SCORE_MOD=score.fwd if score else None, SCORE_BWD=score.bwd if score else None,
                    MASK_MOD=mask.fwd if mask else None, HAS_DROPOUT=False)
        for d in _FLEX_HEAD_DIMS:
            cfg = bwd_config(arch, d, d, scores=score is not None)
            unit = ("stride_qd", "stride_kd", "stride_vd", "stride_dod", "stride_dqd",
                    "stride_dkd", "stride_dvd")
            ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32",
                   "DELTA": "*fp32", "DQ": "*fp32" if cfg.atomic_dq else "*bf16", "DK": "*bf16",
                   "DV": "*bf16", "Q_LIST": _LIST, "FULL_Q_LIST": _LIST,
                   "SCORE_ARGS": score_types, "MASK_ARGS": mask_types, "GRADS": grad_types,
                   "SEED": "*i64"}
            passes = ({"dk-pass ": (True, False), "dv-pass ": (False, True)} if cfg.split_dkdv
                      else {"": (True, True)})
            for pname, (cdk, cdv) in passes.items():
                consts = dict(HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              BLOCK_M_EDGE=cfg.edge_block_m, BLOCK_D=d, BLOCK_DV=d, SPARSE_M=128,
                              SPARSE_N=128, ATOMIC_DQ=cfg.atomic_dq, COMPUTE_DK=cdk,
                              COMPUTE_DV=cdv, STAGES=cfg.num_stages,
                              EDGE_STAGES=cfg.edge_num_stages, **mods)
                sig, consts = make_signature(attn_bwd_dkdv_flex_kernel, pointers=ptr,
                                             constexprs=consts, floats=floats, unit=unit)
                specs.append(AotSpec(
                    name="bwd_flex_dkdv", fn=attn_bwd_dkdv_flex_kernel, signature=sig,
                    constexprs=consts,
                    config=(f"d{d} bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} "
                            f"s{cfg.num_stages} {pname}{vname}"),
                    options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                    pointer_args=("Q", "K", "V", "DO", "LSE", "DELTA", "DQ", "DK", "DV"),
                    divisible_args=_strides_divisible(sig, unit)))
            dq_unit = ("stride_qd", "stride_kd", "stride_vd", "stride_dod", "stride_dqd")
            dq_ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32",
                      "DELTA": "*fp32", "DQ": "*bf16", "KV_LIST": _LIST, "FULL_KV_LIST": _LIST,
                      "SCORE_ARGS": score_types, "MASK_ARGS": mask_types, "SEED": "*i64"}
            consts = dict(HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_M=cfg.dq_block_m,
                          BLOCK_N=cfg.dq_block_n, BLOCK_D=d, BLOCK_DV=d, SPARSE_M=128,
                          SPARSE_N=128, **mods)
            sig, consts = make_signature(attn_bwd_dq_flex_kernel, pointers=dq_ptr,
                                         constexprs=consts, floats=floats, unit=dq_unit)
            specs.append(AotSpec(
                name="bwd_flex_dq", fn=attn_bwd_dq_flex_kernel, signature=sig, constexprs=consts,
                config=(f"d{d} bm{cfg.dq_block_m} bn{cfg.dq_block_n} w{cfg.dq_num_warps} "
                        f"s{cfg.dq_num_stages} {vname}"),
                options=dict(num_warps=cfg.dq_num_warps, num_stages=cfg.dq_num_stages),
                pointer_args=("Q", "K", "V", "DO", "LSE", "DELTA", "DQ"),
                divisible_args=_strides_divisible(sig, dq_unit)))
    return specs


def fwd_flex_hopper_specs(arch: int) -> list[AotSpec]:
    """The Hopper flex forward (sm_90 only) per its AOT_VARIANTS (mods and key tile) at head
    dims 64 and 128, with the Gluon twins of the generated mods."""
    if hopper_unavailable(arch):
        return []

    from solattn.configs.hopper_flex_forward import (
        HALF_CTA_MAXNREG,
        SUPPORTED_HEAD_DIMS,
        flex_config,
    )
    from solattn.kernels.hopper.flex_forward import attn_fwd_flex_kernel
    from solattn.kernels.hopper.flex_forward_plan import AOT_VARIANTS

    specs = []
    for vname, (score_name, mask_name, block_n, consumers) in AOT_VARIANTS.items():
        score, score_types, mask, mask_types = _flex_mods(score_name, mask_name)
        for d in SUPPORTED_HEAD_DIMS:
            cfg = flex_config(d, block_n, consumers)
            consts = dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          STAGES=cfg.stages, SPARSE_N=128,
                          SCORE_MOD=score.fwd_gluon if score else None,
                          MASK_MOD=mask.fwd_gluon if mask else None,
                          CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
                          CONSUMERS=cfg.consumers)
            sig = {"q_desc": _bf16_desc([1, 1, cfg.block_m, d]),
                   "k_desc": _bf16_desc([1, 1, cfg.block_n, d]),
                   "v_desc": _bf16_desc([1, 1, cfg.block_n, d]),
                   "o_desc": _bf16_desc([1, 1, cfg.block_m, d]), "LSE": "*fp32",
                   "KV_LIST": _LIST, "FULL_KV_LIST": _LIST, "SCORE_ARGS": score_types,
                   "MASK_ARGS": mask_types, "n_t": "i32", "num_heads": "i32", "seqlen_q": "i32",
                   "seqlen_k": "i32", "group_size": "i32", "sm_scale": "fp32",
                   "qk_scale": "fp32"}
            sig.update({name: "constexpr" for name in consts})
            specs.append(AotSpec(
                name="fwd_flex_hopper", fn=attn_fwd_flex_kernel, signature=sig,
                constexprs=consts,
                config=(f"d{d} bm{cfg.consumers * cfg.block_m} bn{cfg.block_n} s{cfg.stages} "
                        f"{vname}"),
                options=dict(num_warps=4, **(dict(maxnreg=HALF_CTA_MAXNREG)
                                             if cfg.consumers == 1 else {})),
                gluon=True, pointer_args=("LSE",)))
    return specs


def bwd_flex_hopper_specs(arch: int) -> list[AotSpec]:
    """The Hopper flex backward (sm_90 only) per its AOT_VARIANTS at head dims 64 and 128, dK/dV
    in bf16 (MHA) and fp32 (GQA partials), with the Gluon twins of the generated mods."""
    if hopper_unavailable(arch):
        return []

    from solattn.configs.hopper_backward import hopper_bwd_config
    from solattn.configs.hopper_flex_backward import (
        SPARSE_BLOCK,
        SUPPORTED_HEAD_DIMS,
        WORKER_REGS,
        accepted_spill,
    )
    from solattn.kernels.hopper.flex_backward import attn_bwd_flex_kernel
    from solattn.kernels.hopper.flex_backward_plan import AOT_VARIANTS

    specs = []
    for vname, (score_name, mask_name) in AOT_VARIANTS.items():
        score, score_types, mask, mask_types = _flex_mods(score_name, mask_name)
        grad_types = _grad_types(score)
        for d in SUPPORTED_HEAD_DIMS:
            cfg = hopper_bwd_config(d)
            for dkv in ("bf16", "fp32"):
                consts = dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              STAGES=cfg.stages, SUB=SPARSE_BLOCK // cfg.block_m,
                              SCORE_MOD=score.fwd_gluon if score else None,
                              SCORE_BWD=score.bwd_gluon if score else None,
                              MASK_MOD=mask.fwd_gluon if mask else None,
                              ACCUMULATE=bool(score and score.grad_captures),
                              PRODUCER_REGS=WORKER_REGS, DQ_PAD=cfg.dq_pad,
                              DQ_VEC=cfg.dq_vec, WRITER_ROWS=cfg.writer_rows,
                              TMA_EPILOGUE=dkv == "bf16")
                sig = {**_hopper_bwd_operands(cfg, d, dkv), "Q_LIST": _LIST,
                       "FULL_Q_LIST": _LIST, "SCORE_ARGS": score_types,
                       "MASK_ARGS": mask_types, "GRADS": grad_types}
                for name in ("num_heads", "seqlen_q", "seqlen_q_pad", "seqlen_k", "group_size",
                             "stride_kb", "stride_ks", "stride_kh"):
                    sig[name] = "i32"
                sig.update(qk_scale="fp32", sm_scale="fp32")
                sig.update({name: "constexpr" for name in consts})
                specs.append(AotSpec(
                    name="bwd_flex_hopper", fn=attn_bwd_flex_kernel, signature=sig,
                    constexprs=consts,
                    config=(f"d{d} bm{cfg.block_m} bn{cfg.block_n} s{cfg.stages} {vname}"
                            f"{' gqa fp32-dkv' if dkv == 'fp32' else ''}"),
                    options=dict(num_warps=8), gluon=True,
                    pointer_args=("DQ", "DK", "DV"),
                    accepted_spill=accepted_spill(d, vname)))
    return specs


SPEC_BUILDERS = [fwd_portable_specs, bwd_portable_specs, decode_specs, combine_specs,
                 fwd_hopper_specs, fwd_hopper_fp8_specs, bwd_hopper_specs, fwd_flex_specs,
                 bwd_flex_specs, fwd_flex_hopper_specs, bwd_flex_hopper_specs]
