"""``fp8``: the e4m3 forward (``flash_attn_func`` on float8_e4m3fn q, k, v with descales; sm_90
only) against our bf16 forward on the same shapes, and the FP8 matmul peak of the same GPU."""

from __future__ import annotations

import torch

from ..core import Shape, attn_flops
from ..suite import Row, Suite
from .common import inputs, reference

SHAPES = [
    Shape(4, 16, 4096, 4096, 128),
    Shape(4, 16, 4096, 4096, 128, causal=True),
    Shape(1, 8, 4096, 8192, 128),
    Shape(4, 32, 4096, 4096, 64, causal=True),
    Shape(2, 8, 4096, 4096, 256),
]
CPU_SHAPES = [Shape(1, 2, 40, 40, 32, causal=True)]


def _rows(ctx):
    import solattn

    for shape in (CPU_SHAPES if ctx.cpu else SHAPES):
        x = inputs(shape, ctx)

        def bf16(x=x, shape=shape):
            def run():
                with torch.no_grad():
                    return solattn.flash_attn_func(x.q, x.k, x.v, causal=shape.causal)
            return run

        def fp8(x=x, shape=shape):
            q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (x.q, x.k, x.v))
            ones = torch.ones(shape.b, shape.kv_heads, device=x.q.device, dtype=torch.float32)

            def run():
                return solattn.flash_attn_func(q8, k8, v8, causal=shape.causal, q_descale=ones,
                                               k_descale=ones, v_descale=ones)
            return run

        # the CPU check: the bf16 call against the float64 oracle (FP8 runs on sm_90 only)
        yield Row(shape.label(), {"solattn": bf16, "solattn-fp8": fp8},
                  work=attn_flops(shape), meta=shape.as_dict(),
                  reference=reference(x, "fwd", causal=shape.causal))


def fp8_peak(ctx, res, out=print):
    """The FP8 matmul peak (``torch._scaled_mm`` on 8192^3 e4m3), where torch has it."""
    if ctx.cpu or not ctx.sm90:
        return
    from ..core import time_ms

    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    try:
        ms = time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                              out_dtype=torch.bfloat16))
    except Exception as exc:  # noqa: BLE001 - an older torch: the suite runs without the peak
        out(f"FP8 matmul peak: not measured ({type(exc).__name__})")
        return
    peak = 2 * n**3 / ms / 1e9
    res.set("fp8_matmul_tflops", peak)
    out(f"FP8 matmul peak (e4m3 8192^3, torch._scaled_mm): {peak:.0f} TFLOP/s")


FP8 = Suite("fp8", "the FP8 (e4m3) forward against our bf16 forward on the same shapes, beside "
            "the FP8 matmul peak (TFLOP/s; sm_90)", ("solattn", "solattn-fp8"), _rows,
            baseline="solattn", before=fp8_peak)
