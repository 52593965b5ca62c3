"""Packed-sequence suites: ``varlen`` (the Hopper forward against the portable one on mixed
lengths) and ``paged-varlen`` (a serving batch read from a paged KV cache against the same keys
stored contiguously)."""

from __future__ import annotations

import torch

from ..core import Inputs, visible_pairs
from ..suite import Row, Suite
from .common import dout_of, forced, randn, timed_call


def _cu(lens, device):
    return torch.tensor([0] + list(lens), device=device).cumsum(0).to(torch.int32)


def _varlen_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, backend=None, **kw):
    from solattn import flash_attn_varlen_func

    def run():
        with torch.no_grad(), forced(backend):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, **kw)
    return lambda: run


def _reference(q, k, v, lens_q, lens_k, causal, direction="fwd", **kw):
    """float64 attention sequence by sequence, packed like the output (``fwd``), or its
    gradients for the output gradient of :func:`~.common.dout_of` (``bwd``)."""
    from solattn.reference import attention_ref

    def ref():
        qd, kd, vd = (t.detach().double().requires_grad_(direction != "fwd") for t in (q, k, v))
        outs, a, b = [], 0, 0
        for nq, nk in zip(lens_q, lens_k):
            o = attention_ref(qd[None, a:a + nq], kd[None, b:b + nk], vd[None, b:b + nk],
                              causal=causal, **kw)[0]
            outs.append(o[0])
            a, b = a + nq, b + nk
        out = torch.cat(outs)
        if direction == "fwd":
            return out.detach()
        return torch.autograd.grad(out, (qd, kd, vd), dout_of(q, v.shape[-1]).double())
    return ref


# The backward rows' softcap (Gemma 2's attention logit cap).
SOFTCAP = 50.0


def _varlen(ctx):
    g = torch.Generator().manual_seed(0)
    lens = ([int(x) for x in torch.randint(5, 40, (3,), generator=g)] if ctx.cpu else
            [int(x) for x in torch.randint(256, 4097, (12,), generator=g)])
    heads = [(2, 1, 32)] if ctx.cpu else [(16, 16, 128), (16, 4, 128), (32, 32, 64)]
    cu, total, longest = _cu(lens, ctx.device), sum(lens), max(lens)
    for h, h_kv, d in heads:
        q = randn(total, h, d, ctx=ctx, seed=0)
        k = randn(total, h_kv, d, ctx=ctx, seed=1)
        v = randn(total, h_kv, d, ctx=ctx, seed=2)
        for causal in (False, True):
            flops = sum(4.0 * h * d * visible_pairs(n, n, causal) for n in lens)
            calls = {name: _varlen_call(q, k, v, cu, cu, longest, longest, causal, backend)
                     for name, backend in (("solattn", None), ("solattn-hopper", "hopper"),
                                           ("solattn-portable", "portable"))}
            kv = f" Hkv{h_kv}" if h_kv != h else ""
            yield Row(f"{len(lens)} seqs {total} tokens H{h}{kv} D{d}"
                      + (" causal" if causal else ""), calls, work=flops,
                      meta=dict(h=h, h_kv=h_kv, d=d, causal=causal, lens=lens),
                      reference=_reference(q, k, v, lens, lens, causal))
            if h_kv != h and not ctx.cpu:
                continue  # (GQA's backward: the backward suite's rows)
            # The backward with softcap (Gemma 2's): gradients of one recorded forward.
            def attn(q, k, v, causal=causal):
                from solattn import flash_attn_varlen_func

                return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal,
                                              softcap=SOFTCAP)
            calls = {name: (lambda backend=backend, attn=attn, x=Inputs(q, k, v):
                            timed_call(attn, x, "bwd", backend))
                     for name, backend in (("solattn", None), ("solattn-hopper", "hopper"),
                                           ("solattn-portable", "portable"))}
            yield Row(f"{len(lens)} seqs {total} tokens H{h}{kv} D{d}"
                      + (" causal" if causal else "") + f" softcap {SOFTCAP:g}", calls,
                      section="bwd", work=2.5 * flops,
                      meta=dict(h=h, h_kv=h_kv, d=d, causal=causal, lens=lens, softcap=SOFTCAP),
                      reference=_reference(q, k, v, lens, lens, causal, "bwd", softcap=SOFTCAP))


