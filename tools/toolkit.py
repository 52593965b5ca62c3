"""Helpers the diagnostics in tools/ share (not installed; run the tools from a checkout).

The FlexAttention catalogue here is the one ``solattn bench --suite flex`` times, written with
``solattn.flex.examples`` only, so that tools which run an older tree (``first_call_flex.py
--trees``) can import it from there too.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

WINDOW = 1024


def doc_ids(L, device, n_docs=16):
    """Document ids (L,) of ``n_docs`` documents with random cuts (seeded)."""
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(L - 1, generator=g)[: n_docs - 1] + 1).values
    ids = torch.zeros(L, dtype=torch.int32)
    ids[cuts] = 1
    return torch.cumsum(ids, 0).to(torch.int32).to(device)


def slopes(H, device):
    return torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)


def catalogue(L, H, B, device):
    """``name -> (score_mod or None, mask_mod)`` for a ``(B, H, L, L)`` problem."""
    from solattn.flex import examples as ex

    table = (torch.randn(H, 2 * L - 1, device=device) * 0.1).requires_grad_()
    prefix = torch.full((B,), L // 4, device=device, dtype=torch.int32)
    return {
        "causal": (None, ex.causal),
        "sliding_window": (None, ex.sliding_window(WINDOW)),
        "document": (None, ex.document_causal(doc_ids(L, device))),
        "prefix_lm": (None, ex.prefix_lm(prefix)),
        "alibi": (ex.alibi(slopes(H, device)), ex.causal),
        "softcap": (ex.softcap(30.0), ex.causal),
        "relative_bias": (ex.relative_bias(table, L), ex.causal),
    }


def graph_us(fn, n=200):
    """Microseconds per replay of one call of ``fn`` captured in a CUDA graph (its GPU time)."""
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
