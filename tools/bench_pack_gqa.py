"""What packing a KV head's query heads into one tile ("pack-GQA") is worth on GQA shapes.

    PYTHONPATH=$PWD[:fa4 site] python3 tools/bench_pack_gqa.py [--json FILE]

Two measurements, bf16, TFLOP/s from `triton.testing.do_bench` medians, best of three
interleaved passes after a warm-up:

* FlashAttention-4 (when `flash_attn.cute` imports) with its default `pack_gqa` (on for GQA)
  and with `pack_gqa=False`: what the technique gives the kernel that has it.
* Our Hopper forward on the unpacked problem and on the same problem packed on the host: for
  KV head ``j`` the rows ``(position l, head g)`` of its ``G`` query heads become one sequence of
  ``L * G`` rows ``l * G + g`` of a multi-head problem with ``H = Hkv`` (the copy is made once,
  outside the timing). Without a causal mask this is exactly the attention a packed kernel
  computes, tile for tile (a tile of 128 rows covers 128 / G positions of all G heads), so its
  time is what pack-GQA would give our kernel; causal needs each row's position ``row // G`` in
  the mask, so only non-causal shapes are packed here. The packed output is checked against the
  unpacked one before timing.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

SHAPES = [  # (B, Hq, Hkv, L, D, causal)
    (1, 32, 4, 4096, 64, False),
    (1, 32, 4, 4096, 64, True),
    (1, 32, 8, 8192, 128, False),
    (1, 32, 8, 8192, 128, True),
    (8, 32, 8, 1024, 128, False),
    (8, 32, 8, 1024, 128, True),
    (16, 32, 4, 512, 64, False),
    (4, 32, 32, 4096, 64, True),  # MHA control: pack_gqa has nothing to pack
]


def tflops(b, h, lq, lk, d, causal, ms):
    f = 4 * b * h * lq * lk * d * (0.5 if causal else 1.0)
    return f / ms / 1e9


def pack(q, hkv):
    """(B, L, Hq, D) -> (B, L * G, Hkv, D): KV head j's rows l * G + g (head j * G + g)."""
    b, L, hq, d = q.shape
    g = hq // hkv
    x = q.view(b, L, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, L * g, d).contiguous()
    return x.transpose(1, 2)


def unpack(o, hkv, L):
    b, lg, _, d = o.shape
    g = lg // L
    return o.transpose(1, 2).reshape(b, hkv, L, g, d).permute(0, 2, 1, 3, 4).reshape(
        b, L, hkv * g, d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()

    import solattn

    try:
        from flash_attn.cute.interface import flash_attn_func as fa4
    except Exception as exc:  # noqa: BLE001
        print(f"FA4 not importable: {type(exc).__name__}: {exc}")
        fa4 = None

    rows = []
    for (b, hq, hkv, L, d, causal) in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(b, L, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, L, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, L, hkv, d, device="cuda", dtype=torch.bfloat16)
        fns = {"ours": lambda: solattn.flash_attn_func(q, k, v, causal=causal)}
        if not causal and hq != hkv:
            qp = pack(q, hkv)
            ref = solattn.flash_attn_func(q, k, v)
            got = unpack(solattn.flash_attn_func(qp, k, v), hkv, L)
            err = (got.float() - ref.float()).abs().max().item()
            assert err == 0.0 or err < 1e-2, f"packed output differs by {err}"
            fns["ours packed"] = lambda: solattn.flash_attn_func(qp, k, v)
        if fa4 is not None:
            fns["fa4"] = lambda: fa4(q, k, v, causal=causal)
            if hq != hkv:
                fns["fa4 pack_gqa=False"] = lambda: fa4(q, k, v, causal=causal, pack_gqa=False)
        best = {}
        for name, fn in fns.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        for _ in range(args.passes):
            for name, fn in fns.items():
                ms = triton.testing.do_bench(fn, warmup=50, rep=200)
                best[name] = min(best.get(name, 1e9), ms)
        row = dict(B=b, Hq=hq, Hkv=hkv, L=L, D=d, causal=causal,
                   **{n: round(tflops(b, hq, L, L, d, causal, ms), 1) for n, ms in best.items()})
        rows.append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
