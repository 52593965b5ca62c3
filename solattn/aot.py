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

Each kernel module exposes ``aot_specs(arch) -> list[AotSpec]``; :data:`SPEC_PROVIDERS` lists them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

# Modules with an ``aot_specs(arch)`` function (kernels added by later work register here).
SPEC_PROVIDERS = [
    "solattn.kernels.triton.forward",
    "solattn.kernels.triton.backward",
    "solattn.kernels.triton.decode",
    "solattn.kernels.triton.combine",
    "solattn.kernels.hopper.forward",
]

SASS_OPS = ("HGMMA", "HMMA", "UTMALDG", "UTMASTG", "LDGSTS")


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

    @property
    def failed(self) -> bool:
        """A compile error, a spill inside an innermost loop, or any spill in a Gluon kernel."""
        return (not self.ok or self.hot_spills > 0
                or (self.spec.gluon and self.spill_bytes > 0))

    def line(self) -> str:
        s = self.spec
        if not self.ok:
            return f"FAIL  sm_{self.arch} {s.name:<22} {s.config:<40} {self.error}"
        ops = " ".join(f"{k}x{v}" for k, v in self.sass_ops.items() if v) or "-"
        if self.sass_ops.get("LDL/STL"):
            ops += f" ({self.hot_spills} in loops)"
        flag = "SPILL" if self.failed else ("cold " if self.spill_bytes else "ok   ")
        return (
            f"{flag} sm_{self.arch} {s.name:<22} {s.config:<40} regs={self.registers:<3} "
            f"spill={self.spill_bytes:<5} smem={self.shared:<6} sass: {ops}"
        )


def hot_local_accesses(sass: str) -> int:
    """``LDL``/``STL`` instructions of ``sass`` (``cuobjdump -sass`` text) that lie inside an
    innermost loop: an address range ``[target, branch]`` of a backward ``BRA`` that contains no
    other such range."""
    ins = [(int(m.group(1), 16), m.group(2))
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b[^;]*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    inner = [lp for lp in loops
             if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    return sum(1 for addr, text in ins if re.search(r"\b(?:LDL|STL)\b", text)
               and any(lo <= addr <= hi for lo, hi in inner))


def _bin_dir() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_spec(spec: AotSpec, arch: int) -> AotResult:
    """Compile one spec for ``sm_{arch}`` and read its resources and SASS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(spec.signature)
    consts = {(params.index(n),): v for n, v in spec.constexprs.items()}
    attrs = {
        (params.index(n),): [["tt.divisibility", 16]]
        for n in spec.pointer_args + spec.divisible_args
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
        cuobjdump = os.path.join(_bin_dir(), "cuobjdump")
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
    res.sass_ops["LDL/STL"] = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    res.hot_spills = hot_local_accesses(sass)
    if res.sass_ops["LDL/STL"] == 0 and res.spill_bytes:
        res.spill_bytes = 0  # a stack frame that is never touched by local loads/stores
    return res


def collect_specs(arch: int) -> list[AotSpec]:
    specs = []
    for mod_name in SPEC_PROVIDERS:
        mod = importlib.import_module(mod_name)
        specs.extend(mod.aot_specs(arch))
    return specs


# (arch, spec) pairs of the current run, visible to forked workers (specs hold jit functions,
# which are not pickled: workers get an index and send back text).
_JOBS: list[tuple[int, AotSpec]] = []


def _compile_job(i: int) -> tuple[str, bool]:
    arch, spec = _JOBS[i]
    res = compile_spec(spec, arch)
    return res.line(), res.failed


def run(archs: list[int], only: str | None = None, jobs: int | None = None) -> int:
    """Compile every spec for every arch, print one line each; 1 on any failure or costly spill
    (:attr:`AotResult.failed`).

    ``jobs`` worker processes (default: the CPU count) compile in parallel; lines keep the
    specs' order.
    """
    _JOBS[:] = [(arch, spec) for arch in archs for spec in collect_specs(arch)
                if not only or only in spec.name]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(_JOBS)))
    if jobs == 1:
        results = map(_compile_job, range(len(_JOBS)))
    else:
        import multiprocessing

        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap(_compile_job, range(len(_JOBS)))
    bad = 0
    for line, failed in results:
        print(line, flush=True)
        bad += failed
    if jobs > 1:
        pool.close()
        pool.join()
    print(f"aot: {bad} kernel(s) failed or spilled in a loop" if bad else
          "aot: all kernels compiled, no spills in loops (cold spills: see 'cold' lines)")
    return 1 if bad else 0
