"""Host (CPU) time per call of the public API on tiny shapes, where the GPU work is negligible.

    python3 scripts/bench_host.py [--json FILE] [--profile] [--n N] [--blocks B] [--only TEXT]

Method: each entry point runs N times back to back (after a warmup) with one
``torch.cuda.synchronize()`` at each end; the wall time per call (``time.perf_counter``) is the
Python and launch overhead a user pays, as long as the GPU keeps up (``--blocks B``: the N
calls in B blocks, the median block; the GPU machine's host has bursts of noise that move a
single block by 10-50%). The second number, one call
replayed in a CUDA graph, is its GPU time: where it is below the host time the GPU never held
the loop up. Peers: SDPA's flash and cuDNN backends on the same problems (the decode peer
attends over the cache without appending); FlexAttention with a document mask against torch's
compiled flex. ``--profile`` prints cProfile's top 20 (by own time, then cumulative) of our
forward, forward+backward, decode step and flex calls. With solattn's ``ordinary_launches``
available, "(ordinary launches)" rows time our calls through ``kernel[grid](...)`` for
comparison, and
"(separate launches)" the decode step as append + split-KV + combine launches (the path before
the fused decode launch, still run where that does not apply).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import solattn
from solattn import flash_attn_func, flash_attn_with_kvcache

try:
    from solattn.launch import fast_path_status, ordinary_launches
except ImportError:  # an older tree without cached launches
    fast_path_status, ordinary_launches = None, None
try:
    from solattn.kvcache import separate_launches
except ImportError:  # an older tree without the fused decode launch
    separate_launches = None


def per_call_us(fn, n, blocks=1, stat=statistics.median):
    """Wall time per call of ``n`` calls after a warm-up; with ``blocks > 1`` the ``n`` calls run
    as that many blocks (a synchronize around each) and the median block counts (or ``stat``'s
    choice: ``min`` for A/B runs of two trees on a noisy host), so a burst of host noise spoils
    one block, not the result."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    per_block = max(n // blocks, 1)
    times = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(per_block):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / per_block * 1e6)
    return stat(times)


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


def sdpa(backend, *args, **kwargs):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(*args, **kwargs)


def cases():
    dev, dt = "cuda", torch.bfloat16
    q, k, v = (torch.randn(1, 128, 8, 64, device=dev, dtype=dt) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn_like(q)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    qtg, ktg, vtg = (t.detach().clone().requires_grad_() for t in (qt, kt, vt))
    gt = g.transpose(1, 2)
    out = {}
    for causal in (True, False):
        tag = "causal" if causal else "full"
        out[f"fwd {tag}: flash_attn_func"] = (
            lambda c=causal: flash_attn_func(q, k, v, causal=c), True)
        out[f"fwd {tag}: sdpa flash"] = (
            lambda c=causal: sdpa(SDPBackend.FLASH_ATTENTION, qt, kt, vt, is_causal=c), False)
        out[f"fwd {tag}: sdpa cudnn"] = (
            lambda c=causal: sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, is_causal=c), False)
        out[f"fwd+bwd {tag}: flash_attn_func"] = (
            lambda c=causal: flash_attn_func(qg, kg, vg, causal=c).backward(g), True)
        out[f"fwd+bwd {tag}: sdpa flash"] = (
            lambda c=causal: sdpa(SDPBackend.FLASH_ATTENTION, qtg, ktg, vtg,
                                  is_causal=c).backward(gt), False)
        out[f"fwd+bwd {tag}: sdpa cudnn"] = (
            lambda c=causal: sdpa(SDPBackend.CUDNN_ATTENTION, qtg, ktg, vtg,
                                  is_causal=c).backward(gt), False)
    # Decode step: B1, Hq32 Hkv8 d128, 4096 cached tokens, one query; with and without
    # appending the new token (the peers attend over the first 4096 cache rows, no append).
    kc = torch.randn(1, 8192, 8, 128, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    qd = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    kn, vn = (torch.randn(1, 1, 8, 128, device=dev, dtype=dt) for _ in range(2))
    lens = torch.full((1,), 4096, dtype=torch.int32, device=dev)
    out["decode: flash_attn_with_kvcache + append"] = (
        lambda: flash_attn_with_kvcache(qd, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True),
        True)
    out["decode: flash_attn_with_kvcache"] = (
        lambda: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, causal=True), True)
    qs, ks, vs = (t.transpose(1, 2) for t in (qd, kc[:, :4096], vc[:, :4096]))
    out["decode: sdpa cudnn"] = (
        lambda: sdpa(SDPBackend.CUDNN_ATTENTION, qs, ks, vs, enable_gqa=True), False)
    out["decode: sdpa flash"] = (
        lambda: sdpa(SDPBackend.FLASH_ATTENTION, qs, ks, vs, enable_gqa=True), False)
    out.update(flex_cases())
    return out


