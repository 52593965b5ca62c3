"""The Hopper backward's preprocess (``bwd_preprocess_kernel``: Delta from O and dO, the LSE
column, the fp32 dQ accumulator zeroed) timed alone against its memory floor (GPU only).

    python3 tools/preprocess_micro.py [--tiles 64,8 128,8 ...] [--rounds 2]

Shapes: the dense backward's layout (O, dO ``(b, s, h, d)`` contiguous) and the flex backward's
(``(b, h, s, d)`` storage viewed as ``(b, s, h, d)``). Each tile ``rows,warps`` is one launch
config of the kernel; floors: ``acc.zero_()`` (the accumulator's write alone) and
``o.sum() + do.sum()`` (the reads alone), CUDA-graph replays (``do_bench_cudagraph``), us and
GB/s over the kernel's bytes (O and dO read, the accumulator and two fp32 columns written).
"""

from __future__ import annotations

import argparse
import math

import torch
from triton.testing import do_bench_cudagraph

from solattn.kernels.hopper.backward import bwd_preprocess_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4,16,4096,128", "1,16,16384,128",
                                                     "4,32,4096,64"])
    ap.add_argument("--tiles", nargs="+", default=["64,8", "64,4", "128,8", "128,4", "32,4",
                                                    "256,8"])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for shape in a.shapes:
        b, h, s, d = (int(x) for x in shape.split(","))
        for layout in ("dense", "flex"):
            if layout == "dense":
                o = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                do = torch.randn_like(o)
            else:
                o = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32)
            n_cols = b * h * s
            ws = torch.empty(n_cols * (2 + d), device="cuda", dtype=torch.float32)
            lse_col, delta_col, acc = ws[:n_cols], ws[n_cols:2 * n_cols], ws[2 * n_cols:]
            nbytes = 2 * o.numel() * 2 + acc.numel() * 4 + 2 * n_cols * 4
            results = {}

            def launch(rows, warps):
                return lambda: bwd_preprocess_kernel[(s // rows, h, b)](
                    o, do, lse, lse, lse_col, delta_col, acc, lse, *o.stride(), *do.stride(),
                    *lse.stride(), 0, 0, 0, s, s, 1.0 / math.sqrt(d), HEAD_DIM=d, BLOCK_M=rows,
                    HAS_DLSE=False, IS_VARLEN=False, ROW_PAD=rows, num_warps=warps)

            fns = {f"kernel rows {t.split(',')[0]} warps {t.split(',')[1]}":
                   launch(*(int(x) for x in t.split(","))) for t in a.tiles}
            fns["floor: acc.zero_()"] = acc.zero_
            fns["floor: o.sum() + do.sum()"] = lambda: (o.sum(dtype=torch.float32),
                                                        do.sum(dtype=torch.float32))
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            for r in range(a.rounds):
                for name, fn in fns.items():
                    us = do_bench_cudagraph(fn, rep=100) * 1e3
                    results.setdefault(name, []).append(us)
            for name, us in results.items():
                gbs = ", ".join(f"{nbytes / u / 1e3:.0f}" for u in us)
                print(f"B{b} H{h} L{s} D{d} {layout:<5} {name:<28} "
                      f"{', '.join(f'{u:.1f}' for u in us)} us  ({gbs} GB/s over the kernel's "
                      f"{nbytes / 1e6:.0f} MB)", flush=True)


if __name__ == "__main__":
    main()
