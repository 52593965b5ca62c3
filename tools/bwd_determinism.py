"""The Hopper backward with ``deterministic=True``: bitwise reproducibility over many passes,
and its speed against the default backward (issue 38, item 4).

    PYTHONPATH=$PWD python3 tools/bwd_determinism.py [--runs 50] [--shapes anchor|all]
        [--head-dims 64,128,256] [--dropout P] [--softcap C]

Per shape (bf16, the Hopper kernels forced for the forward and the backward; ``--dropout``:
every call with that dropout_p, its seed the same for both modes; ``--softcap``: every call
with that softcap), one recorded forward, then
for the default and the deterministic backward: ``--runs`` gradient passes of
``torch.autograd.grad`` compared bitwise with the first (dq, dk, dv), and the pass timed with
``triton.testing.do_bench`` (median; backward FLOPs counted as 2.5x the forward's, causal
halved). The default backward's dQ atomics are expected to differ between passes; the
deterministic ones must not (exit 1 if one does). Timings of the two modes alternate three
times and the best of each is printed, with their ratio.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

ANCHOR = [  # (B, Hq, Hkv, L, D, causal): the backward suite's shapes and issue 38's GQA rows
    (4, 16, 16, 4096, 128, False),
    (4, 16, 16, 4096, 128, True),
    (4, 32, 32, 4096, 64, False),
    (4, 32, 32, 4096, 64, True),
    (4, 32, 4, 4096, 64, True),
    (1, 16, 16, 16384, 128, True),
    (1, 32, 8, 8192, 128, True),
    (2, 8, 8, 4096, 256, False),
    (2, 8, 8, 4096, 256, True),
]
SMALL = [(1, 8, 8, 1024, 128, False), (2, 16, 16, 2048, 64, True), (8, 32, 8, 1024, 128, True)]


def bits(grads):
    return [g.view(torch.int16).clone() for g in grads]


def run_shape(shape, runs, dropout_p=0.0, softcap=0.0):
    from solattn import flash_attn_func
    from solattn.dispatch import forced_backend

    b, h, h_kv, s, d, causal = shape
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    res = {}
    with forced_backend("hopper"):
        for det in (False, True):
            torch.manual_seed(1)  # (the dropout seed)
            out = flash_attn_func(q, k, v, dropout_p, causal=causal, softcap=softcap,
                                  deterministic=det)
            dout = torch.randn_like(out)

            def grad(out=out, dout=dout):
                return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

            first = bits(grad())
            differing = sum(any(not torch.equal(a, b_) for a, b_ in zip(first, bits(grad())))
                            for _ in range(runs - 1))
            res[det] = {"grad": grad, "differing": differing, "ms": float("inf")}
        for _ in range(3):
            for det in (False, True):
                ms = triton.testing.do_bench(res[det]["grad"], warmup=100, rep=400)
                res[det]["ms"] = min(res[det]["ms"], ms)
    tf = {det: flops / res[det]["ms"] / 1e9 for det in res}
    print(f"B{b} Hq{h} Hkv{h_kv} L{s} d{d}{' causal' if causal else ''}"
          f"{f' dropout {dropout_p}' if dropout_p else ''}"
          f"{f' softcap {softcap}' if softcap else ''}: "
          f"default {tf[False]:.0f} TFLOP/s ({res[False]['differing']}/{runs - 1} passes differ), "
          f"deterministic {tf[True]:.0f} TFLOP/s ({res[True]['differing']}/{runs - 1} differ), "
          f"deterministic / default {res[False]['ms'] / res[True]['ms']:.3f}", flush=True)
    return res[True]["differing"] == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--shapes", choices=("anchor", "all"), default="anchor")
    ap.add_argument("--head-dims", default="64,128,256",
                    help="comma-separated head dims of the shapes to run")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every call")
    ap.add_argument("--softcap", type=float, default=0.0, help="softcap of every call")
    args = ap.parse_args()
    dims = {int(x) for x in args.head_dims.split(",")}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, bf16, {args.runs} passes a mode")
    shapes = [sh for sh in ANCHOR + (SMALL if args.shapes == "all" else []) if sh[4] in dims]
    ok = all([run_shape(shape, args.runs, args.dropout, args.softcap) for shape in shapes])
    print("deterministic: bitwise the same on every pass" if ok else
          "deterministic: SOME PASSES DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
