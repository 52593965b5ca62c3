"""Per-loop SASS instruction counts of Hopper AOT specs, compiled on the CPU.

usage: PYTHONPATH=. python tools/hopper_sass_loops.py [--hash] [--backward] [--set NAME=VALUE]
       [SUBSTRING ...]

Compiles every ``solattn aot`` Hopper-forward spec (``fwd_hopper``, ``fwd_hopper_fp8``,
``fwd_flex_hopper``; with
``--backward`` the backward's, ``bwd_hopper`` and ``bwd_flex_hopper``) whose
config contains one of the substrings (all of them if none), with constexprs overridden by
``--set`` (e.g. ``--set HAS_SOFTCAP=1``), and prints for each innermost loop of the SASS
that issues wgmmas (the consumers' key loops) its instruction count and its ``MUFU.EX2``,
``FFMA``, ``FADD``, ``FMUL``, ``FMNMX``, ``LEA``, ``IMAD``, ``F2FP``, ``HGMMA`` and
``LDL``/``STL`` counts, plus registers and spills. ``--hash`` prints a sha256 of each SASS
listing instead: run before and after a change that must leave the default kernels alone and
``diff`` the outputs (the SASS, not the cubin, whose line table moves with any edit; note that
ptxas's output can change with the inlining structure alone, through the debug line info).
"""
import argparse
import hashlib
import os
import re
import subprocess
import tempfile

os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from solattn import aot_calls  # noqa: E402
from solattn.kernels.sass import bin_dir, innermost_loops  # noqa: E402

OPS = ("MUFU.EX2", "FFMA", "FADD", "FMUL", "FMNMX", "LEA", "IMAD", "F2FP", "HGMMA")


def compile_cubin(spec, over: dict) -> bytes:
    """The spec's launch (its constexprs and attributes), with the constexprs ``over``
    replaced."""
    params = list(spec.signature)
    consts, attrs = spec.launch
    consts = {**consts, **{(params.index(n),): v for n, v in over.items()}}
    signature = {**spec.signature, **{n: "constexpr" for n in over}}
    src = GluonASTSource(spec.fn, signature, consts, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(spec.options))
    return kernel.asm["cubin"]


def sass_of(cubin: bytes) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        tool = os.path.join(bin_dir(), "cuobjdump")
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    return sass, usage


def count(texts, op):
    if op == "HGMMA":
        return sum(1 for t in texts if re.search(r"\bHGMMA\b", t))
    return sum(1 for t in texts if re.search(rf"(?<![\w.]){re.escape(op)}(?![\w])", t)
               or re.search(rf"(?<![\w.]){re.escape(op)}\.", t))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("only", nargs="*")
    ap.add_argument("--hash", action="store_true")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    over = {}
    for kv in args.set:
        k, v = kv.split("=")
        over[k] = int(v)
    families = ((aot_calls.bwd_hopper_calls, aot_calls.bwd_flex_hopper_calls) if args.backward
                else (aot_calls.fwd_hopper_calls, aot_calls.fwd_hopper_fp8_calls,
                      aot_calls.fwd_flex_hopper_calls))
    specs = [s for s in aot_calls.specs(90, [c for f in families for c in f(90)]) if s.gluon]
    for spec in specs:
        if args.only and not any(s in spec.config for s in args.only):
            continue
        try:
            cubin = compile_cubin(spec, over)
        except Exception as exc:
            while exc.__cause__ is not None:
                exc = exc.__cause__
            print(f"FAIL {spec.config}: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}")
            continue
        sass, usage = sass_of(cubin)
        if args.hash:
            # the SASS text, not the cubin: the cubin's line table moves with any edit
            body = "\n".join(ln for ln in sass.splitlines() if ln.strip().startswith("/*"))
            print(hashlib.sha256(body.encode()).hexdigest()[:16], spec.name, spec.config,
                  flush=True)
            continue
        m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", usage)
        ldst = len(re.findall(r"\b(?:LDL|STL)\b", sass))
        print(f"{spec.config}  regs={m.group(1)} stack={m.group(2)} local={m.group(3)} "
              f"LDL/STL={ldst}  kernel MUFU.EX2={count(sass.splitlines(), 'MUFU.EX2')}")
        for lo, hi, texts in innermost_loops(sass):
            if not any("HGMMA" in t for t in texts):
                continue
            cols = " ".join(f"{op}={count(texts, op)}" for op in OPS)
            spills = sum(1 for t in texts if re.search(r"\b(?:LDL|STL)\b", t))
            print(f"  loop {lo:#07x}-{hi:#07x} n={len(texts):<4} {cols} LDL/STL={spills}",
                  flush=True)


if __name__ == "__main__":
    main()
