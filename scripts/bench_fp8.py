"""FP8 (e4m3) forward on the H100: accuracy against the dequantized oracle, and TFLOP/s against
our bf16 forward and the measured FP8 matmul peak, in one process.

    PYTHONPATH=. python scripts/bench_fp8.py [--accuracy] [--bench] [--alt]

``--accuracy``: max / mean |out - oracle| of the FP8 kernel and of the FP8 twin
(tests/test_fp8.py's ``fp8_twin``), and the max LSE error, on random inputs.
``--bench``: bf16 and FP8 forward on the issue's shapes (``triton.testing.do_bench`` medians,
warmup 100 ms, rep 400 ms), the cost of the V transpose copy alone, and ``torch._scaled_mm`` on
8192^3 e4m3 as the FP8 peak. ``--alt``: other FP8 configs at d=128 (stages).
Variants are compiled first in parallel processes (Triton's JIT is CPU-bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SHAPES = [  # (name, b, h, h_kv, s_q, s_k, d, causal)
    ("B4 H16 L4096 D128", 4, 16, 16, 4096, 4096, 128, False),
    ("B4 H16 L4096 D128 causal", 4, 16, 16, 4096, 4096, 128, True),
    ("B1 H8 Lq4096 Lk8192 D128", 1, 8, 8, 4096, 8192, 128, False),
]


def _inputs(b, h, h_kv, s_q, s_k, d, dtype):
    q = torch.randn(b, s_q, h, d, device="cuda")
    k = torch.randn(b, s_k, h_kv, d, device="cuda")
    v = torch.randn(b, s_k, h_kv, d, device="cuda")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _alt_configs():
    from solattn.kernels.hopper import forward as F

    base = F._FP8_CONFIGS[128]
    return {f"fp8 s{s}": dataclasses.replace(base, stages=s) for s in (2, 3) if s != base.stages}


def _compile_one(job):
    """Run one small call of a variant so that its binary lands in Triton's disk cache."""
    kind, d, causal, extra = job
    from solattn import flash_attn_func
    from solattn.core import make_params
    from solattn.kernels.hopper import forward as F

    dtype = torch.float8_e4m3fn if kind.startswith("fp8") else torch.bfloat16
    q, k, v = _inputs(1, 2, 2 if extra != "gqa" else 1, 300, 300, d, dtype)
    kw = dict(causal=causal)
    if extra == "window":
        kw = dict(causal=causal, window_size=(64, 16))
    elif extra == "softcap":
        kw = dict(causal=causal, softcap=20.0)
    if kind.startswith("fp8 s"):
        cfg = _alt_configs()[kind]
        p = make_params(q, k, **kw)
        F.attn_fwd(q, k, v, p, return_lse=True, config=cfg)
    else:
        flash_attn_func(q, k, v, return_lse=True, **kw)
    torch.cuda.synchronize()
    return f"{kind} d{d} causal={causal} {extra}"


def precompile(alt: bool):
    jobs = [("bf16", 128, c, "") for c in (False, True)]
    jobs += [("fp8", d, c, "") for d in (64, 128, 256) for c in (False, True)]
    jobs += [("fp8", 128, False, "window"), ("fp8", 128, True, "softcap")]
    if alt:
        jobs += [(name, 128, c, "") for name in _alt_configs() for c in (False, True)]
    with mp.get_context("spawn").Pool(min(len(jobs), 12)) as pool:
        for line in pool.imap_unordered(_compile_one, jobs):
            print("compiled", line, flush=True)


