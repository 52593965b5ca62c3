"""Compile one Hopper-forward AOT spec on the CPU and dump its TTGIR, PTX, cubin and SASS.

usage: python tools/hopper_dbg.py "<part of a config>"  (writes /tmp/hk/k.{ttgir,ptx,sass})

Prints the innermost compiler error on failure (the full chain hides it). Useful checks on the
SASS: `grep -c LDL`, `grep USETMAXREG`, and the order of `WARPGROUP.DEPBAR` / `MUFU.EX2`.
Set TRITON_DUMP_PTXAS_LOG=1 for ptxas' own report (C75xx performance warnings).
"""
import os
import subprocess
import sys

os.environ["TRITON_ALWAYS_COMPILE"] = "1"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from solattn.kernels.hopper import forward as F  # noqa: E402
from solattn.kernels.sass import bin_dir  # noqa: E402

spec = next(s for s in F.aot_specs(90) if sys.argv[1] in s.config)
params = list(spec.signature)
consts = {(params.index(n),): v for n, v in spec.constexprs.items()}
attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in spec.pointer_args}
try:
    kernel = triton.compile(GluonASTSource(spec.fn, spec.signature, consts, attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(spec.options))
except Exception as exc:  # the innermost cause names the failing line
    while exc.__cause__ is not None:
        exc = exc.__cause__
    print(str(exc)[-3000:])
    sys.exit(1)
os.makedirs("/tmp/hk", exist_ok=True)
for ext in ("ttgir", "ptx"):
    with open(f"/tmp/hk/k.{ext}", "w") as f:
        f.write(kernel.asm[ext])
with open("/tmp/hk/k.cubin", "wb") as f:
    f.write(kernel.asm["cubin"])
sass = subprocess.run([os.path.join(bin_dir(), "cuobjdump"), "-sass", "/tmp/hk/k.cubin"],
                      capture_output=True, text=True).stdout
with open("/tmp/hk/k.sass", "w") as f:
    f.write(sass)
print(spec.config, "shared", kernel.metadata.shared, "warps", kernel.metadata.num_warps)
