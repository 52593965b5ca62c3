"""``solattn.attention(attn_mask=...)`` against torch SDPA with the same mask (its own backend
choice, the memory-efficient kernel for masks on the GPU), forward and forward + backward.

    python3 scripts/bench_sdpa_mask.py

bf16, B4 H16 L4096 D128; masks: key padding (B, 1, 1, S) with rows of 4096 / 3072 / 2048 / 1024
real keys, a causal document mask (L, S) of 8 documents as bool and as additive -inf/0, and a
random dense bool mask (B, H, L, S) with 30% of the entries masked. TFLOP/s count the full
4·B·H·L·S·D (x3.5 with the backward) whatever the mask keeps, so the numbers compare the two
implementations on the same work, not with unmasked attention. Each row is checked first
(max |ours - SDPA| on the output) and timed with ``do_bench`` medians after a warm-up.
"""

import torch
import triton
import triton.testing
from torch.nn.functional import scaled_dot_product_attention as sdpa

from solattn import attention


def masks(B, H, L, S, dev):
    lens = torch.tensor([4096, 3072, 2048, 1024], device=dev)[:B]
    pad = (torch.arange(S, device=dev)[None, :] < lens[:, None])[:, None, None, :]
    i = torch.arange(L, device=dev)
    doc = i // (L // 8)
    docm = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    add = torch.zeros(L, S, device=dev, dtype=torch.bfloat16).masked_fill(~docm, float("-inf"))
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = torch.rand(B, H, L, S, device=dev, generator=g) > 0.3
    rnd[..., 0] = True
    return {"key padding (B,1,1,S)": pad, "8 causal documents, bool (L,S)": docm,
            "8 causal documents, additive (L,S)": add, "random 70% (B,H,L,S)": rnd}


def main():
    dev, dt = "cuda", torch.bfloat16
    B, H, L, S, D = 4, 16, 4096, 4096, 128
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device=dev, dtype=dt, requires_grad=True)
               for n in (L, S, S))
    do = torch.randn(B, H, L, D, device=dev, dtype=dt)
    flops = 4 * B * H * L * S * D
    print("| mask | max err vs SDPA | fwd ours / SDPA | fwd+bwd ours / SDPA |")
    print("|---|---|---|---|")
    for name, m in masks(B, H, L, S, dev).items():
        err = (attention(q, k, v, attn_mask=m).float() - sdpa(q, k, v, attn_mask=m).float())
        err = err.abs().max().item()
        res = []
        for fn in (lambda: attention(q, k, v, attn_mask=m), lambda: sdpa(q, k, v, attn_mask=m)):
            with torch.no_grad():
                ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            res.append(flops / ms / 1e9)
        for fn in (lambda: attention(q, k, v, attn_mask=m), lambda: sdpa(q, k, v, attn_mask=m)):
            ms = triton.testing.do_bench(lambda: fn().backward(do), warmup=20, rep=100,
                                         return_mode="median", grad_to_none=[q, k, v])
            res.append(3.5 * flops / ms / 1e9)
        print(f"| {name} | {err:.1e} | {res[0]:.0f} / {res[1]:.0f} ({res[0] / res[1]:.2f}x) | "
              f"{res[2]:.0f} / {res[3]:.0f} ({res[2] / res[3]:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
