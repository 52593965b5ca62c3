"""Backward TFLOP/s of the Hopper (Gluon) backward against the portable one, cuDNN and FLASH.

    python3 scripts/bench_hopper_backward.py                 # the five issue-10 shapes
    python3 scripts/bench_hopper_backward.py --sweep         # also HopperBwdConfig candidates
    python3 scripts/bench_hopper_backward.py --kernels       # per-kernel times of ours-hopper
    python3 scripts/bench_hopper_backward.py --layer         # also forward + backward of a layer

FLOPs = 2.5 x forward = 2.5 * 4 * B * H * L * L * D, halved for causal. Each number is the median
of ``triton.testing.do_bench`` over the backward alone (``torch.autograd.grad`` of a saved forward
graph, ``retain_graph=True``), after a warm-up call and a check of the gradients against cuDNN's.
ours-hopper / ours-portable force solattn's backward kernel (``forced_backend``) through the
public API; cudnn / flash are torch SDPA with that backend alone, on the same data.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from solattn import flash_attn_func
from solattn.core import make_params
from solattn.dispatch import forced_backend
from solattn.kernels.hopper.backward import HopperBwdConfig, attn_bwd, hopper_bwd_config

# (B, H, L, D, causal): the shapes.
SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (4, 32, 4096, 64, False),
          (4, 32, 4096, 64, True), (1, 16, 16384, 128, True)]

# --sweep candidates per head dim: HopperBwdConfig keyword sets.
SWEEP = {
    128: [dict(block_m=64, block_n=128, stages=2, lookahead=1, dq_writer=True,
               producer_regs=40)],
    64: [dict(block_m=64, block_n=128, stages=2, lookahead=1, dq_writer=True,
              producer_regs=32)],
}


def flops(b, h, s, d, causal):
    f = 2.5 * 4 * b * h * s * s * d
    return f / 2 if causal else f


def bench(fn):
    fn()  # warm-up (compilation, allocator)
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kernel_times(fn, iters=10):
    """Mean CUDA time (us) per call of each kernel ``fn`` runs, by kernel name (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {evt.key[:48]: evt.device_time_total / iters for evt in prof.key_averages()
            if evt.device_type.name == "CUDA" and evt.count}


def layer_times(q, k, v, do, causal, fl):
    """Forward + backward of one layer (``flash_attn_func`` with its default backends, SDPA
    cuDNN, SDPA FLASH) on the same inputs: ms and TFLOP/s (FLOPs = 3.5 x forward), and our
    ratios of speed."""
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def ours():
        out = flash_attn_func(*leaves, causal=causal)
        return torch.autograd.grad(out, leaves, do)

    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    dot = do.transpose(1, 2)
    ms = {"ours": bench(ours)}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                     is_causal=causal)
            return torch.autograd.grad(o, (qt, kt, vt), dot)
        try:
            ms[name] = bench(sdpa)
        except RuntimeError as exc:
            print(f"{name} unavailable: {str(exc)[:100]}", file=sys.stderr)
    cells = "  ".join(f"{n} {t:.3f} ms ({fl / t * 1e-9:.0f})" for n, t in ms.items())
    ratios = "  ".join(f"ours/{n} {ms[n] / ms['ours']:.2f}" for n in ms if n != "ours")
    return f"{cells}  |  speed {ratios}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--only", type=int, nargs="*", help="indices into SHAPES")
    ap.add_argument("--layer", action="store_true",
                    help="also time forward + backward of one attention layer (the default "
                         "dispatch: what a training step runs) against cuDNN and FA2")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for i, (b, h, s, d, causal) in enumerate(SHAPES):
        if args.only and i not in args.only:
            continue
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        do = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        fl = flops(b, h, s, d, causal)
        res = {}
        out = flash_attn_func(q, k, v, causal=causal)
        for name, backend in (("ours-hopper", "hopper"), ("ours-portable", "portable")):
            def grad(backend=backend):
                with forced_backend(backend):
                    return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            g = grad()
            res[name] = (bench(grad), g)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        dot = do.transpose(1, 2)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                         is_causal=causal)
                g = torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)
                ms = bench(lambda o=o: torch.autograd.grad(o, (qt, kt, vt), dot,
                                                           retain_graph=True))
                res[name] = (ms, tuple(x.transpose(1, 2) for x in g))
            except RuntimeError as exc:
                print(f"{name} unavailable: {str(exc)[:100]}", file=sys.stderr)
        ref = res.get("cudnn", res.get("flash"))[1]
        for name in ("ours-hopper", "ours-portable"):
            errs = [rel_err(a, r) for a, r in zip(res[name][1], ref)]
            if max(errs) > 2e-2:
                print(f"WRONG {name} B{b} H{h} L{s} D{d} causal={causal}: rel errs {errs}")
        tf = {n: fl / ms * 1e-9 for n, (ms, _) in res.items()}
        tag = f"B{b} H{h} L{s} D{d} {'causal' if causal else 'full  '}"
        line = "  ".join(f"{n} {t:6.1f}" for n, t in tf.items())
        ratios = "  ".join(f"hopper/{n} {tf['ours-hopper'] / tf[n]:.2f}" for n in tf
                           if n != "ours-hopper")
        rows.append(f"{tag}  TFLOP/s: {line}  |  {ratios}")
        print(rows[-1], flush=True)
        if args.layer:
            rows.append(f"{tag}  fwd+bwd: " + layer_times(q, k, v, do, causal, fl * 3.5 / 2.5))
            print(rows[-1], flush=True)

        if args.kernels or args.sweep:
            with torch.no_grad():
                o2, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
            p = make_params(q, k, causal=causal)
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            if args.kernels:
                kt_ = kernel_times(lambda: attn_bwd(do, qd, kd, vd, o2, lse, p))
                print("  kernels (us): " + ", ".join(f"{n} {t:.0f}" for n, t in kt_.items()))
            if args.sweep:
                print(f"  table: {hopper_bwd_config(d)}")
                for kw in SWEEP[d]:
                    cfg = HopperBwdConfig(**kw)
                    try:
                        g = attn_bwd(do, qd, kd, vd, o2, lse, p, config=cfg)
                        err = max(rel_err(a, r) for a, r in zip(g, ref))
                        ms = bench(lambda cfg=cfg: attn_bwd(do, qd, kd, vd, o2, lse, p,
                                                            config=cfg))
                        print(f"  sweep {kw}: {fl / ms * 1e-9:6.1f} TFLOP/s  err {err:.1e}",
                              flush=True)
                    except Exception as exc:  # a candidate that does not compile / fit
                        print(f"  sweep {kw}: FAILED {type(exc).__name__}: {str(exc)[:160]}")
        res = out = None
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, {args.dtype}, backward only, median of do_bench")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
