"""The Hopper forward's tile schedules on the same inputs: one CTA per tile, a static
persistent grid (snake-dealt) and a persistent grid whose CTAs claim tiles from a counter
(``HopperFwdConfig.persistent`` / ``.dynamic``), against the default the launcher picks.

usage: python scripts/bench_schedules.py [--only TEXT] [--passes N]

Shapes: short and banded full problems (``equal`` tiles), packed documents of equal and mixed
lengths (varlen) and batched causal problems (``unequal`` tiles), at d=128 and d=64; bf16,
TFLOP/s over the pairs the mask keeps (FLOPs = 4 * pairs * heads * d), ``do_bench`` medians
after a warm-up, the schedules alternating within each pass. ``same`` says whether every
schedule's output is bitwise equal to one CTA per tile's.
"""
import argparse
import dataclasses

import torch
import triton

from solattn.core import make_params
from solattn.kernels.hopper import forward as F

DEV = "cuda"
MODES = (("one-tile", dict(persistent=False, dynamic=False)),
         ("persistent", dict(persistent=True, dynamic=False)),
         ("dynamic", dict(persistent=True, dynamic=True)))


def default_config(q, k, p, d):
    """The config :func:`solattn.kernels.hopper.forward._make_plan` would pick."""
    cfg = F.hopper_fwd_config(d, p.has_right, p.has_softcap, has_lower=p.has_left,
                              varlen=p.varlen, seqlen_k=k.shape[-3])
    if not p.varlen and p.causal and not p.has_left and F.lpt_all_heads(
            True, triton.cdiv(q.shape[1], 2 * cfg.block_m) * q.shape[2] * q.shape[0],
            torch.cuda.get_device_properties(0).multi_processor_count, k.shape[1], d,
            q.shape[0] * k.shape[2]):
        cfg = dataclasses.replace(cfg, lpt=F.LPT_ALL_HEADS)
    return cfg


def bench(label, q, k, v, p, flops, d, passes):
    base = default_config(q, k, p, d)
    res, outs = {}, {}
    for name, over in MODES:
        cfg = dataclasses.replace(base, **over)
        outs[name] = F.attn_fwd(q, k, v, p, return_lse=True, config=cfg)[0]
        res[name] = []
    same = all(torch.equal(outs["one-tile"], o) for o in outs.values())
    for _ in range(passes):
        for name, over in MODES:
            cfg = dataclasses.replace(base, **over)
            fn = lambda: F.attn_fwd(q, k, v, p, return_lse=True, config=cfg)  # noqa: E731
            triton.testing.do_bench(fn, warmup=100, rep=100)
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            res[name].append(round(flops / ms / 1e9, 1))
    default = ("dynamic" if base.persistent and base.dynamic else
               "persistent" if base.persistent else "one-tile")
    print(f"{label}: default {default}{' lpt' if base.lpt else ''} {res} same={same}",
          flush=True)


def pairs(s_q, s_k, causal, window):
    """(query, key) pairs inside the bottom-right aligned band."""
    i = torch.arange(s_q, dtype=torch.float64) + (s_k - s_q)
    left, right = window
    if causal:
        right = 0
    lo = torch.zeros_like(i) if left < 0 else (i - left).clamp(min=0)
    hi = torch.full_like(i, s_k - 1) if right < 0 else (i + right).clamp(max=s_k - 1)
    return float((hi - lo + 1).sum())


def dense_case(b, hq, hk, s_q, s_k, d, causal=False, window=(-1, -1), **kw):
    q = torch.randn(b, s_q, hq, d, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(b, s_k, hk, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.tensor([2 ** (-8 * (i + 1) / hq) for i in range(hq)],
                                          device=DEV, dtype=torch.float32)
    p = make_params(q, k, causal=causal, window_size=window, **kw)
    return q, k, v, p, 4 * b * hq * d * pairs(s_q, s_k, causal, window)


def varlen_case(lens, h, d, causal):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    cu = cu.to(DEV)
    p = make_params(q, k, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    n_pairs = sum(n * (n + 1) / 2 if causal else n * n for n in lens)
    return q, k, v, p, 4 * h * d * n_pairs


def cases():
    """(label, head dim, thunk building the inputs) of every shape."""
    g = torch.Generator().manual_seed(0)
    out = []
    for d in (128, 64):
        h = 16 if d == 128 else 32
        for b, s in ((32, 512), (16, 1024), (8, 2048), (4, 4096), (1, 16384)):
            out.append((f"d{d} B{b} H{h} L{s}", d, lambda b=b, s=s, d=d, h=h:
                        dense_case(b, h, h, s, s, d)))
        out.append((f"d{d} B1 H8 Lq4k Lk8k", d, lambda d=d: dense_case(1, 8, 8, 4096, 8192, d)))
        out.append((f"d{d} B4 H{h} L4k alibi", d, lambda d=d, h=h:
                    dense_case(4, h, h, 4096, 4096, d, alibi=True)))
        out.append((f"d{d} B4 H{h} L4k softcap 30", d, lambda d=d, h=h:
                    dense_case(4, h, h, 4096, 4096, d, softcap=30.0)))
        out.append((f"d{d} B4 H{h} L4k window (1024, 1024)", d, lambda d=d, h=h:
                    dense_case(4, h, h, 4096, 4096, d, window=(1024, 1024))))
        for s in (4096, 16384):
            out.append((f"d{d} B{16384 // s} H{h} L{s} causal window 1024", d,
                        lambda d=d, h=h, s=s: dense_case(16384 // s, h, h, s, s, d, True,
                                                         (1024, 0))))
        for b, hq, hk, s in ((64, h, h, 256), (16, h, h, 1024), (4, h, h, 4096),
                             (1, h, h, 16384), (1, 32, 4 if d == 64 else 8, 4096)):
            out.append((f"d{d} B{b} Hq{hq} Hkv{hk} L{s} causal", d,
                        lambda b=b, hq=hq, hk=hk, s=s, d=d: dense_case(b, hq, hk, s, s, d, True)))
        for doc, causal in ((256, True), (256, False), (1024, True)):
            out.append((f"d{d} varlen {16384 // doc} documents of {doc} "
                        f"{'causal' if causal else 'full'}", d,
                        lambda doc=doc, causal=causal, d=d, h=h:
                        varlen_case([doc] * (16384 // doc), h, d, causal)))
        for causal in (True, False):
            mixed = torch.randint(256, 4097, (12,), generator=g).tolist()
            short = torch.randint(64, 1025, (40,), generator=g).tolist()
            tag = "causal" if causal else "full"
            out.append((f"d{d} varlen 12 sequences of 256-4096 {tag}", d,
                        lambda mixed=mixed, causal=causal, d=d, h=h:
                        varlen_case(mixed, h, d, causal)))
            out.append((f"d{d} varlen 40 documents of 64-1024 {tag}", d,
                        lambda short=short, causal=causal, d=d, h=h:
                        varlen_case(short, h, d, causal)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the shapes whose label contains this")
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    for label, d, build in cases():
        if args.only in label:
            bench(label, *build(), d, args.passes)


if __name__ == "__main__":
    main()
