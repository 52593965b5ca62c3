"""Backward TFLOP/s of the Hopper (Gluon) backward vs the portable one per feature (sliding
window, softcap, varlen, ALiBi): the measurements behind
:func:`solattn.kernels.hopper.backward.preferred`.

    python3 scripts/bench_hopper_features.py                 # time every case
    python3 scripts/bench_hopper_features.py --compile 0/4   # only compile cases 0, 4, 8, ...
    python3 scripts/bench_hopper_features.py --only alibi    # the cases whose name has "alibi"

FLOPs = 2.5 x 4 x H x D x (allowed (query, key) pairs, summed over the batch). Both kernels are
timed through their launchers on the same forward output (median of ``do_bench``), after a
check of their gradients against each other.
"""

from __future__ import annotations

import argparse

import torch
import triton

from solattn import flash_attn_func, flash_attn_varlen_func
from solattn.core import make_params
from solattn.kernels.hopper import backward as hopper
from solattn.kernels.triton import backward as portable
from solattn.reference import allowed_mask

# Packed lengths of the varlen cases (fixed: 12 sequences of 256-4096 tokens).
VARLEN_LENS = [3178, 1031, 2880, 256, 4096, 1577, 702, 3650, 2210, 489, 3999, 1200]

# (name, B, H, L, D, kwargs); B = 0: varlen over VARLEN_LENS.
CASES = [
    ("window 1024/1024", 4, 16, 4096, 128, dict(window_size=(1024, 1024))),
    ("causal window 1024", 4, 16, 4096, 128, dict(causal=True, window_size=(1024, 0))),
    ("softcap 50", 4, 16, 4096, 128, dict(softcap=50.0)),
    ("causal softcap 50", 4, 16, 4096, 128, dict(causal=True, softcap=50.0)),
    ("window 1024/1024", 4, 32, 4096, 64, dict(window_size=(1024, 1024))),
    ("causal window 1024", 4, 32, 4096, 64, dict(causal=True, window_size=(1024, 0))),
    ("softcap 50", 4, 32, 4096, 64, dict(softcap=50.0)),
    ("causal softcap 50", 4, 32, 4096, 64, dict(causal=True, softcap=50.0)),
    ("varlen", 0, 16, 0, 128, dict()),
    ("varlen causal", 0, 16, 0, 128, dict(causal=True)),
    ("varlen", 0, 32, 0, 64, dict()),
    ("varlen causal", 0, 32, 0, 64, dict(causal=True)),
    # alibi=True: ALiBi slopes 2^(-8 i / H), one per head
    ("alibi", 4, 16, 4096, 128, dict(alibi=True)),
    ("causal alibi", 4, 16, 4096, 128, dict(causal=True, alibi=True)),
    ("alibi", 4, 32, 4096, 64, dict(alibi=True)),
    ("causal alibi", 4, 32, 4096, 64, dict(causal=True, alibi=True)),
]


def setup(b, h, s, d, kw, dtype=torch.bfloat16):
    torch.manual_seed(0)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, h + 1, device="cuda") / h)
    if b:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
        out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
        p = make_params(q, k, **kw)
        pairs = b * allowed_mask(s, s, kw.get("causal", False), kw.get("window_size", (-1, -1)),
                                 device="cuda").sum().item()
    else:
        total = sum(VARLEN_LENS)
        cu = torch.tensor([0] + VARLEN_LENS, device="cuda").cumsum(0).to(torch.int32)
        q, k, v = (torch.randn(total, h, d, device="cuda", dtype=dtype) for _ in range(3))
        mx = max(VARLEN_LENS)
        out, lse = flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, return_lse=True, **kw)
        p = make_params(q, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx,
                        max_seqlen_k=mx, **kw)
        pairs = sum(allowed_mask(n, n, kw.get("causal", False), kw.get("window_size", (-1, -1)),
                                 device="cuda").sum().item() for n in VARLEN_LENS)
    do = torch.randn_like(out)
    fns = {"hopper": lambda: hopper.attn_bwd(do, q, k, v, out, lse, p),
           "portable": lambda: portable.attn_bwd(do, q, k, v, out, lse, p, arch=90)}
    return fns, 2.5 * 4 * h * d * pairs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", default=None, help="i/n: only run cases i, i+n, ... once")
    ap.add_argument("--only", default=None, help="only the cases whose name contains this")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.only or args.only in c[0]]
    if args.compile:
        i, n = map(int, args.compile.split("/"))
        for name, b, h, s, d, kw in cases[i::n]:
            fns, _ = setup(b, h, min(s, 256) if b else 0, d, kw)
            for fn in fns.values():
                fn()
        torch.cuda.synchronize()
        return 0
    for name, b, h, s, d, kw in cases:
        fns, fl = setup(b, h, s, d, kw)
        grads = {k: fn() for k, fn in fns.items()}
        errs = [((a.float() - r.float()).norm() / r.float().norm()).item()
                for a, r in zip(grads["hopper"], grads["portable"])]
        tf = {}
        for key, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            tf[key] = fl / triton.testing.do_bench(fn, warmup=25, rep=100,
                                                   return_mode="median") * 1e-9
        shape = f"B{b} H{h} L{s} D{d}" if b else f"varlen(12) H{h} D{d}"
        print(f"{shape:<20} {name:<20} hopper {tf['hopper']:6.1f}  portable "
              f"{tf['portable']:6.1f}  ratio {tf['hopper'] / tf['portable']:.2f}  "
              f"rel err vs portable {max(errs):.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
