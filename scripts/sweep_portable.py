"""Time candidate tile configs of the portable forward on the GPU (feeds configs.py's table).

The first sweep (2026-11-22, H100) covered d=64/128 tiles at B4 H16/H32 L4096 and the headline
shape; its numbers are in BENCHMARKS.md. CANDIDATES now holds the open questions.

Usage: python3 scripts/sweep_portable.py  (prints one line per (shape, config): TFLOP/s)
"""

from __future__ import annotations

import torch

from solattn.bench.core import Shape, attn_flops, make_inputs, time_ms
from solattn.configs import FwdConfig
from solattn.core import make_params
from solattn.kernels.triton.forward import attn_fwd

CANDIDATES = {
    64: [(128, 64, 8, 3)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3)],
    256: [(64, 32, 8, 3), (64, 32, 8, 2), (64, 16, 4, 3), (128, 32, 8, 2)],
}
SHAPES = {64: [Shape(4, 32, 4096, 4096, 64)],
          128: [Shape(1, 16, 16384, 16384, 128, causal=True)],
          256: [Shape(2, 8, 4096, 4096, 256), Shape(2, 8, 4096, 4096, 256, causal=True)]}


def main():
    for d, cands in CANDIDATES.items():
        for shape in SHAPES[d]:
            x = make_inputs(shape)
            p = make_params(x.q, x.k, causal=shape.causal)
            for cand in cands:
                bm, bn, warps, stages = cand
                cfg = FwdConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)

                def fn(x=x, p=p, cfg=cfg):
                    return attn_fwd(x.q, x.k, x.v, p, return_lse=False, config=cfg)
                try:
                    tf = attn_flops(shape) / time_ms(fn) / 1e9
                    print(f"sweep {shape.label():<32} {str(cand):<20} {tf:6.0f} TFLOP/s",
                          flush=True)
                except Exception as exc:  # noqa: BLE001 - out of resources etc.
                    print(f"sweep {shape.label():<32} {str(cand):<20} failed: {type(exc).__name__}")
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
