"""Few query rows over many keys through `flash_attn_func`: the prefill kernels (one CTA per
128-row tile and head) against the split-KV decode kernel (`flash_attn_with_kvcache` over the
same K/V, no cache_seqlens: the same attention), bf16, `do_bench` medians, best of two passes.

    PYTHONPATH=$PWD python3 scripts/bench_small_q.py [--json FILE]

Prints microseconds per call and the decode kernel's speedup per shape: where flash_attn_func
should hand such calls to the decode kernel (flash-attn 2 splits the keys of low-occupancy
inference calls in `flash_attn_func` too).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from solattn import flash_attn_func, flash_attn_with_kvcache

SHAPES = [  # (B, Hq, Hkv, s_q, s_k, D)
    (1, 32, 8, 1, 2048, 128), (1, 32, 8, 1, 8192, 128), (1, 32, 8, 1, 32768, 128),
    (1, 32, 8, 1, 131072, 128), (1, 32, 8, 4, 32768, 128), (1, 32, 8, 16, 32768, 128),
    (1, 32, 8, 64, 32768, 128), (1, 32, 8, 128, 32768, 128), (1, 32, 8, 256, 32768, 128),
    (8, 32, 8, 1, 8192, 128), (64, 32, 8, 1, 2048, 128), (1, 32, 4, 1, 544, 64),
    (1, 32, 4, 1, 8192, 64), (1, 32, 32, 1, 8192, 128), (1, 32, 32, 16, 8192, 128),
    (4, 32, 8, 16, 4096, 128), (1, 8, 8, 1, 32768, 256),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for b, hq, hkv, sq, sk, d in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        row = dict(B=b, Hq=hq, Hkv=hkv, s_q=sq, s_k=sk, D=d)
        for causal in (True, False):
            fns = {"flash_attn_func": lambda: flash_attn_func(q, k, v, causal=causal),
                   "decode kernel": lambda: flash_attn_with_kvcache(q, k, v, causal=causal)}
            ref = fns["flash_attn_func"]().float()
            err = (fns["decode kernel"]().float() - ref).abs().max().item()
            assert err < 2e-2, f"decode kernel differs by {err}"
            best = {}
            for _ in range(2):
                for name, fn in fns.items():
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                    best[name] = min(best.get(name, 1e9), ms)
            tag = "causal" if causal else "full"
            row[f"{tag} us"] = {n: round(ms * 1e3, 1) for n, ms in best.items()}
            row[f"{tag} speedup"] = round(best["flash_attn_func"] / best["decode kernel"], 2)
        rows.append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