def accuracy():
    from test_fp8 import fp8_twin, make_inputs

    from solattn import flash_attn_func
    from solattn.reference import attention_ref

    print("\n| shape | causal | max err | mean err | twin max err | twin mean err | "
          "max LSE err | max |ref| |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (b, s_q, s_k, h, h_kv, d) in [(2, 1024, 1024, 8, 8, 128), (1, 4096, 4096, 4, 1, 128),
                                      (1, 333, 2000, 8, 2, 64), (1, 1000, 1000, 4, 4, 256)]:
        for causal in (False, True):
            (q8, k8, v8), (qs, ks, vs), (qd, kd, vd) = make_inputs(b, s_q, s_k, h, h_kv, d)
            out, lse = flash_attn_func(q8, k8, v8, causal=causal, return_lse=True,
                                       q_descale=qs, k_descale=ks, v_descale=vs)
            ref, ref_lse = attention_ref(qd, kd, vd, causal=causal)
            twin = fp8_twin(qd, kd, vd, causal=causal)
            err = (out.double() - ref).abs()
            terr = (twin.double() - ref).abs()
            lerr = (lse.double() - ref_lse).abs()
            lerr = lerr[torch.isfinite(ref_lse)].max().item()
            print(f"| B{b} Lq{s_q} Lk{s_k} H{h}/{h_kv} D{d} | {causal} | {err.max():.3e} | "
                  f"{err.mean():.3e} | {terr.max():.3e} | {terr.mean():.3e} | {lerr:.3e} | "
                  f"{ref.abs().max():.2f} |", flush=True)


def bench(alt: bool):
    import triton

    from solattn import flash_attn_func
    from solattn.core import make_params
    from solattn.kernels.hopper import forward as F

    def t(fn):
        return triton.testing.do_bench(fn, warmup=100, rep=400, return_mode="median")

    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    bm = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device="cuda")
    for _ in range(3):
        torch._scaled_mm(a, bm, one, one, out_dtype=torch.bfloat16)
    peak = 2 * n**3 / t(lambda: torch._scaled_mm(a, bm, one, one, out_dtype=torch.bfloat16)) \
        / 1e9
    ab = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf_peak = 2 * n**3 / t(lambda: ab @ ab) / 1e9
    print(f"\nfp8 matmul peak (torch._scaled_mm 8192^3 e4m3 -> bf16): {peak:.0f} TFLOP/s; "
          f"bf16 matmul 8192^3: {bf_peak:.0f} TFLOP/s")
    alts = _alt_configs() if alt else {}
    cols = ["bf16", "fp8", "fp8 kernel only"] + list(alts)
    print("\n| shape | " + " | ".join(cols) + " | fp8 / bf16 | fp8 / fp8 peak | V copy us |")
    print("| --- |" + " --- |" * (len(cols) + 3))
    for name, b, h, h_kv, s_q, s_k, d, causal in SHAPES:
        flops = 4 * b * h * s_q * s_k * d * (0.5 if causal else 1.0)
        qb, kb, vb = _inputs(b, h, h_kv, s_q, s_k, d, torch.bfloat16)
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (qb, kb, vb))
        ds = torch.rand(b, h_kv, device="cuda") + 0.5
        res = {}
        res["bf16"] = t(lambda: flash_attn_func(qb, kb, vb, causal=causal))
        res["fp8"] = t(lambda: flash_attn_func(q8, k8, v8, causal=causal, q_descale=ds,
                                               k_descale=ds, v_descale=ds))
        p = make_params(q8, k8, causal=causal, q_descale=ds, k_descale=ds, v_descale=ds)
        vt = F.fp8_v_operand(v8)
        plan = F._plan(q8, k8, v8, p, True, None)
        out = torch.empty(q8.shape, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(plan.lse_shape, device="cuda")

        def kernel_only(plan=plan, vt=vt, out=out, lse=lse):
            plan.launch(plan.q_desc(q8), plan.k_desc(k8), plan.v_desc(vt), plan.o_desc(out),
                        out, lse, out, out, out, ds, ds, ds)
        res["fp8 kernel only"] = t(kernel_only)
        for aname, cfg in alts.items():
            res[aname] = t(lambda cfg=cfg: F.attn_fwd(q8, k8, v8, p, return_lse=True,
                                                       config=cfg))
        copy_us = t(lambda: plan.v_launch(v8.view(torch.uint8), vt.view(torch.uint8))) * 1e3
        tf = {c: flops / res[c] / 1e9 for c in cols}
        print(f"| {name} | " + " | ".join(f"{tf[c]:.0f}" for c in cols) +
              f" | {tf['fp8'] / tf['bf16']:.2f}x | {tf['fp8'] / peak:.2f} | {copy_us:.0f} |",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--alt", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    precompile(args.alt)
    if args.accuracy:
        accuracy()
    if args.bench:
        bench(args.alt)


if __name__ == "__main__":
    main()
