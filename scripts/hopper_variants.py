"""GPU A/B of Hopper forward configs against the default one, in one process (issue 11 work).

usage: python scripts/hopper_variants.py compile NAME   (correctness check of one variant; run
                                                          one per process, in parallel, first)
       python scripts/hopper_variants.py bench [NAME ...]
       python scripts/hopper_variants.py bench-few NAME ...  (the FEW_WAVES shapes)
       python scripts/hopper_variants.py bench-short NAME ...  (the SHORT shapes)
       python scripts/hopper_variants.py bench-l2 NAME ...  (the L2_RESIDENT shapes)

Variants are ``HopperFwdConfig`` overrides of the default config of a head dim (VARIANTS below);
every shape times cuDNN (torch SDPA, CUDNN_ATTENTION), our default config ("ours") and the
variants of its head dim and causality, bf16, ``do_bench`` medians after a warm-up.
"""
import dataclasses
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from solattn.core import make_params
from solattn.kernels.hopper import forward as F
from solattn.reference import attention_ref

dev = "cuda"

# name -> (head dim, causal or None for both, config overrides)
VARIANTS = {
    "default": (None, None, dict()),  # compiled and checked like the others; timed as "ours"
    # run 1 (2026-11-23): 3 consumer warpgroups at d=64, LPT over all heads
    "c3": (64, False, dict(consumers=3, consumer_regs=160)),
    "c3s3": (64, False, dict(consumers=3, consumer_regs=160, stages=3)),
    "c3s4": (64, False, dict(consumers=3, consumer_regs=160, stages=4)),
    "c3tile": (64, False, dict(consumers=3, consumer_regs=160, persistent=False)),
    "c3causal": (64, True, dict(consumers=3, consumer_regs=160, persistent=False)),
    "lpt_all_p": (None, True, dict(persistent=True, lpt=4096)),
    "lpt_all": (None, True, dict(persistent=False, lpt=4096)),
    "c3lpt_p": (64, True, dict(consumers=3, consumer_regs=160, persistent=True, lpt=4096)),
    # run 2: LPT within head groups whose K/V fit in 24 MiB (or 12, 48) of L2
    "lpt24": (None, True, dict(persistent=False, lpt=24)),
    "lpt24_p": (None, True, dict(persistent=True, lpt=24)),
    "lpt12": (None, True, dict(persistent=False, lpt=12)),
    "lpt48": (None, True, dict(persistent=False, lpt=48)),
    # run 4 (2026-11-26): short sequences, the d=128 kernel persistent (two one-consumer CTAs
    # an SM, with a launch cap of 200 registers, lost 21-41%: BENCHMARKS.md, removed)
    "p_d128": (128, False, dict(persistent=True)),
}

SHAPES = [  # name, b, h, h_kv, sq, sk, d, causal
    ("B4 H16 L4k D128", 4, 16, 16, 4096, 4096, 128, False),
    ("B4 H16 L4k D128 causal", 4, 16, 16, 4096, 4096, 128, True),
    ("B1 H8 Lq4k Lk8k D128", 1, 8, 8, 4096, 8192, 128, False),
    ("B1 H16 L16k D128 causal", 1, 16, 16, 16384, 16384, 128, True),
    ("B8 H16 L2k D128 causal", 8, 16, 16, 2048, 2048, 128, True),
    ("B4 H32 L4k D64", 4, 32, 32, 4096, 4096, 64, False),
    ("B4 H32 L4k D64 causal", 4, 32, 32, 4096, 4096, 64, True),
    ("B1 H32 L16k D64 causal", 1, 32, 32, 16384, 16384, 64, True),
    ("B2 H8 L4k D256 causal", 2, 8, 8, 4096, 4096, 256, True),
    ("B1 H16 L8k D256 causal", 1, 16, 16, 8192, 8192, 256, True),
    ("B8 H16 L2k D256 causal", 8, 16, 16, 2048, 2048, 256, True),
    ("B1 Hq32 Hkv8 L8k D128 (GQA)", 1, 32, 8, 8192, 8192, 128, False),
    ("B1 Hq32 Hkv8 L8k D128 (GQA) causal", 1, 32, 8, 8192, 8192, 128, True),
]

# Run 4: short sequences (few key blocks a tile), where a CTA's fixed cost weighs most.
SHORT = [
    ("B32 H16 L512 D128", 32, 16, 16, 512, 512, 128, False),
    ("B16 H16 L1k D128", 16, 16, 16, 1024, 1024, 128, False),
    ("B16 H16 L1k D128 causal", 16, 16, 16, 1024, 1024, 128, True),
    ("B4 H16 L4k D128", 4, 16, 16, 4096, 4096, 128, False),
    ("B32 H32 L512 D64", 32, 32, 32, 512, 512, 64, False),
    ("B1 Hq32 Hkv4 L4k D64 (GQA) causal", 1, 32, 4, 4096, 4096, 64, True),
    ("B4 H32 L4k D64", 4, 32, 32, 4096, 4096, 64, False),
]

# Run 3: causal problems of at most ~4 waves of tiles (512 tiles on 132 SMs), where the tail of
# the hardware scheduler's head-major order matters most.
FEW_WAVES = [
    ("B2 H8 L4k D256 causal", 2, 8, 8, 4096, 4096, 256, True),
    ("B1 H4 L16k D256 causal", 1, 4, 4, 16384, 16384, 256, True),
    ("B1 H8 L8k D128 causal", 1, 8, 8, 8192, 8192, 128, True),
    ("B2 H8 L4k D128 causal", 2, 8, 8, 4096, 4096, 128, True),
    ("B4 H4 L4k D128 causal", 4, 4, 4, 4096, 4096, 128, True),
    ("B1 H8 L8k D64 causal", 1, 8, 8, 8192, 8192, 64, True),
    ("B1 Hq16 Hkv4 L8k D128 (GQA) causal", 1, 16, 4, 8192, 8192, 128, True),
]

