"""Where the time of one Hopper flex forward call goes (H100): the whole public call against the
kernel launch alone, with and without inputs that require grad, and a torch.profiler table of
the GPU kernels each runs.

    python3 tools/flex_call_profile.py [--mods causal,document] [--L 4096]

B4 H16 L D128 bf16 (B = 16384 // L), mods from ``tools/toolkit.py``'s catalogue, the
Hopper flex forward forced (``SOLATTN_BACKEND=hopper``). ``do_bench`` medians after a warm-up;
TFLOP/s over the blocks the BlockMask lists (``solattn bench --suite flex``'s convention).
"""
import argparse
import os
import sys

import torch
from triton.testing import do_bench

os.environ["SOLATTN_BACKEND"] = "hopper"
sys.path.insert(0, os.path.dirname(__file__))

from toolkit import catalogue  # noqa: E402

from solattn.flex import (  # noqa: E402
    create_block_mask,
    flex_attention,
    ops,  # noqa: E402
)
from solattn.flex.block_mask import kernel_lists  # noqa: E402


def kernels_of(fn, n=10):
    """(device-kernel name, total us over n calls, count), sorted by time; and CPU ms per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev_us and e.device_type.name == "CUDA":
            rows.append((e.key[:70], dev_us / n, e.count // n))
    return sorted(rows, key=lambda r: -r[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mods", default="causal,document,prefix_lm,softcap")
    ap.add_argument("--L", type=int, default=4096)
    args = ap.parse_args()
    L, H, D = args.L, 16, 128
    B = max(1, 16384 // L)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B{B} H{H} L{L} D{D} bf16",
          flush=True)
    for name, (score_mod, mask_mod) in catalogue(L, H, B, "cuda").items():
        if name not in args.mods.split(","):
            continue
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        bb = B if name == "prefix_lm" else None
        bm = create_block_mask(mask_mod, bb, None, L, L, device="cuda")
        flops = 4 * B * H * L * L * D * (1 - bm.sparsity() / 100)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        lists = kernel_lists(bm, B, H, L, L)

        def call():
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)

        def call_grad():
            return flex_attention(qg, kg, vg, score_mod=score_mod, block_mask=bm)

        def lists_only():
            return kernel_lists(bm, B, H, L, L)

        score_key, score_caps = (ops.resolve(score_mod, ops.SCORE) if score_mod is not None
                                 else (-1, []))
        mask_key, mask_caps = ops.resolve(bm.mask_mod, ops.MASK)

        def op_only():  # the custom op on prepared lists (no validation, no list building)
            return ops._flex_fwd_op(q, k, v, lists, score_caps, mask_caps, None, score_key,
                                    mask_key, D ** -0.5, 128, 128, 0.0)

        res = {}
        for label, fn in (("call", call), ("call, requires_grad", call_grad),
                          ("kernel_lists", lists_only), ("op, lists prepared", op_only)):
            fn()
            ms = do_bench(fn, warmup=200, rep=500, return_mode="median")
            res[label] = ms
        line = "  ".join(f"{lbl} {ms * 1e3:8.1f} us ({flops / ms * 1e-9:5.0f} TFLOP/s)"
                         for lbl, ms in res.items())
        print(f"{name:12s} {line}", flush=True)
        for label, fn in (("call", call), ("call, requires_grad", call_grad)):
            print(f"  kernels of one '{label}':")
            for key, us, count in kernels_of(fn):
                print(f"    {us:9.1f} us  x{count}  {key}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
