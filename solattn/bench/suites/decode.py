"""``decode``: one KV-cache decode step (``flash_attn_with_kvcache``; contiguous and paged
caches) against SDPA's cuDNN and FLASH backends, GB/s of K and V read, beside the HBM read
ceiling measured in the same run (CUDA-graph replays: microsecond calls)."""

from __future__ import annotations

import torch

from ..peers import DECODE_PEERS, PeerUnavailable
from ..suite import Row, Suite
from .common import randn

# (batch, h_q, h_kv, cache length, head dim): the decode anchors.
DECODE_SHAPES = [(64, 32, 8, 4096, 128), (8, 32, 8, 32768, 128)]
# Batch-1 decoding of long caches (s_q 1 only; not with --quick): the split-KV launch's regime.
LONG_DECODE_SHAPES = [(1, 32, 8, n, 128) for n in (32768, 65536, 131072, 262144)]
CPU_DECODE_SHAPES = [(2, 4, 2, 256, 32)]  # one page of 256 per sequence


def _call(name, q, kc, vc, seqlens, ctx):
    def build():
        if ctx.cpu and not name.startswith("solattn"):
            raise PeerUnavailable("needs a CUDA GPU")
        fn = DECODE_PEERS[name](q, kc, vc, seqlens)
        if fn is None:
            raise PeerUnavailable("does not run this shape")
        return fn
    return build


def _rows(ctx):
    from solattn.reference import attention_ref

    shapes = CPU_DECODE_SHAPES if ctx.cpu else DECODE_SHAPES + (
        [] if ctx.quick else LONG_DECODE_SHAPES)
    for b, h, h_kv, L, d in shapes:
        kc = randn(b, L, h_kv, d, ctx=ctx, seed=1)
        vc = randn(b, L, h_kv, d, ctx=ctx, seed=2)
        seqlens = torch.full((b,), L, dtype=torch.int32, device=ctx.device)
        nbytes = 2 * kc.numel() * kc.element_size()
        for s_q in (1,) if ctx.quick or b == 1 else (1, 4):
            q = randn(b, s_q, h, d, ctx=ctx, seed=0)
            yield Row(f"B{b} Hq{h} Hkv{h_kv} L{L} D{d} s_q{s_q}",
                      {n: _call(n, q, kc, vc, seqlens, ctx) for n in DECODE_PEERS},
                      work=nbytes, unit="GB/s", section="decode", timer="graph",
                      meta=dict(b=b, h=h, h_kv=h_kv, s_q=s_q, s_k=L, d=d),
                      reference=lambda q=q, kc=kc, vc=vc: attention_ref(
                          q.double(), kc.double(), vc.double(), causal=True)[0])


def read_ceiling(ctx, res, out=print):
    """The read ceiling the decode rows are a fraction of (same run)."""
    if ctx.cpu:
        return
    from ..core import read_gbps

    ceiling = read_gbps()
    res.set("read_ceiling_gbps", ceiling)
    ctx.peaks["GB/s"] = ceiling
    out(f"HBM read ceiling (bf16 sum over 1 GiB): {ceiling:.0f} GB/s")


DECODE = Suite("decode", "one decode step over a KV cache (contiguous, pages of 16 and 256 "
               "tokens) against SDPA's cuDNN and FLASH backends (GB/s of K and V read)",
               tuple(DECODE_PEERS), _rows, baseline="cudnn", before=read_ceiling)
