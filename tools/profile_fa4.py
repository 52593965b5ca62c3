"""FlashAttention-4's sm90 kernels beside ours: timings and one Nsight Compute window (issue 38).

usage (on the GPU machine, FA4 importable as CONTRIBUTING.md stages it; tools/profile_fa4.sh
runs all of this and packs the outputs):
  python tools/profile_fa4.py bench [--variants]   do_bench medians of both libraries, every
                                                   case in one process, interleaved passes;
                                                   --variants adds our kernels with FA4's tile
                                                   choices as HopperFwdConfig/HopperBwdConfig
                                                   overrides (measurement only)
  python tools/profile_fa4.py profile [LIB ...]    warm every case, then one call of each case
                                                   and library between cudaProfilerStart/Stop
                                                   (run under `ncu --profile-from-start off`)
  PROFILE_CASES=NAME[,NAME...] (environment)       keep those CASES only (e.g. an ncu window
                                                   of one case: fwd_d128_causal)

Both libraries are called through their public functions: ``solattn.flash_attn_func`` (with
SOLATTN_BACKEND=hopper, so a compile failure raises instead of falling back) and
``flash_attn.cute.flash_attn_func``. The backward is timed as ``torch.autograd.grad`` of one
recorded forward (as ``solattn bench`` does). bf16, FLOPs = 4 B H Lq Lk D (half for causal,
x2.5 for the backward).
"""
import dataclasses
import os
import statistics
import sys

import torch
import triton

os.environ.setdefault("SOLATTN_BACKEND", "hopper")

# name, pass, batch, heads, seqlen_q, seqlen_k, head dim, causal
CASES = [
    ("fwd_d128", "fwd", 1, 8, 4096, 8192, 128, False),
    ("fwd_d64", "fwd", 4, 32, 4096, 4096, 64, False),
    ("fwd_d128_causal", "fwd", 4, 16, 4096, 4096, 128, True),
    ("bwd_d128", "bwd", 4, 16, 4096, 4096, 128, False),
    ("bwd_d128_causal", "bwd", 4, 16, 4096, 4096, 128, True),
    ("bwd_d64_causal", "bwd", 4, 32, 4096, 4096, 64, True),
]


if os.environ.get("PROFILE_CASES"):
    CASES = [c for c in CASES if c[0] in os.environ["PROFILE_CASES"].split(",")]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def libraries():
    import solattn

    libs = {"solattn": lambda q, k, v, causal: solattn.flash_attn_func(q, k, v, causal=causal)}
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:  # noqa: BLE001 - report and go on with ours alone
        print(f"fa4 not importable: {type(exc).__name__}: {exc}", flush=True)
    else:
        libs["fa4"] = lambda q, k, v, causal: _first(fa4(q, k, v, causal=causal))
    return libs


def inputs(case, seed=0):
    _, _, b, h, sq, sk, d, _ = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                               generator=g).requires_grad_()
    return mk(sq), mk(sk), mk(sk), torch.randn(b, sq, h, d, device="cuda",
                                                dtype=torch.bfloat16, generator=g)


def flops(case):
    _, kind, b, h, sq, sk, d, causal = case
    f = 4 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return f * (2.5 if kind == "bwd" else 1.0)


