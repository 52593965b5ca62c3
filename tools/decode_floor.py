"""The floor of a batch-1 split-KV decode launch (diagnostic, GPU only).

    python3 tools/decode_floor.py [--lengths 32768,65536]

A Triton kernel that only streams the K/V slices the decode kernel reads (grid ``(splits,
h_kv)``, the cache layout ``(1, L, h_kv, d)``, ``block_n``-row tiles, no arithmetic but a sum)
is timed beside the fused decode launch at the same split counts, in CUDA-graph replays: the gap
between the two is the decode kernel's own cost (softmax, merge); the gap between the stream and
the read ceiling is the launch's (ramp-up, tail, grid shape).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from solattn.configs import DecodeConfig, decode_config, decode_num_splits
from solattn.kernels.triton.decode import fused_decode
from solattn.params import AttnParams


@triton.jit
def stream_kernel(K, V, OUT, L, stride_s, per_split, BLOCK_N: tl.constexpr, D: tl.constexpr):
    split = tl.program_id(0)
    h = tl.program_id(1)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, L)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    base = h * D + cols[None, :]
    for s in range(lo, hi, BLOCK_N):
        off = (s + rows)[:, None] * stride_s + base
        ok = (s + rows)[:, None] < hi
        acc += tl.load(K + off, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(V + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + (split * tl.num_programs(1) + h), tl.sum(tl.sum(acc, 1), 0))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="32768,65536,131072")
    p.add_argument("--no-stream", action="store_true", help="only the decode launches")
    p.add_argument("--splits", default="8,16,32,48,64")
    p.add_argument("--configs", default="64,4,3 64,4,4",
                   help="decode (block_n, warps, stages) besides the default config")
    p.add_argument("--tag", default="", help="a label printed on every decode line")
    p.add_argument("--split-only", action="store_true",
                   help="also time the split kernel alone (partials written, no merge)")
    a = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 1 << 30
    x = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    x.sum(dtype=torch.float32)
    read = n / do_bench_cudagraph(lambda: x.sum(dtype=torch.float32), rep=60) / 1e6
    x = None
    print(f"# read ceiling (1 GiB x.sum, CUDA graph): {read:.0f} GB/s; {sms} SMs")
    h, h_kv, d = 32, 8, 128
    for L in (int(s) for s in a.lengths.split(",")):
        kc = torch.randn(1, L, h_kv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(1, 1, h, d, device="cuda", dtype=torch.bfloat16)
        seqlens = torch.full((1,), L, dtype=torch.int32, device="cuda")
        nbytes = 2 * kc.numel() * 2
        ideal_us = nbytes / read / 1e3
        print(f"\n# L{L}: {nbytes / 1e6:.1f} MB, at the ceiling {ideal_us:.1f} us")

        def show(what, ms):
            print(f"L{L:<7} {what:<40} {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s "
                  f"{100 * nbytes / ms / 1e6 / read:5.1f}%  (+{ms * 1e3 - ideal_us:.1f} us)",
                  flush=True)

        if a.no_stream:
            splits_list = ()
        else:
            both = torch.cat([kc.reshape(-1), vc.reshape(-1)])
            show("torch sum of K and V (one tensor)", do_bench_cudagraph(
                lambda: both.sum(dtype=torch.float32), rep=60))
            both = None
            splits_list = (8, 16, 32, 48, 64, 128)
        out = torch.empty(4096, device="cuda", dtype=torch.float32)
        for splits in splits_list:
            for bn, w, st in ((64, 4, 3), (64, 4, 4), (128, 8, 3), (32, 4, 4)):
                per = triton.cdiv(triton.cdiv(L, splits), bn) * bn

                def run(per=per, splits=splits, bn=bn, w=w, st=st):
                    stream_kernel[(splits, h_kv)](kc, vc, out, L, h_kv * d, per, BLOCK_N=bn,
                                                  D=d, num_warps=w, num_stages=st)
                run()
                show(f"stream splits {splits} bn{bn} w{w} st{st}",
                     do_bench_cudagraph(run, rep=60))
        prm = AttnParams(scale=d ** -0.5, group_size=h // h_kv)
        base = decode_config(90, d, d, h // h_kv)
        heur = decode_num_splits(h_kv, L, base.block_n, sms)
        configs = [(base.block_n, base.num_warps, base.num_stages)] + [
            tuple(int(x) for x in c.split(",")) for c in a.configs.split()]
        for splits in sorted({heur, *(int(x) for x in a.splits.split(","))}):
            for bn, w, st in dict.fromkeys(configs):
                cfg = DecodeConfig(block_m=base.block_m, block_n=bn, num_warps=w, num_stages=st)

                def dec(cfg=cfg, splits=splits):
                    return fused_decode(q, kc, vc, None, None, prm, cache_seqlens=seqlens,
                                        cache_batch_idx=None, cache_leftpad=None,
                                        block_table=None, num_splits=splits, arch=90,
                                        num_sms=sms, config=cfg)
                dec()
                if a.split_only:
                    from solattn.kernels.triton.decode import _decode_plan
                    plan = _decode_plan(q, kc, vc, None, prm, True, False, False, None, 0,
                                        splits, 90, sms, cfg)
                    o_buf = torch.empty(plan.o_buf_shape, device="cuda", dtype=torch.float32)
                    l_buf = torch.empty(plan.o_buf_shape[:-1], device="cuda",
                                        dtype=torch.float32)

                    def alone(plan=plan, o_buf=o_buf, l_buf=l_buf):
                        plan.decode(q, kc, vc, o_buf, l_buf, q, seqlens, seqlens, seqlens,
                                    seqlens, q, q, q, q, seqlens)
                    alone()
                    show(f"{a.tag}split kernel alone {splits} bn{bn} w{w} st{st}",
                         do_bench_cudagraph(alone, rep=60))
                tag = " (default)" if (splits == heur and cfg.block_n == base.block_n) else ""
                show(f"{a.tag}decode splits {splits} bn{bn} w{w} st{st}{tag}",
                     do_bench_cudagraph(dec, rep=60))
        kc = vc = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
