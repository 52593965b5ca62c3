"""The backward of ring attention's per-step pieces on one GPU: the Hopper backward with and
without the staggered query blocks, against cuDNN (SDPA, ``enable_gqa``) on the same inputs.

    python3 tools/bench_ring_pieces.py                 # the 256k ring's pieces (2 ranks)
    python3 tools/bench_ring_pieces.py --only step1

At 256k tokens on 2 GPUs (B1 Hq32 Hkv8 D128 causal, zigzag) each rank's first step is a causal
128k x 128k piece and its second a 128k x 64k (rank 0) or 64k x 128k (rank 1) piece without a
mask, of the same FLOPs (docs/ring-attention.md). Timing: one untimed call, then the median of
``--iters`` calls between CUDA events (each call takes 0.3-0.8 s). FLOPs = 2.5 * 4 * B * H *
Lq * Lk * D, halved for causal.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

# label -> (Lq, Lk, Hq, Hkv, causal)
SHAPES = {
    "step0 causal 128k": (131072, 131072, 32, 8, True),
    "step1 128k x 64k": (131072, 65536, 32, 8, False),
    "step1 64k x 128k": (65536, 131072, 32, 8, False),
    "full 64k gqa": (65536, 65536, 32, 8, False),
    "full 64k mha": (65536, 65536, 32, 32, False),
}


def timed(fn, iters):
    fn()
    out = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="substring of the shape labels")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from solattn import flash_attn_func
    from solattn.configs.hopper_backward import hopper_bwd_config
    from solattn.core import make_params
    from solattn.kernels.hopper.backward_plan import attn_bwd

    d = 128
    cfg = hopper_bwd_config(d)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, D{d}, backward "
          "only, TFLOP/s (ms)")
    for label, (lq, lk, hq, hkv, causal) in SHAPES.items():
        if args.only not in label:
            continue
        torch.manual_seed(0)
        q = torch.randn(1, lq, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, lk, hkv, d, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        do = torch.randn_like(q)
        with torch.no_grad():
            out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        p = make_params(q, k, causal=causal)
        flops = 2.5 * 4 * hq * lq * lk * d * (0.5 if causal else 1.0)
        cells = []
        for name, stagger in (("stagger", True), ("no stagger", False)):
            c = dataclasses.replace(cfg, stagger=stagger)
            ms = timed(lambda c=c: attn_bwd(do, q, k, v, out, lse, p, config=c), args.iters)
            cells.append(f"{name} {flops / ms * 1e-9:.0f} ({ms:.0f})")
        try:
            qt, kt, vt = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, enable_gqa=hkv != hq)
            dot = do.transpose(1, 2)
            ms = timed(lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True),
                       args.iters)
            cells.append(f"cuDNN {flops / ms * 1e-9:.0f} ({ms:.0f})")
        except Exception as exc:  # cuDNN may refuse a shape
            cells.append(f"cuDNN failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
        o = qt = kt = vt = None
        print(f"{label:20s} " + "  ".join(cells), flush=True)
        q = k = v = do = out = lse = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
