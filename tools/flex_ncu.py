"""Run one FlexAttention call per case between ``cudaProfilerStart``/``Stop`` for Nsight Compute
(diagnostic, GPU only): warm up (compile, clocks) outside the profiled range, then one call.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python3 tools/flex_ncu.py --case document --case torch-document

Cases: ``MASK`` (ours, the Hopper flex forward; add ``-bwd`` for the backward), ``torch-MASK``
(torch's compiled flex_attention), ``dense-L512`` (flash_attn_func, B32 H16 L512: dense short
tiles). MASK is a tools/toolkit.py catalogue name (document, causal, sliding_window, ...).
"""

from __future__ import annotations

import argparse

import torch
from toolkit import catalogue  # tools/ is on sys.path when run as a script

from solattn import flash_attn_func
from solattn.flex import create_block_mask, flex_attention


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", action="append", required=True)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    a = p.parse_args()
    B, H, L, D = a.batch, a.heads, a.length, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    mods = catalogue(L, H, B, "cuda")
    for case in a.case:
        if case == "dense-L512":
            qs, ks, vs = (torch.randn(32, 512, 16, D, device="cuda", dtype=torch.bfloat16)
                          for _ in range(3))

            def fn():
                return flash_attn_func(qs, ks, vs)
        else:
            theirs = case.startswith("torch-")
            name = case.removeprefix("torch-").removesuffix("-bwd")
            score_mod, mask_mod = mods[name]
            if theirs:
                from torch.nn.attention import flex_attention as tflex

                bm = tflex.create_block_mask(mask_mod, None, None, L, L, device="cuda")
                attn = torch.compile(tflex.flex_attention)
            else:
                bm = create_block_mask(mask_mod, None, None, L, L)
                attn = flex_attention
            if case.endswith("-bwd"):
                out = attn(q, k, v, score_mod=score_mod, block_mask=bm)

                def fn(out=out):
                    return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            else:
                def fn(attn=attn, bm=bm, score_mod=score_mod):
                    with torch.no_grad():
                        return attn(q, k, v, score_mod=score_mod, block_mask=bm)
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"# profiled: {case}", flush=True)


if __name__ == "__main__":
    main()
