"""Backward TFLOP/s of the Hopper backward on GQA shapes with few key-block CTAs, by the number
of query-head splits of a group (``gqa_splits``) and the grid order (``HopperBwdConfig.lpt``),
against cuDNN in the same run.

    python3 scripts/bench_hopper_bwd_gqa.py [--rep MS] [--many-waves] [--shape B,HQ,HKV,L,D,CAUSAL]

FLOPs = 2.5 * 4 * B * Hq * L * L * D, halved for causal. ours: the launcher
(:func:`solattn.kernels.hopper.backward.attn_bwd`) on a saved forward's out/lse, host included
(a split reads K/V in place and sums its fp32 partial dK/dV with ``bwd_dkdv_reduce_kernel``,
whose time alone is printed in microseconds as "reduce"); "grid" is the kernel's grid in key
block order, "lpt" longest first over all heads (the default with a split). cudnn:
``torch.autograd.grad`` of SDPA's cuDNN backend (``enable_gqa``, K/V not repeated). Medians of
``triton.testing.do_bench`` after a warm-up; the gradients of every variant are checked against
cuDNN's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from solattn import flash_attn_func
from solattn.core import make_params
from solattn.device import num_sms
from solattn.kernels.hopper.backward import (
    attn_bwd,
    dkdv_reduce_launch,
    gqa_splits_of,
    hopper_bwd_config,
    lpt_grid,
)

# (B, Hq, Hkv, L, D, causal): a 1.1B Llama layer (TinyLlama: 32 / 4 heads, d 64), an 8B-class
# layer at 4k (32 / 8, d 128), and a batch of two.
SHAPES = [(1, 32, 4, 4096, 64, True), (1, 32, 4, 4096, 64, False),
          (1, 32, 8, 4096, 128, True), (2, 32, 8, 2048, 128, True)]
# --many-waves: causal grids of several waves (the backward tables' shapes, MHA and GQA), where
# the grid order alone is in question (L2 traffic of every head's Q/dO at once vs the tail).
MANY_WAVES = [(4, 16, 16, 4096, 128, True), (1, 16, 16, 16384, 128, True),
              (4, 32, 32, 4096, 64, True), (4, 32, 8, 4096, 128, True),
              (1, 32, 8, 16384, 128, True)]


def reduce_us(b, s, h_kv, d, splits, rep) -> float:
    """Microseconds of the split's dK/dV reduce alone on this shape."""
    parts = [torch.randn(b, s, h_kv * splits, d, device="cuda") for _ in range(2)]
    dk, dv = (torch.empty(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    launch = dkdv_reduce_launch(dk.shape, splits, b, False)
    return triton.testing.do_bench(lambda: launch(*parts, dk, dv, parts[0]), warmup=20,
                                   rep=rep) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    ap.add_argument("--many-waves", action="store_true", help="the MANY_WAVES shapes instead")
    ap.add_argument("--shape", action="append", default=[],
                    help="B,HQ,HKV,L,D,CAUSAL (0/1) instead, every split count (repeatable)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shape]
    shapes = [(b, h, hk, s_, d, bool(c)) for b, h, hk, s_, d, c in shapes]
    if not torch.cuda.is_available():
        print("bench_hopper_bwd_gqa: needs a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton "
          f"{triton.__version__}, bf16, backward only, TFLOP/s")
    for b, h, h_kv, s, d, causal in shapes or (MANY_WAVES if args.many_waves else SHAPES):
        fl = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        do = torch.randn_like(q)
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        p = make_params(q, k, causal=causal)
        cfg = hopper_bwd_config(d)
        default = gqa_splits_of(q, k, p)
        n_blocks = triton.cdiv(s, cfg.block_n)
        default_lpt = lpt_grid(cfg, n_blocks * h_kv * b, n_blocks, default, causal,
                               num_sms(q.device), h // h_kv)
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o_ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
        dot = do.transpose(1, 2)
        ref = torch.autograd.grad(o_ref, (qt, kt, vt), dot, retain_graph=True)
        ms = triton.testing.do_bench(
            lambda: torch.autograd.grad(o_ref, (qt, kt, vt), dot, retain_graph=True),
            warmup=50, rep=args.rep)
        row = [f"cudnn {fl / ms / 1e9:.0f}"]
        group = h // h_kv
        counts = (1,) if args.many_waves and not shapes else (1, 2, 4, 8)
        for splits in [x for x in counts if group % x == 0]:
            cells = []
            for lpt in (False, True):
                c = dataclasses.replace(cfg, lpt=lpt)
                fn = lambda splits=splits, c=c: attn_bwd(do, q, k, v, out, lse, p, config=c,
                                                         gqa_splits=splits)
                grads = fn()
                err = max((g.float() - r.transpose(1, 2).float()).abs().max().item()
                          for g, r in zip(grads, ref))
                ms = triton.testing.do_bench(fn, warmup=50, rep=args.rep)
                star = "*" if (splits, lpt) == (default, default_lpt) else ""
                cells.append(f"{'lpt' if lpt else 'grid'}{star} {fl / ms / 1e9:.0f}"
                             f" (err {err:.1e})")
            if splits > 1:
                cells.append(f"reduce {reduce_us(b, s, h_kv, d, splits, args.rep):.0f} us")
            row.append(f"s{splits}: " + ", ".join(cells))
        ctas = triton.cdiv(s, 128) * h_kv * b
        print(f"B{b} Hq{h} Hkv{h_kv} L{s} D{d} {'causal' if causal else 'full'} "
              f"({ctas} CTAs unsplit, {num_sms(q.device)} SMs): " + " | ".join(row), flush=True)
    print("# * = the default (gqa_splits_of, lpt_grid)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
