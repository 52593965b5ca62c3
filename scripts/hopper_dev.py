"""GPU dev run for the Hopper forward: quick correctness, then TFLOP/s vs cuDNN in one process.

usage: python scripts/hopper_dev.py [variant ...]
    variant: name=d:block_n:stages:consumer_regs:persistent  (a HopperFwdConfig to time too)

Prints a markdown table (bf16, FLOPs = 4 B H Lq Lk D, halved for causal, do_bench medians);
cuDNN is torch SDPA forced to SDPBackend.CUDNN_ATTENTION on the same inputs.
"""
import os
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from solattn.kernels.hopper import forward as F

# Optional baseline: a copy of an earlier kernel module saved as scripts/hopper_np.py
# (e.g. `git show <commit>:solattn/kernels/hopper/forward.py > scripts/hopper_np.py`).
sys.path.insert(0, os.path.dirname(__file__))
try:
    import hopper_np as NP
except ImportError:
    NP = None
from solattn.core import make_params
from solattn.reference import attention_ref

torch.manual_seed(0)
dev = "cuda"


def hop(q, k, v, causal, cfg=None, mod=F):
    return mod.attn_fwd(q, k, v, make_params(q, k, causal=causal), return_lse=True, config=cfg)


def quick_check(cfg=None, d=128):
    for (b, sq, sk, h, hk, causal) in [(2, 300, 300, 4, 2, False), (2, 300, 700, 4, 2, True),
                                       (1, 517, 200, 2, 2, True), (1, 1024, 1024, 2, 2, True),
                                       (4, 2000, 2000, 8, 2, True), (3, 1500, 1000, 6, 3, False)]:
        q = torch.randn(b, sq, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
        o, lse = hop(q, k, v, causal, cfg)
        ref, rl = attention_ref(q, k, v, causal=causal)
        lo, _ = attention_ref(q, k, v, causal=causal, upcast=False)
        e = (o.double() - ref).abs().max().item()
        e0 = (lo.double() - ref).abs().max().item()
        fin = torch.isfinite(rl)
        el = (lse[fin].double() - rl[fin]).abs().max().item() if fin.any() else 0.0
        ok = e <= 2 * e0 + 1e-5 and el < 2e-3 and torch.equal(torch.isinf(lse), ~fin)
        if not ok or cfg is None:
            print(f"check d{d} {b},{sq},{sk},{h},{hk} causal={causal}: err {e:.2e} "
                  f"(torch {e0:.2e}) lse {el:.1e} {'OK' if ok else 'FAIL'}", flush=True)


SHAPES = [  # name, b, h, sq, sk, d, causal
    ("B4H16L4k d128", 4, 16, 4096, 4096, 128, False),
    ("B4H16L4k d128 causal", 4, 16, 4096, 4096, 128, True),
    ("B1H8 4k/8k d128", 1, 8, 4096, 8192, 128, False),
    ("B1H16L16k d128", 1, 16, 16384, 16384, 128, False),
    ("B1H16L16k d128 causal", 1, 16, 16384, 16384, 128, True),
    ("B4H32L4k d64", 4, 32, 4096, 4096, 64, False),
    ("B2H8L4k d256", 2, 8, 4096, 4096, 256, False),
]


def bench(variants):
    rows = []
    for name, b, h, sq, sk, d, causal in SHAPES:
        q = torch.randn(b, sq, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, sk, h, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, sk, h, d, device=dev, dtype=torch.bfloat16)
        flops = 4 * b * h * sq * sk * d * (0.5 if causal else 1.0)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = triton.testing.do_bench(lambda: sdpa(qt, kt, vt, is_causal=causal),
                                         warmup=100, rep=400, return_mode="median")
        res = {"cudnn": flops / ms / 1e9}
        cands = [("ours", None, F)] + ([("base", None, NP)] if NP else [])
        cands += [(vn, c, F) for vn, (vd, c) in variants.items() if vd == d]
        for vn, cfg, mod in cands:
            ms = triton.testing.do_bench(lambda: hop(q, k, v, causal, cfg, mod), warmup=100,
                                         rep=400, return_mode="median")
            res[vn] = flops / ms / 1e9
        rows.append((name, res))
        print(name, " ".join(f"{k}={v:.0f}" for k, v in res.items()), flush=True)
    cols = ["cudnn", "ours"] + (["base"] if NP else []) + list(variants)
    print("\n| shape | " + " | ".join(cols) + " |")
    for name, res in rows:
        cells = [f"{res[c]:.0f}" if c in res else "-" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    variants = {}
    for arg in sys.argv[1:]:
        vn, spec = arg.split("=")
        d, bn, st, regs, pers = (int(x) for x in spec.split(":"))
        variants[vn] = (d, F.HopperFwdConfig(64, bn, st, regs, 24, bool(pers)))
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    quick_check(d=128)
    quick_check(d=64)
    quick_check(d=256)
    for vn, (vd, cfg) in variants.items():
        print("variant", vn)
        quick_check(cfg, d=vd)
    bench(variants)