def flex_cases():
    """FlexAttention, B1 H2 L256 D128, a document mask (4 documents): ours and torch's compiled
    flex (warm), forward without and with inputs requiring grad, and forward + backward."""
    from torch.nn.attention import flex_attention as tflex

    dev, dt, L = "cuda", torch.bfloat16, 256
    q, k, v = (torch.randn(1, 2, L, 128, device=dev, dtype=dt) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn_like(q)
    docs = torch.arange(L, device=dev) // (L // 4)

    def doc_mask(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    out = {}
    ours = solattn.create_block_mask(doc_mask, None, None, L, L, device=dev)
    torch_bm = tflex.create_block_mask(doc_mask, None, None, L, L, device=dev)
    compiled = torch.compile(tflex.flex_attention)
    for tag, fa, bm in (("solattn.flex_attention", solattn.flex_attention, ours),
                        ("torch compiled flex", compiled, torch_bm)):
        mine = tag.startswith("solattn")
        out[f"flex fwd: {tag}"] = (lambda fa=fa, bm=bm: fa(q, k, v, block_mask=bm), mine)
        out[f"flex fwd (grad inputs): {tag}"] = (
            lambda fa=fa, bm=bm: fa(qg, kg, vg, block_mask=bm), mine)
        out[f"flex fwd+bwd: {tag}"] = (
            lambda fa=fa, bm=bm: fa(qg, kg, vg, block_mask=bm).backward(g), mine)
    return out


def profile(name, fn, n=2000, top=20, blocks=1):
    """cProfile over ``n`` calls of ``fn`` in ``blocks`` blocks (the GPU synchronized after
    each, so the launch queue never fills where the GPU is slower than the host): the ``top``
    functions by own time, then by cumulative time."""
    pr = cProfile.Profile()
    for _ in range(blocks):
        pr.enable()
        for _ in range(n // blocks):
            fn()
        torch.cuda.synchronize()
        pr.disable()
    for order in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(order).print_stats(top)
        text = s.getvalue()
        print(f"\n--- cProfile, {n} calls of {name} (top {top} by {order}) ---")
        print(text[text.find("   ncalls"):].rstrip())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--blocks", type=int, default=1,
                    help="split the N calls into this many blocks, report the median block")
    ap.add_argument("--only", default=None, help="only the cases whose name contains this")
    ap.add_argument("--min", action="store_true",
                    help="report the fastest block instead of the median one")
    ap.add_argument("--no-ordinary", action="store_true",
                    help="skip the (ordinary launches) rows")
    args = ap.parse_args()
    status = fast_path_status() if fast_path_status else "absent (older tree)"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}, solattn from {solattn.__file__}; "
          f"cached launches: {status}")
    print("method: wall time per call over N back-to-back calls, synchronize at both ends; "
          "graph = one call replayed in a CUDA graph (GPU time)")
    res = {}
    table = cases()
    variants = [("", contextlib.nullcontext)]
    if ordinary_launches is not None and not args.no_ordinary:
        variants.append((" (ordinary launches)", ordinary_launches))
    for name, (fn, ours) in table.items():
        if args.only and args.only not in name:
            continue
        extra = []
        if ours and name.startswith("decode") and separate_launches is not None:
            extra = [(" (separate launches)", separate_launches)]
        for suffix, ctx in (variants + extra if ours else variants[:1]):
            label = name + suffix
            try:
                with ctx():
                    host = per_call_us(fn, args.n, args.blocks,
                                       min if args.min else statistics.median)
            except Exception as exc:  # a peer that cannot run here
                print(f"{label:<58} unavailable: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            try:
                with ctx():
                    gpu = f"{graph_us(fn):6.1f} us"
            except Exception as exc:  # not capturable (e.g. autograd in some versions)
                torch.cuda.synchronize()
                gpu = f"n/a ({type(exc).__name__})"
            res[label] = dict(host_us=host, graph=gpu)
            print(f"{label:<58} host {host:7.1f} us/call   graph {gpu}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.profile:
        for name in ("fwd causal: flash_attn_func", "fwd+bwd causal: flash_attn_func",
                     "decode: flash_attn_with_kvcache + append",
                     "flex fwd: solattn.flex_attention", "flex fwd+bwd: solattn.flex_attention"):
            if args.only is None or args.only in name:
                profile(name, table[name][0])


if __name__ == "__main__":
    main()