VARLEN = Suite("varlen", "packed batches of mixed lengths (flash_attn_varlen_func): the Hopper "
               "kernels against the portable ones, the forward and the backward with softcap "
               "(TFLOP/s over the visible pairs)",
               ("solattn", "solattn-hopper", "solattn-portable"), _varlen,
               baseline="solattn-portable")


def _paged_pool(k, v, lens_k, cu_k, page: int, device):
    """``(k_pool, v_pool, block_table)``: the keys of each sequence in shuffled pages."""
    need = [-(-n // page) for n in lens_k]
    order = torch.randperm(sum(need), generator=torch.Generator().manual_seed(1)).to(device)
    table = torch.zeros(len(lens_k), max(need), dtype=torch.int32, device=device)
    k_pool = torch.zeros(sum(need), page, *k.shape[1:], device=device, dtype=k.dtype)
    v_pool = torch.zeros_like(k_pool)
    start = 0
    for b, n in enumerate(lens_k):
        pages = order[start:start + need[b]]
        start += need[b]
        table[b, :need[b]] = pages.to(torch.int32)
        pos = torch.arange(n, device=device)
        rows = slice(int(cu_k[b]), int(cu_k[b + 1]))
        k_pool[pages[pos // page], pos % page] = k[rows]
        v_pool[pages[pos // page], pos % page] = v[rows]
    return k_pool, v_pool, table


def _paged(ctx):
    g = torch.Generator().manual_seed(0)
    if ctx.cpu:
        H, H_KV, D, pages = 2, 1, 32, (16,)
        seqs = [(8, 40), (1, 23), (1, 17)]
    else:
        H, H_KV, D, pages = 32, 8, 128, (16, 256)
        seqs = ([(512, int(n) + 512) for n in torch.randint(0, 8192, (6,), generator=g)]
                + [(1, int(n)) for n in torch.randint(1024, 8193, (32,), generator=g)])
    lens_q, lens_k = [s[0] for s in seqs], [s[1] for s in seqs]
    cu_q, cu_k = _cu(lens_q, ctx.device), _cu(lens_k, ctx.device)
    q = randn(sum(lens_q), H, D, ctx=ctx, seed=0)
    k = randn(sum(lens_k), H_KV, D, ctx=ctx, seed=1)
    v = randn(sum(lens_k), H_KV, D, ctx=ctx, seed=2)
    flops = sum(4.0 * H * D * visible_pairs(a, b, True) for a, b in seqs)
    args = (cu_q, cu_k, max(lens_q), max(lens_k), True)
    calls = {"solattn": _varlen_call(q, k, v, *args),
             "solattn-portable": _varlen_call(q, k, v, *args, backend="portable")}
    for page in pages:
        def paged(page=page):
            k_pool, v_pool, table = _paged_pool(k, v, lens_k, cu_k, page, ctx.device)
            return _varlen_call(q, k_pool, v_pool, *args, block_table=table)()
        calls[f"solattn-paged{page}"] = paged
    n_chunks = sum(1 for a in lens_q if a > 1)
    yield Row(f"{n_chunks} prefill chunks + {len(seqs) - n_chunks} decode rows, "
              f"{sum(lens_k)} keys, H{H}/{H_KV} D{D} causal", calls, work=flops,
              meta=dict(h=H, h_kv=H_KV, d=D, causal=True, lens_q=lens_q, lens_k=lens_k),
              reference=_reference(q, k, v, lens_q, lens_k, True))


PAGED_VARLEN = Suite("paged-varlen", "a serving batch (chunked-prefill chunks and decode rows, "
                     "GQA 32/8, D128, causal) read from a paged KV cache (pages of 16 and 256 "
                     "tokens) against the same keys stored contiguously (TFLOP/s)",
                     ("solattn", "solattn-portable", "solattn-paged16", "solattn-paged256"),
                     _paged, baseline="solattn-portable")
