"""``flash_attn_func`` forward (and optionally backward) of several source trees on the same GPU,
in alternating rounds (one worker process per tree and round), cuDNN (torch SDPA) timed in each
worker: a same-run A/B of a dedicated-kernel change. The flex counterpart is
``bench_flex_trees.py``.

    python3 scripts/bench_fwd_trees.py --trees base=_ab/base,new=. --rounds 3 [--backward]
    python3 scripts/bench_fwd_trees.py --trees ... --backward-only --shapes "B16 H16 L1k D128"

TFLOP/s = 4 B Hq Lq Lk d (halved causal; 2.5x that backward) over ``triton.testing.do_bench``
medians after a warm-up of three full ``do_bench`` passes (the clock ramp).
"""

from __future__ import annotations

import argparse
import os
import sys

from bench_flex_trees import run_worker, write_results

SHAPES = {  # name -> (b, hq, hkv, lq, lk, d, causal)
    "B4 H32 L4k D64": (4, 32, 32, 4096, 4096, 64, False),
    "B4 H32 L4k D64 causal": (4, 32, 32, 4096, 4096, 64, True),
    "B1 Hq32 Hkv4 L4k D64 causal": (1, 32, 4, 4096, 4096, 64, True),
    "B4 H16 L4k D128": (4, 16, 16, 4096, 4096, 128, False),
    "B4 H16 L4k D128 causal": (4, 16, 16, 4096, 4096, 128, True),
    "B1 H8 Lq4k Lk8k D128": (1, 8, 8, 4096, 8192, 128, False),
    "B1 H16 L16k D128 causal": (1, 16, 16, 16384, 16384, 128, True),
    "B2 H8 L4k D256 causal": (2, 8, 8, 4096, 4096, 256, True),
    # short sequences, where the backward's passes around its kernel weigh more
    "B16 H16 L1k D128": (16, 16, 16, 1024, 1024, 128, False),
    "B16 H16 L1k D128 causal": (16, 16, 16, 1024, 1024, 128, True),
    "B8 Hq32 Hkv4 L2k D64 causal": (8, 32, 4, 2048, 2048, 64, True),
    "B4 Hq32 Hkv4 L4k D64 causal": (4, 32, 4, 4096, 4096, 64, True),
}

WORKER = r"""
import json, torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from solattn import flash_attn_func
out = []
def bench(fn):
    for _ in range(3):
        triton.testing.do_bench(fn, warmup=50, rep=100)
    return triton.testing.do_bench(fn, warmup=100, rep=400)
for name, (b, hq, hkv, lq, lk, d, causal) in {shapes!r}.items():
    q = torch.randn(b, lq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, lk, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    flops = 4 * b * hq * lq * lk * d / (2 if causal else 1)
    row = dict(shape=name, ours=None, cudnn=None)
    fwd = lambda: flash_attn_func(q, k, v, causal=causal)
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    if not {backward_only!r}:
        row["ours"] = flops / bench(fwd) / 1e9
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, enable_gqa=hq != hkv)
            if not {backward_only!r}:
                row["cudnn"] = flops / bench(sdpa) / 1e9
            else:
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (qt, kt, vt))
                og = torch.nn.functional.scaled_dot_product_attention(
                    qg, kg, vg, is_causal=causal, enable_gqa=hq != hkv)
                dog = torch.randn_like(og)
                row["cudnn_bwd"] = 2.5 * flops / bench(
                    lambda: torch.autograd.grad(og, (qg, kg, vg), dog, retain_graph=True)) / 1e9
        except RuntimeError:
            pass
    if {backward!r}:
        o = flash_attn_func(q, k, v, causal=causal)
        do = torch.randn_like(o)
        bwd = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        row["ours_bwd"] = 2.5 * flops / bench(bwd) / 1e9
    out.append(row)
    del q, k, v
print("RESULT" + json.dumps(out))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", required=True, help="name=path,... (each a solattn checkout)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated SHAPES names")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--backward-only", action="store_true",
                   help="time the backward only (ours and cuDNN's), no forward")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    trees = [t.split("=", 1) for t in args.trees.split(",")]
    shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
    results = []
    for rnd in range(args.rounds):
        for name, path in trees:
            code = WORKER.format(shapes=shapes, backward=args.backward or args.backward_only,
                                 backward_only=args.backward_only)
            for r in run_worker(code, path, name) or ():
                r.update(tree=name, round=rnd)
                results.append(r)
                def fmt(x):
                    return f"{x:.0f}" if x else "-"
                bwd = f"  bwd {fmt(r['ours_bwd'])}" if "ours_bwd" in r else ""
                cudnn_bwd = f" (cuDNN {fmt(r['cudnn_bwd'])})" if "cudnn_bwd" in r else ""
                print(f"round {rnd} {name:<6} {r['shape']:<30} ours {fmt(r['ours'])}  cuDNN "
                      f"{fmt(r['cudnn'])}{bwd}{cudnn_bwd}", flush=True)
    write_results(args.out, "bench_fwd_trees.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
