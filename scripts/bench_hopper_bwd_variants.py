"""Time HopperBwdConfig variants of the Hopper backward against cuDNN, in one process.

    python3 scripts/bench_hopper_bwd_variants.py --compile   # JIT every variant, in parallel
    python3 scripts/bench_hopper_bwd_variants.py             # time them (issue-10 shapes)
    python3 scripts/bench_hopper_bwd_variants.py --only d128_rs_la1_split

``--compile`` launches each (variant, causal) once on a tiny problem in its own process (spawn,
up to 15 at a time) so that the timing process only reads Triton's cache. Timing: for each shape
the variants (through :func:`attn_bwd` with ``config=``: preprocess + kernel + dQ conversion)
and SDPA's cuDNN backward, each the median of ``do_bench`` after a warm-up call; ``--repeat``
runs the whole list again in the same process (run-to-run spread). Gradients are checked
against cuDNN's (relative error printed). FLOPs = 2.5 * 4 * B * H * L^2 * D, halved for causal.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import sys

SHAPES = {"A": (4, 16, 4096, 128, False), "Ac": (4, 16, 4096, 128, True),
          "B": (4, 32, 4096, 64, False), "Bc": (4, 32, 4096, 64, True),
          "C": (1, 16, 16384, 128, True),
          # one ring step's non-causal piece at 256k tokens, MHA (ring: B1 Hq32 Hkv8)
          "D": (1, 32, 32768, 128, False)}

# The 8-byte, 2-row dQ staging swizzle with 32-register workers (d=64's shipped config differs).
_SWZ2x2 = dict(dq_vec=2, writer_rows=2, producer_regs=32)
# name -> (head dim, HopperBwdConfig fields over the head dim's shipped config)
VARIANTS = {
    "d128_ss_la1": (128, dict(lookahead=1, dk_from_regs=False, dq_pad=False)),
    "d128_ss_la1_pad": (128, dict(lookahead=1, dk_from_regs=False, dq_pad=True)),
    "d128_rs_la1": (128, dict(lookahead=1, dk_from_regs=True, dq_pad=False)),
    "d128_rs_la1_pad": (128, dict(lookahead=1, dk_from_regs=True, dq_pad=True)),
    "d128_rs_la0_pad": (128, dict(lookahead=0, dk_from_regs=True, dq_pad=True)),
    "d128_ss_la0_pad": (128, dict(lookahead=0, dk_from_regs=False, dq_pad=True)),
    # d=64 with the 2-row 8-byte swizzle of the dQ staging (shipped before issue 10's d64 pass)
    "d64_ss_la2": (64, dict(lookahead=2, dk_from_regs=False, **_SWZ2x2)),
    "d64_rs_la2": (64, dict(lookahead=2, dk_from_regs=True, **_SWZ2x2)),
    # d=64 dQ staging in 32-byte chunks swizzled over 4 rows (writer loads 4 rows: 40 worker
    # registers), over 2 rows, and the 40-register workers alone
    "d64_rs_la2_p40": (64, dict(_SWZ2x2, lookahead=2, dk_from_regs=True, producer_regs=40)),
    "d64_rs_la2_swz4": (64, dict(lookahead=2, dk_from_regs=True, producer_regs=40, dq_vec=8,
                                 writer_rows=4)),
    "d64_rs_la2_swz2": (64, dict(lookahead=2, dk_from_regs=True, producer_regs=40, dq_vec=8,
                                 writer_rows=2)),
    "d64_ss_la2_swz4": (64, dict(lookahead=2, dk_from_regs=False, producer_regs=40, dq_vec=8,
                                 writer_rows=4)),
    "d64_rs_la1_swz4": (64, dict(lookahead=1, dk_from_regs=True, producer_regs=40, dq_vec=8,
                                 writer_rows=4)),
    # CTAs starting at their key block's query block (stagger) or all at the first, as shipped
    "d128_stagger": (128, dict(stagger=True)),
    "d128_nostagger": (128, dict(stagger=False)),
    "d64_stagger": (64, dict(stagger=True)),
    "d64_nostagger": (64, dict(stagger=False)),
}
# The other configs tests/test_hopper_backward.py runs (compiled with --compile --tests).
TEST_ONLY = {
    f"d{d}_{tag}": (d, dict(kw, dk_from_regs=False, dq_pad=False,
                            **(_SWZ2x2 if d == 64 else {})))
    for d in (64, 128)
    for tag, kw in (("ss_la0_red", dict(lookahead=0, dq_writer=False)),
                    ("ss_la1_red", dict(lookahead=1, dq_writer=False)),
                    ("ss_la0_s3", dict(lookahead=0, stages=3)),
                    ("ss_la1", dict(lookahead=1)), ("ss_la0", dict(lookahead=0)),
                    ("ss_la2", dict(lookahead=2)))
    if not (d == 128 and tag == "ss_la2")
}
for _d in (64, 128):
    TEST_ONLY[f"d{_d}_rs_la0"] = (_d, dict(lookahead=0, dk_from_regs=True, dq_pad=False))
    TEST_ONLY[f"d{_d}_rs_la1_s3"] = (_d, dict(lookahead=1, dk_from_regs=True, stages=3,
                                             dq_pad=False))
TEST_ONLY["d64_rs_la1"] = (64, dict(lookahead=1, dk_from_regs=True, **_SWZ2x2))
for _name, (_d, _kw) in TEST_ONLY.items():
    if _d == 64:
        _kw.update({k: v for k, v in _SWZ2x2.items() if k not in _kw})


def config(name):
    from solattn.kernels.hopper.backward import hopper_bwd_config

    d, kw = {**TEST_ONLY, **VARIANTS}[name]
    return d, dataclasses.replace(hopper_bwd_config(d), **kw)


def _compile_one(job):
    """JIT one (variant, causal) on a tiny problem (fills Triton's cache); -> a line."""
    import torch

    from solattn import flash_attn_func
    from solattn.core import make_params
    from solattn.kernels.hopper.backward import attn_bwd

    name, causal = job
    try:
        if name == "forward":
            for d in (64, 128):
                q = torch.randn(1, 200, 2, d, device="cuda", dtype=torch.bfloat16)
                flash_attn_func(q, q, q, causal=causal)
            torch.cuda.synchronize()
            return f"compiled forward causal={causal}"
        d, cfg = config(name)
        q, k, v, do = (torch.randn(1, 200, 2, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        attn_bwd(do, q, k, v, out, lse, make_params(q, k, causal=causal), config=cfg)
        torch.cuda.synchronize()
        return f"compiled {name} causal={causal}"
    except Exception as exc:  # report, keep going
        return f"FAILED {name} causal={causal}: {type(exc).__name__}: {str(exc)[:300]}"


def flops(b, h, s, d, causal):
    f = 2.5 * 4 * b * h * s * s * d
    return f / 2 if causal else f


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--tests", action="store_true", help="--compile the tests' configs too")
    ap.add_argument("--once", action="store_true", help="one call per variant (a profiler's)")
    args = ap.parse_args()
    names = args.only or list(VARIANTS)
    if args.compile and args.tests:
        names += [n for n in TEST_ONLY if n not in names]
    if args.compile:
        jobs = [("forward", c) for c in (False, True)]
        jobs += [(n, c) for n in names for c in (False, True)]
        with multiprocessing.get_context("spawn").Pool(min(15, len(jobs))) as pool:
            for line in pool.imap_unordered(_compile_one, jobs):
                print(line, flush=True)
        return 0

    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from solattn import flash_attn_func
    from solattn.core import make_params
    from solattn.kernels.hopper.backward import attn_bwd

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    table = {}
    for rep in range(args.repeat):
        for tag in args.shapes:
            b, h, s, d, causal = SHAPES[tag]
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(4))
            with torch.no_grad():
                out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
            p = make_params(q, k, causal=causal)
            fl = flops(b, h, s, d, causal)
            if args.once:
                for name in names:
                    vd, cfg = config(name)
                    if vd == d:
                        attn_bwd(do, q, k, v, out, lse, p, config=cfg)
                torch.cuda.synchronize()
                continue
            qt, kt, vt = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                     is_causal=causal)
            dot = do.transpose(1, 2)
            ref = [g.transpose(1, 2) for g in
                   torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)]
            ms = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True))
            table.setdefault((tag, "cudnn"), []).append(fl / ms * 1e-9)
            print(f"{tag:3s} cudnn {fl / ms * 1e-9:6.1f}", flush=True)
            for name in names:
                vd, cfg = config(name)
                if vd != d:
                    continue
                try:
                    g = attn_bwd(do, q, k, v, out, lse, p, config=cfg)
                    err = max(((a.float() - r.float()).norm() / r.float().norm()).item()
                              for a, r in zip(g, ref))
                    ms = bench(lambda cfg=cfg: attn_bwd(do, q, k, v, out, lse, p, config=cfg))
                    tf = fl / ms * 1e-9
                    table.setdefault((tag, name), []).append(tf)
                    print(f"{tag:3s} {name:24s} {tf:6.1f}  err {err:.1e}"
                          f"{'  WRONG' if err > 2e-2 else ''}", flush=True)
                except Exception as exc:
                    print(f"{tag:3s} {name:24s} FAILED {type(exc).__name__}: {str(exc)[:200]}")
            o = out = lse = g = None
            torch.cuda.empty_cache()
    if args.once:
        return 0
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, bf16, backward only, TFLOP/s (median of do_bench; "
          f"runs: {args.repeat})")
    rows = sorted({n for _, n in table}, key=lambda n: (n != "cudnn", n))
    print(f"{'variant':24s} " + " ".join(f"{t:>11s}" for t in args.shapes))
    for n in rows:
        cells = []
        for t in args.shapes:
            vals = table.get((t, n))
            cells.append("/".join(f"{x:.0f}" for x in vals) if vals else "-")
        print(f"{n:24s} " + " ".join(f"{c:>11s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
