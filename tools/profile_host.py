"""Where a training call's host (Python) time goes: cProfile over repeated ``flash_attn_func``
forward + backward calls, the autograd engine's worker threads off so that the backward runs on
the profiled thread, GPU synchronized between blocks so the launch queue never fills.

    python3 tools/profile_host.py [--calls 40] [--top 30] [--shape model|tiny]
    python3 tools/profile_host.py --flex document [--calls 20]

``model``: the 1.1B Llama layer of ``solattn bench --suite model`` (B1 Hq32 Hkv4 L4096 d64
causal; its backward splits each GQA group and sums the partials); ``tiny``: B1 L128 H8 d64
causal (``solattn bench --suite host``'s shape). Prints the functions by own time and by
cumulative time, and the wall time per call without the profiler (forward alone, forward +
backward).

``--flex MOD``: a ``tools/toolkit.py`` catalogue mod at B4 H16 L4096 d128 instead: the forward
(inputs requiring grad) and the backward (``torch.autograd.grad`` of a kept forward) timed three
ways -- host enqueue per call (the backward with the autograd engine's threads on and off), GPU
time per call (CUDA events over back-to-back calls), and ``do_bench`` -- to tell whether
``solattn bench --suite flex``'s numbers are the kernels' or the host's; the backward's kernels
by GPU time (torch.profiler); then the same cProfile tables (engine threads off).
"""

from __future__ import annotations

import argparse
import time

import torch
from toolkit import profile

from solattn import flash_attn_func, flex_attention

SHAPES = {"model": (1, 32, 4, 4096, 64), "tiny": (1, 8, 8, 128, 64)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="model")
    ap.add_argument("--flex", default=None, help="a tools/toolkit.py catalogue mod")
    args = ap.parse_args()
    if args.flex:
        return flex(args)
    b, hq, hkv, seq, d = SHAPES[args.shape]
    torch.autograd.set_multithreading_enabled(False)
    q = torch.randn(b, seq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, seq, hkv, d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    do = torch.randn(b, seq, hq, d, device="cuda", dtype=torch.bfloat16)

    def fwd():
        return flash_attn_func(q, k, v, causal=True)

    def step():
        torch.autograd.grad(fwd(), (q, k, v), do)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    for name, fn in (("forward", fwd), ("forward + backward", step)):
        host, _ = back_to_back(fn, args.calls)
        print(f"{args.shape}: {name}: {min(host):.0f} us host per call (enqueue; best of 5)")
    profile(f"{args.shape} forward + backward", step, 3 * args.calls, args.top, blocks=3)
    return 0


def back_to_back(fn, calls: int):
    """Five blocks of ``calls`` calls of ``fn``: per block, the host's time to enqueue a call
    and the GPU's time per call (CUDA events around the block), in us."""
    host, gpu = [], []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        host.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / calls * 1e3)
    return host, gpu


def flex(args) -> int:
    import os
    import sys

    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from toolkit import catalogue

    from solattn.flex import create_block_mask

    B, H, L, D = 4, 16, 4096, 128
    score_mod, mask_mod = catalogue(L, H, B, "cuda")[args.flex]
    bm = create_block_mask(mask_mod, None, None, L, L, device="cuda")
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    o = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)

    def fwd():
        flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)

    def bwd():
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    for _ in range(10):
        fwd()
        bwd()
    torch.cuda.synchronize()
    host, gpu = back_to_back(fwd, args.calls)
    print(f"{args.flex} forward (inputs require grad): host enqueue {min(host):.0f}-"
          f"{max(host):.0f} us a call, back-to-back {min(gpu):.0f}-{max(gpu):.0f} us a call, "
          f"do_bench {triton.testing.do_bench(fwd, warmup=50, rep=400) * 1e3:.0f} us")
    for threads in (True, False):
        with torch.autograd.set_multithreading_enabled(threads):
            host, gpu = back_to_back(bwd, args.calls)
            print(f"{args.flex} backward, engine threads {'on ' if threads else 'off'}: host "
                  f"enqueue {min(host):.0f}-{max(host):.0f} us a call, back-to-back "
                  f"{min(gpu):.0f}-{max(gpu):.0f} us a call")
    print(f"{args.flex} backward, do_bench: "
          f"{triton.testing.do_bench(bwd, warmup=50, rep=400) * 1e3:.0f} us")
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            bwd()
        torch.cuda.synchronize()
    print(f"\n=== {args.flex} backward: kernels by GPU time, 10 calls")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8,
                                    max_name_column_width=60))
    torch.autograd.set_multithreading_enabled(False)
    profile(f"{args.flex} backward", bwd, args.calls, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
