"""Time the first calls of a fresh process: forward and backward of ``flash_attn_func`` per case,
and what Triton did for them (kernels compiled vs loaded from its on-disk cache).

    python scripts/cold_start.py [--cases bf16:128:causal,bf16:128:full,bf16:64:causal]
                                 [--shape 1,1024,8] [--expect-cached]

Run it in a new process after ``solattn warmup`` (``--expect-cached``: exit 1 if any kernel
compiled), or with an empty ``TRITON_CACHE_DIR`` for the cold numbers. Each time is one call,
synchronized, the first of its kind in the process. CUDA's context and torch's first autograd
backwards (timed and printed: the engine's one-time set-up and, for a backward given a gradient
tensor, torch's import of sympy, ~2 s on the H100's host; solattn or not) come before the first
case, which also pays for Triton's driver set-up.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from triton import knobs

import solattn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="bf16:128:causal,bf16:128:full,bf16:64:causal",
                    help="comma-separated dtype:head_dim:causal|full")
    ap.add_argument("--shape", default="1,1024,8", help="batch,seqlen,heads")
    ap.add_argument("--expect-cached", action="store_true",
                    help="exit 1 if any kernel was compiled (not loaded from the cache)")
    ap.add_argument("--decode", action="store_true",
                    help="also time the first flash_attn_with_kvcache decode step (bf16, B1 "
                         "Hq32 Hkv8 d128, 4096 cached keys, append, causal; after "
                         "`solattn warmup --kvcache` it compiles nothing)")
    args = ap.parse_args()
    batch, seqlen, heads = (int(x) for x in args.shape.split(","))

    events: list[tuple[str, bool]] = []  # (kernel, loaded from the cache)
    knobs.compilation.listener = lambda *, src, cache_hit, **_: events.append(
        (src.name, cache_hit))
    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()  # CUDA context and allocator, outside the timed calls
    t0 = time.perf_counter()  # torch's own first backward (autograd engine set-up)
    x = torch.ones(4, device="cuda", requires_grad=True)
    (x * 2).sum().backward()
    torch.cuda.synchronize()
    print(f"torch's first backward (no solattn): {time.perf_counter() - t0:.3f}s", flush=True)
    # torch's first backward *with an explicit gradient* (``out.backward(dout)``, as each case
    # below does): torch.autograd's _make_grads imports torch.fx.experimental.symbolic_shapes,
    # and with it sympy, on the first call given a gradient tensor, whatever the graph
    # (``loss.backward()`` on a scalar never does). Timed on its own, outside solattn's cases.
    t0 = time.perf_counter()
    (x * 2).backward(torch.ones_like(x))
    torch.cuda.synchronize()
    print(f"torch's first backward given a gradient tensor (no solattn; imports sympy): "
          f"{time.perf_counter() - t0:.3f}s", flush=True)

    compiled = 0
    for case in args.cases.split(","):
        name, d, mode = case.split(":")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
        q, k, v = (torch.randn(batch, seqlen, heads, int(d), device="cuda", dtype=dtype,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn(batch, seqlen, heads, int(d), device="cuda", dtype=dtype)
        times = []
        for step in ("fwd", "bwd"):
            del events[:]
            t0 = time.perf_counter()
            if step == "fwd":
                out = solattn.flash_attn_func(q, k, v, causal=mode == "causal")
            else:
                out.backward(dout)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t0
            misses = [n for n, hit in events if not hit]
            compiled += len(misses)
            times.append(f"{step} {secs:6.3f}s ({len(events) - len(misses)} loaded, "
                         f"{len(misses)} compiled{': ' + ' '.join(misses) if misses else ''})")
        print(f"{case:<16} B{batch} L{seqlen} H{heads}: " + "  ".join(times), flush=True)
    if args.decode:
        kc, vc = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16)
                  for _ in range(2))
        q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((1,), 4096, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        times = []
        for _ in range(2):  # the first step, then the second (a warm call, for scale)
            del events[:]
            t0 = time.perf_counter()
            solattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
            torch.cuda.synchronize()
            misses = [n for n, hit in events if not hit]
            compiled += len(misses)
            times.append(f"{time.perf_counter() - t0:6.3f}s ({len(events) - len(misses)} loaded, "
                         f"{len(misses)} compiled{': ' + ' '.join(misses) if misses else ''})")
        print(f"{'decode step':<16} B1 Hq32 Hkv8 d128 L4096: first {times[0]}  second {times[1]}",
              flush=True)
    if args.expect_cached and compiled:
        print(f"cold_start: {compiled} kernel(s) compiled, expected none", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