# Run 5 (2026-11-26): causal problems of many tiles (> 4 per SM) whose K and V, all heads
# together, are small enough to stay in L2 while every head's longest tiles run at once.
L2_RESIDENT = [
    ("B1 Hq32 Hkv4 L4k D64 (GQA) causal", 1, 32, 4, 4096, 4096, 64, True),     # 4 MiB
    ("B4 Hq32 Hkv4 L4k D64 (GQA) causal", 4, 32, 4, 4096, 4096, 64, True),     # 16 MiB
    ("B1 Hq32 Hkv8 L4k D128 (GQA) causal", 1, 32, 8, 4096, 4096, 128, True),   # 16 MiB
    ("B1 Hq64 Hkv8 L4k D128 (GQA) causal", 1, 64, 8, 4096, 4096, 128, True),   # 16 MiB
    ("B1 H16 L4k D128 causal", 1, 16, 16, 4096, 4096, 128, True),              # 32 MiB
    ("B1 H32 L4k D64 causal", 1, 32, 32, 4096, 4096, 64, True),                # 32 MiB
    ("B1 Hq32 Hkv8 L8k D128 (GQA) causal", 1, 32, 8, 8192, 8192, 128, True),   # 32 MiB
    ("B2 Hq32 Hkv4 L8k D64 (GQA) causal", 2, 32, 4, 8192, 8192, 64, True),     # 16 MiB
]


def config(name, d, causal):
    vd, vc, over = VARIANTS[name]
    if (vd is not None and vd != d) or (vc is not None and vc != causal):
        return None
    return dataclasses.replace(F.hopper_fwd_config(d, causal), **over)


def run(q, k, v, causal, cfg):
    return F.attn_fwd(q, k, v, make_params(q, k, causal=causal), return_lse=True, config=cfg)


def check(name):
    """Variant vs the float64 oracle (flash-attn's 2x rule) on ragged, GQA, multi-tile shapes."""
    torch.manual_seed(0)
    ok = True
    for d in (64, 128, 256):
        for (b, sq, sk, h, hk) in [(2, 300, 700, 4, 2), (1, 517, 200, 2, 2), (3, 1500, 1000, 6, 3),
                                   (2, 2000, 2000, 40, 8), (1, 4099, 4099, 3, 1)]:
            for causal in (False, True):
                cfg = config(name, d, causal)
                if cfg is None:
                    continue
                q = torch.randn(b, sq, h, d, device=dev, dtype=torch.bfloat16)
                k = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
                o, lse = run(q, k, v, causal, cfg)
                ref, rl = attention_ref(q, k, v, causal=causal)
                lo, _ = attention_ref(q, k, v, causal=causal, upcast=False)
                e = (o.double() - ref).abs().max().item()
                e0 = (lo.double() - ref).abs().max().item()
                fin = torch.isfinite(rl)
                el = (lse[fin].double() - rl[fin]).abs().max().item() if fin.any() else 0.0
                good = e <= 2 * e0 + 1e-5 and el < 2e-3 and torch.equal(torch.isinf(lse), ~fin)
                ok &= good
                if not good:
                    print(f"FAIL {name} d{d} {b},{sq},{sk},{h},{hk} causal={causal}: err {e:.2e} "
                          f"(torch {e0:.2e}) lse {el:.1e}", flush=True)
    print(f"check {name}: {'OK' if ok else 'FAIL'}", flush=True)


def bench(names, shapes=SHAPES):
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows, cols = [], ["cudnn", "ours"] + names
    for label, b, h, hk, sq, sk, d, causal in shapes:
        torch.manual_seed(0)
        q = torch.randn(b, sq, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
        flops = 4 * b * h * sq * sk * d * (0.5 if causal else 1.0)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if hk != h:
            kt, vt = (t.repeat_interleave(h // hk, dim=1) for t in (kt, vt))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fns = {}
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(qt, kt, vt, is_causal=causal)
        fns["cudnn"] = cudnn
        fns["ours"] = lambda: run(q, k, v, causal, None)
        for n in names:
            cfg = config(n, d, causal)
            if cfg is not None:
                fns[n] = (lambda c: lambda: run(q, k, v, causal, c))(cfg)
        res = {}
        for _ in range(2):  # a second pass, interleaved: the first after a compile reads low
            for n, fn in fns.items():
                ms = triton.testing.do_bench(fn, warmup=100, rep=300, return_mode="median")
                res[n] = max(res.get(n, 0.0), flops / ms / 1e9)
        rows.append((label, res))
        print(label, " ".join(f"{n}={x:.0f}" for n, x in res.items()), flush=True)
    print("\n| shape | " + " | ".join(cols) + " |")
    print("|" + " --- |" * (len(cols) + 1))
    for label, res in rows:
        print(f"| {label} | " + " | ".join(f"{res[c]:.0f}" if c in res else "" for c in cols)
              + " |")


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        check(sys.argv[2])
    elif sys.argv[1] == "bench-few":
        bench(sys.argv[2:], FEW_WAVES)
    elif sys.argv[1] == "bench-short":
        bench(sys.argv[2:], SHORT)
    elif sys.argv[1] == "bench-l2":
        bench(sys.argv[2:], L2_RESIDENT)
    else:
        bench(sys.argv[2:] or [n for n in VARIANTS if n != "default"])
