"""Host (CPU) time per call of the public API on tiny shapes, where the GPU work is negligible.

    python3 scripts/bench_host.py [--json FILE]

For each entry point the loop issues N calls back to back and synchronizes once: with kernels of
a few microseconds the GPU never holds the loop up, so the wall time per call is the Python and
launch overhead a user pays (SDPA's flash backend, timed the same way, is the yardstick). A
second number, in a CUDA graph, is the GPU time of one call.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from solattn import flash_attn_func, flash_attn_with_kvcache


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def graph_us(fn, n=200):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    res = {}
    q = torch.randn(1, 128, 8, 64, device=dev, dtype=dt)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    cases = {
        "flash_attn_func B1 L128 H8 D64 causal": lambda: flash_attn_func(q, k, v, causal=True),
        "flash_attn_func B1 L128 H8 D128": None,
    }
    q2 = torch.randn(1, 128, 8, 128, device=dev, dtype=dt)
    cases["flash_attn_func B1 L128 H8 D128"] = lambda: flash_attn_func(q2, q2, q2)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    cases["sdpa flash B1 L128 H8 D64 causal"] = sdpa
    # decode step: B1, Hq32 Hkv8 d128, 4096 cached tokens, append one token
    kc = torch.randn(1, 8192, 8, 128, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    qd = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    kn, vn = torch.randn(1, 1, 8, 128, device=dev, dtype=dt), torch.randn(1, 1, 8, 128,
                                                                          device=dev, dtype=dt)
    lens = torch.full((1,), 4096, dtype=torch.int32, device=dev)
    cases["flash_attn_with_kvcache decode B1 Hq32 Hkv8 L4096"] = lambda: flash_attn_with_kvcache(
        qd, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True)
    qs, ks, vs = (t.transpose(1, 2) for t in (qd, kc[:, :4096], vc[:, :4096]))

    def sdpa_decode():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
    cases["sdpa cudnn decode B1 Hq32 Hkv8 L4096 (no append)"] = sdpa_decode
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, fn in cases.items():
        try:
            host = per_call_us(fn)
            gpu = graph_us(fn)
        except Exception as exc:  # a peer that cannot run here
            print(f"{name:<56} unavailable: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        res[name] = dict(host_us=host, graph_us=gpu)
        print(f"{name:<56} host {host:7.1f} us/call   graph replay {gpu:6.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
