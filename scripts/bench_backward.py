"""Backward TFLOP/s of solattn against SDPA's cuDNN and FLASH (FA2) backends, same inputs, same run.

    python3 scripts/bench_backward.py            # the issue's four shapes, table config
    python3 scripts/bench_backward.py --sweep    # also time candidate BwdConfigs (tuning)

FLOPs = 2.5 x forward = 2.5 * 4 * B * H * L * L * D, halved for causal. Each number is the median
of ``triton.testing.do_bench`` over the backward alone (``torch.autograd.grad`` of a saved forward
graph, ``retain_graph=True``), after a correctness check of solattn's gradients against cuDNN's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from solattn import flash_attn_func
from solattn.configs import BwdConfig, bwd_config
from solattn.core import make_params
from solattn.kernels.triton.backward import attn_bwd

SHAPES = [(4, 16, 4096, 128), (4, 32, 4096, 64)]  # (B, H, L, D)

# Candidate configs for --sweep, per (D, causal): BwdConfig fields in order (block_m, block_n,
# num_warps, num_stages, dq_block_m, dq_block_n, dq_num_warps, dq_num_stages, atomic_dq,
# split_dkdv, edge_m); expanded by name in candidate().
SWEEP = {
    (128, False): [(32, 64, 4, 4, 128, 64, 8, 3, False, False, 16),
                   (64, 64, 4, 2, 128, 64, 8, 3, False, False, 16)],
    (128, True): [(32, 64, 4, 3, 128, 64, 8, 3, False, False, 32),
                  (32, 64, 4, 4, 128, 64, 8, 3, False, False, 16),
                  (64, 64, 4, 2, 128, 64, 8, 3, False, False, 16)],
    (64, False): [(64, 64, 4, 3, 128, 64, 8, 3, False, False, 32),
                  (128, 64, 4, 3, 128, 64, 8, 3, False, False, 32),
                  (64, 64, 4, 4, 128, 64, 8, 3, False, False, 32),
                  (32, 64, 4, 3, 128, 64, 8, 3, False, False, 32)],
    (64, True): [(64, 64, 4, 3, 128, 64, 8, 3, False, False, 32),
                 (128, 64, 4, 3, 128, 64, 8, 3, False, False, 32),
                 (64, 64, 4, 4, 128, 64, 8, 3, False, False, 64),
                 (64, 64, 4, 3, 128, 64, 8, 3, False, False, 64)],
}


def candidate(row) -> BwdConfig:
    """A sweep row -> the keyword-built config."""
    names = [f.name for f in dataclasses.fields(BwdConfig)]
    return BwdConfig(**dict(zip(names, row)))


def kernel_times(fn, iters=20):
    """Mean CUDA time (us) per launch of each kernel ``fn`` runs, by kernel name (profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" and evt.count:
            out[evt.key.split("(")[0][:40]] = getattr(evt, "device_time_total",
                                                      getattr(evt, "cuda_time_total", 0)) / iters
    return out


def flops(b, h, s, d, causal):
    f = 2.5 * 4 * b * h * s * s * d
    return f / 2 if causal else f


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile-part", default=None, metavar="I/N",
                    help="only compile (run once) the I-th of N slices of the sweep, no timing: "
                         "run N of these in parallel first to fill the Triton cache")
    args = ap.parse_args()
    part = tuple(int(x) for x in args.compile_part.split("/")) if args.compile_part else None
    dtype = getattr(torch, args.dtype)
    dev = torch.cuda.get_device_name()
    rows = []
    for b, h, s, d in SHAPES:
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            do = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
            fl = flops(b, h, s, d, causal)
            if part is not None:
                out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
                p = make_params(q, k, causal=causal)
                for i, cand in enumerate(SWEEP[(d, causal)]):
                    if i % part[1] == part[0]:
                        try:
                            attn_bwd(do, q.detach(), k.detach(), v.detach(), out.detach(),
                                     lse.detach(), p, config=candidate(cand))
                        except Exception as exc:  # reported again by the timing run
                            print(f"compile {cand}: {type(exc).__name__}", file=sys.stderr)
                continue
            res = {}
            # solattn through the public API (autograd + custom op): what a user gets
            for det in (False, True):
                out = flash_attn_func(q, k, v, causal=causal, deterministic=det)
                g = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                res[f"solattn{'-det' if det else ''}"] = (
                    bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)), g)
                del out
            # peers: SDPA in (b, h, s, d) layout on the same data
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            dot = do.transpose(1, 2)
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("fa2-sdpa", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        out = torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vt, is_causal=causal)
                    g = torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)
                    ms = bench(lambda: torch.autograd.grad(out, (qt, kt, vt), dot,
                                                           retain_graph=True))
                    res[name] = (ms, tuple(x.transpose(1, 2) for x in g))
                    del out
                except RuntimeError as exc:
                    print(f"{name} unavailable: {str(exc)[:100]}", file=sys.stderr)
            ref = res.get("cudnn", res.get("fa2-sdpa"))[1]
            for name in ("solattn", "solattn-det"):
                errs = [rel_err(a, r) for a, r in zip(res[name][1], ref)]
                if max(errs) > 2e-2:
                    print(f"WRONG {name} b{b} h{h} s{s} d{d} causal={causal}: rel errs {errs}")
            tag = f"B{b} H{h} L{s} D{d} {'causal' if causal else 'full  '}"
            line = "  ".join(f"{n} {fl / ms * 1e-9:6.1f}" for n, (ms, _) in res.items())
            rows.append(f"{tag}  TFLOP/s: {line}")
            print(rows[-1], flush=True)
            if args.sweep:
                out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
                out, lse = out.detach(), lse.detach()
                p = make_params(q, k, causal=causal)
                print(f"  table: {bwd_config(90, d, d)}")
                bk = kernel_times(lambda: attn_bwd(do, q.detach(), k.detach(), v.detach(), out,
                                                   lse, p))
                print("  table kernels (us): " + ", ".join(f"{n} {t:.0f}" for n, t in bk.items()))
                for cand in SWEEP[(d, causal)]:
                    cfg = candidate(cand)
                    try:
                        g = attn_bwd(do, q.detach(), k.detach(), v.detach(), out, lse, p,
                                     config=cfg)
                        errs = max(rel_err(a, r) for a, r in zip(g, ref))
                        ms = bench(lambda: attn_bwd(do, q.detach(), k.detach(), v.detach(), out,
                                                    lse, p, config=cfg))
                        print(f"  sweep {cand}: {fl / ms * 1e-9:6.1f} TFLOP/s  err {errs:.1e}",
                              flush=True)
                    except Exception as exc:  # a candidate that does not compile / fit
                        print(f"  sweep {cand}: FAILED {type(exc).__name__}: {str(exc)[:120]}")
            res = None
            torch.cuda.empty_cache()
    if part is not None:
        return 0
    print(f"\n{dev}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, "
          "backward only, median of do_bench")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
