"""What attention dropout costs: solattn with ``dropout_p`` 0 and 0.1 against SDPA's FLASH (FA2)
backend with the same dropout, forward and forward + backward, same inputs, same run.

    python3 scripts/bench_dropout.py [--dtype bfloat16]

Each number is the median of ``triton.testing.do_bench`` (ms) after a warm-up call; the TFLOP/s
column counts the attention FLOPs only (4 * B * H * L * L * D forward, 2.5x that backward, halved
for causal), as scripts/bench_backward.py does.
"""

from __future__ import annotations

import argparse

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from solattn import flash_attn_func

SHAPES = [(4, 16, 4096, 128), (4, 32, 4096, 64)]  # (B, H, L, D)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    dtype = getattr(torch, ap.parse_args().dtype)
    print(f"{'shape':<28} {'causal':<6} {'impl':<18} {'fwd ms':>8} {'fwd+bwd ms':>11} "
          f"{'fwd+bwd TFLOP/s':>16}")
    for b, h, n, d in SHAPES:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        for causal in (False, True):
            flops = 4 * b * h * n * n * d * 3.5 / (2 if causal else 1)
            impls = {
                f"solattn p={p}": (lambda p=p: flash_attn_func(q, k, v, p, causal=causal))
                for p in (0.0, 0.1)
            }

            def sdpa(p=0.1):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        dropout_p=p, is_causal=causal)
                return out.transpose(1, 2)

            impls["sdpa-flash p=0.1"] = sdpa
            for name, fn in impls.items():
                def step(fn=fn):
                    fn().backward(dout)

                def forward(fn=fn):
                    with torch.no_grad():
                        fn()

                forward()
                step()
                fwd = triton.testing.do_bench(forward, return_mode="median")
                both = triton.testing.do_bench(step, return_mode="median", grad_to_none=[q, k, v])
                print(f"{str((b, h, n, d)):<28} {str(causal):<6} {name:<18} {fwd:>8.3f} "
                      f"{both:>11.3f} {flops / both / 1e9:>16.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