def callable_of(case, fn, x):
    """A zero-argument callable running the case's pass once."""
    q, k, v, dout = x
    causal = case[7]
    if case[1] == "fwd":
        def fwd():
            with torch.no_grad():
                return fn(q, k, v, causal)
        return fwd
    out = fn(q, k, v, causal)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def variants(case, x):
    """Our kernels with FA4's tile choices, through the config overrides of the kernel modules
    (forward: FA4's 2-stage ring at d=128 and its 192x128 tile, three consumer warpgroups at 160
    registers, at d=64; backward: FA4's 128x128 tile at d=64, and for reference our d=128
    backward without its one-step lookahead)."""
    from solattn.core import make_params
    from solattn.kernels.hopper import backward_plan as B
    from solattn.kernels.hopper import forward_plan as F

    q, k, v, dout = x
    name, kind, _, _, _, sk, d, causal = case
    p = make_params(q, k, causal=causal)
    out = {}
    if kind == "fwd":
        base = F.hopper_fwd_config(d, causal, seqlen_k=sk)
        overs = {128: {"stages2": dict(stages=2)},
                 64: {"c3_160": dict(consumers=3, consumer_regs=160),
                      "c3_160_tile": dict(consumers=3, consumer_regs=160, persistent=False,
                                          dynamic=False)}}.get(d, {})
        for vname, over in overs.items():
            cfg = dataclasses.replace(base, **over)
            def run(cfg=cfg):
                with torch.no_grad():
                    return F.attn_fwd(q, k, v, p, return_lse=True, config=cfg)[0]
            out[vname] = run
        return out
    with torch.no_grad():
        o, lse = F.attn_fwd(q, k, v, p, return_lse=True)
    base = B.hopper_bwd_config(d)
    overs = {64: {"m128": dict(block_m=128)}, 128: {"lookahead0": dict(lookahead=0)}}.get(d, {})
    for vname, over in overs.items():
        cfg = dataclasses.replace(base, **over)
        out[vname] = (lambda cfg=cfg: B.attn_bwd(dout, q, k, v, o, lse, p, config=cfg))
    return out


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(case, fns, x):
    """Relative difference of each library's result to the first library's (sanity only: the
    test suite checks correctness against the float64 oracle)."""
    res = {n: f() for n, f in fns.items()}
    names = list(res)
    ref = res[names[0]]
    for n in names[1:]:
        got = res[n]
        if isinstance(ref, torch.Tensor):
            print(f"  {case[0]} {n} vs {names[0]}: rel {_rel(got, ref):.2e}", flush=True)
        else:
            print(f"  {case[0]} {n} vs {names[0]}: rel dq/dk/dv "
                  + " ".join(f"{_rel(a, b):.2e}" for a, b in zip(got, ref)), flush=True)


def warm_gpu(seconds=2.0):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ a, warmup=int(seconds * 1000), rep=200,
                                 return_mode="median")
    print(f"warm-up matmul 8192^3 bf16: {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s", flush=True)


def bench(with_variants, passes=3):
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    libs = libraries()
    warm_gpu()
    rows = []
    for case in CASES:
        x = inputs(case)
        fns = {n: callable_of(case, f, x) for n, f in libs.items()}
        if with_variants:
            try:
                fns.update({f"solattn:{n}": f for n, f in variants(case, x).items()})
            except Exception as exc:  # noqa: BLE001 - a variant that does not build is a result
                print(f"  {case[0]} variants failed: {type(exc).__name__}: {exc}", flush=True)
        for n, f in list(fns.items()):
            try:
                f()
            except Exception as exc:  # noqa: BLE001
                print(f"  {case[0]} {n} failed: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[-1] if str(exc) else ''}", flush=True)
                del fns[n]
        torch.cuda.synchronize()
        check(case, fns, x)
        res = {n: [] for n in fns}
        for _ in range(passes):
            for n, f in fns.items():
                ms = triton.testing.do_bench(f, warmup=100, rep=400, return_mode="median")
                res[n].append(ms)
        for n, ms in res.items():
            med = statistics.median(ms)
            rows.append((case[0], n, med, flops(case) / med / 1e9, ms))
            print(f"{case[0]:18s} {n:24s} {med * 1e3:9.1f} us {flops(case) / med / 1e9:6.0f} "
                  f"TFLOP/s  passes(us) {' '.join(f'{m * 1e3:.1f}' for m in ms)}", flush=True)
        del fns, x
        torch.cuda.empty_cache()
    print("\n| case | library | us (median of pass medians) | TFLOP/s | / fa4 |")
    print("|---|---|---|---|---|")
    fa4 = {c: t for c, n, t, _, _ in rows if n == "fa4"}
    for c, n, t, tf, _ in rows:
        ratio = f"{fa4[c] / t:.3f}" if c in fa4 else ""
        print(f"| {c} | {n} | {t * 1e3:.1f} | {tf:.0f} | {ratio} |")


def profile(names):
    libs = libraries()
    names = names or list(libs)
    calls = []
    for case in CASES:
        x = inputs(case)
        for n in names:
            f = callable_of(case, libs[n], x)
            f()
            f()
            calls.append((case[0], n, f))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for cname, n, f in calls:
        torch.cuda.nvtx.range_push(f"{cname}/{n}")
        f()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"profiled {cname} {n}", flush=True)
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    if sys.argv[1] == "bench":
        bench("--variants" in sys.argv[2:])
    elif sys.argv[1] == "profile":
        profile(sys.argv[2:])
    else:
        raise SystemExit(__doc__)
