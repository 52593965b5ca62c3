"""Forward TFLOP/s of the Hopper kernel's newer features against the portable kernel (H100).

    python3 scripts/bench_coverage.py --compile   # compile every case, one process per case
    python3 scripts/bench_coverage.py             # time them, one process, same inputs

    python3 scripts/bench_coverage.py --only alibi  # the cases whose name has "alibi"

Cases (bf16): B4 H16 L4096 at head dims 96, 192 and 192/128 (DeepSeek MLA prefill), ALiBi at d=64,
128 and 256; packed varlen (8 sequences of ~2k tokens, and 40 documents of 64-1024 tokens, H16)
at d=64 and d=128 (the Hopper kernel's default, CTAs claiming tiles from a counter, and one CTA
per tile) and FP8 (e4m3, descales per sequence and KV head) at d=128, each full and causal. The
Hopper kernel is called directly (whatever the dispatcher would pick), the portable one through
its launcher. FLOPs = 2 * (d + d_v) * H * sum(Lq * Lk), halved for causal;
``triton.testing.do_bench`` medians (warmup 100 ms, rep 400 ms) after one call.
"""
import dataclasses
import subprocess
import sys

import torch
import triton

from solattn.core import make_params
from solattn.kernels.hopper import forward as hopper
from solattn.kernels.triton import forward as portable

B, H, L = 4, 16, 4096
torch.manual_seed(0)
VARLEN_LENS = [int(x) for x in torch.randint(1536, 2561, (8,))]
DOC_LENS = [int(x) for x in torch.randint(64, 1025, (40,))]


def dense(d, d_v, causal, alibi):
    q = torch.randn(B, L, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, L, H, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, L, H, d_v, device="cuda", dtype=torch.bfloat16)
    slopes = (torch.rand(H, device="cuda") * 0.1) if alibi else None
    p = make_params(q, k, causal=causal, alibi_slopes=slopes)
    flops = 2 * (d + d_v) * B * H * L * L / (2 if causal else 1)
    return (q, k, v, p), flops


def packed(d, causal, fp8, lens=VARLEN_LENS):
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    t = sum(lens)
    q, k, v = (torch.randn(t, H, d, device="cuda") for _ in range(3))
    kw = {}
    if fp8:
        q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        kw = {name: torch.rand(len(lens), H, device="cuda") + 0.5
              for name in ("q_descale", "k_descale", "v_descale")}
    else:
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    p = make_params(q, k, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=max(lens), max_seqlen_k=max(lens), **kw)
    flops = sum(4 * d * H * n * n for n in lens) / (2 if causal else 1)
    return (q, k, v, p), flops


def one_tile(d, causal):
    return dataclasses.replace(hopper.hopper_fwd_config(d, causal, varlen=True),
                               persistent=False, dynamic=False)


# name -> (inputs factory, {column: runner})
def cases():
    out = {}
    for d, d_v in ((96, 96), (192, 192), (192, 128)):
        for causal in (False, True):
            out[f"d{d}/{d_v} {'causal' if causal else 'full'}"] = (
                lambda d=d, d_v=d_v, c=causal: dense(d, d_v, c, False),
                {"hopper": None, "portable": "portable"})
    for d in (64, 128, 256):
        for causal in (False, True):
            out[f"alibi d{d} {'causal' if causal else 'full'}"] = (
                lambda d=d, c=causal: dense(d, d, c, True),
                {"hopper": None, "portable": "portable"})
    for d in (64, 128):
        for causal in (False, True):
            cols = {"hopper": None, "hopper one-tile": one_tile(d, causal),
                    "portable": "portable"}
            tag = "causal" if causal else "full"
            out[f"varlen d{d} {tag}"] = (lambda d=d, c=causal: packed(d, c, False), cols)
            out[f"varlen documents d{d} {tag}"] = (
                lambda d=d, c=causal: packed(d, c, False, DOC_LENS), cols)
    for causal in (False, True):
        out[f"fp8 varlen d128 {'causal' if causal else 'full'}"] = (
            lambda c=causal: packed(128, c, True), {"hopper fp8": None})
    return out


def runner(args, how):
    q, k, v, p = args
    if how == "portable":
        return lambda: portable.attn_fwd(q, k, v, p, return_lse=True, arch=90)
    return lambda: hopper.attn_fwd(q, k, v, p, return_lse=True, config=how)


def main():
    all_cases = cases()
    if "--only" in sys.argv:  # --only SUBSTRING: the cases whose name contains it
        only = sys.argv[sys.argv.index("--only") + 1]
        all_cases = {name: case for name, case in all_cases.items() if only in name}
        sys.argv[sys.argv.index("--only"):sys.argv.index("--only") + 2] = []
    if "--compile" in sys.argv:
        procs = [subprocess.Popen([sys.executable, __file__, "--one", name])
                 for name in all_cases]
        sys.exit(max(pr.wait() for pr in procs))
    if "--one" in sys.argv:
        make, cols = all_cases[sys.argv[-1]]
        args, _ = make()
        for how in cols.values():
            runner(args, how)()
        torch.cuda.synchronize()
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; varlen lengths {VARLEN_LENS}, documents {DOC_LENS}",
          flush=True)
    for name, (make, cols) in all_cases.items():
        args, flops = make()
        res = {}
        for col, how in cols.items():
            fn = runner(args, how)
            fn()
            ms = triton.testing.do_bench(fn, warmup=100, rep=400, return_mode="median")
            res[col] = flops / ms * 1e-9
        line = "  ".join(f"{c} {t:6.1f}" for c, t in res.items())
        ratio = (f"  hopper/portable {res['hopper'] / res['portable']:.2f}x"
                 if "portable" in res else "")
        print(f"{name:24s} TFLOP/s: {line}{ratio}", flush=True)
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
