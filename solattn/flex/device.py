"""Device helpers the generated mod functions call: PyTorch's integer and float semantics where
Triton's differ (``//`` and ``%`` truncate toward zero in Triton, floor in PyTorch), and the few
math functions Triton's interpreter lacks. Kept as ``@triton.jit`` functions so the generated
source stays short and readable."""

from __future__ import annotations

import triton
import triton.language as tl

from solattn.kernels.common import tanh_f32  # noqa: F401  (re-exported to generated code)


@triton.jit
def floordiv_int(a, b):
    """``torch.floor_divide`` on integers (Triton's ``//`` truncates)."""
    q = a // b
    return q - ((q * b != a) & ((a < 0) != (b < 0))).to(q.dtype)


@triton.jit
def remainder_int(a, b):
    """``torch.remainder`` on integers: the sign of the divisor (Triton's ``%`` takes the
    dividend's)."""
    r = a % b
    return r + tl.where((r != 0) & ((r < 0) != (b < 0)), b, 0)


@triton.jit
def floordiv_float(a, b):
    return tl.floor(a / b)


@triton.jit
def remainder_float(a, b):
    return a - tl.floor(a / b) * b


@triton.jit
def trunc_float(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def sign(x):
    return tl.where(x > 0, 1, tl.where(x < 0, -1, 0))


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def wrap_index(i, size):
    """PyTorch's negative indices count from the end."""
    return tl.where(i < 0, i + size, i)


# The Gluon twins' (codegen.GLUON_SUFFIX) tanh and sigmoid: the same formulas with
# div.full.f32 (2 ulp) for the IEEE division, which compiles to a called subroutine whose
# registers made the Hopper flex kernel's consumers spill (`solattn aot --arch 90`, d=128 softcap:
# 80 bytes, 36 local accesses in loops).
@triton.jit
def tanh_fast(x):
    e = tl.exp2(x * 2.8853900817779268)  # 2 * log2(e)
    return 1.0 - 2.0 * tl.fdiv(e * 0.0 + 1.0, e + 1.0)


@triton.jit
def sigmoid_fast(x):
    e = tl.exp(-x)
    return tl.fdiv(e * 0.0 + 1.0, 1.0 + e)
