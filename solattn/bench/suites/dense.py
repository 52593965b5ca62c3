"""Dense suites: ``forward`` and ``backward`` (the anchors), ``layer`` (both in one call),
``features`` (Hopper against portable per feature), ``dropout``, ``packed``, ``small-q`` and
``sdpa-mask``."""

from __future__ import annotations

import torch

from ..core import Shape, attn_flops
from ..peers import PEERS
from ..suite import Row, Suite
from .common import dout_of, forced, inputs, needs_cuda, randn, reference, timed_call

# The anchor shapes of BENCHMARKS.md (`make bench`).
FORWARD_SHAPES = [
    Shape(1, 8, 4096, 8192, 128),
    Shape(4, 16, 4096, 4096, 128),
    Shape(4, 16, 4096, 4096, 128, causal=True),
    Shape(1, 16, 16384, 16384, 128),
    Shape(1, 16, 16384, 16384, 128, causal=True),
    Shape(4, 32, 4096, 4096, 64),
    Shape(2, 8, 4096, 4096, 256),
    Shape(1, 32, 8192, 8192, 128, causal=True, h_kv=8),  # a Llama-3 8B layer's GQA
]
BACKWARD_SHAPES = [
    Shape(4, 16, 4096, 4096, 128),
    Shape(4, 16, 4096, 4096, 128, causal=True),
    Shape(4, 32, 4096, 4096, 64),
    Shape(4, 32, 4096, 4096, 64, causal=True),
    Shape(4, 32, 4096, 4096, 64, causal=True, h_kv=4),  # the 1.1B Llama layer's GQA
    Shape(1, 16, 16384, 16384, 128, causal=True),
    Shape(1, 32, 8192, 8192, 128, causal=True, h_kv=8),  # a Llama-3 8B layer's GQA
    Shape(2, 8, 4096, 4096, 256),  # Gemma 2/3's head dim (the forward suite's d=256 row)
    Shape(2, 8, 4096, 4096, 256, causal=True),
]
# Triton's interpreter: odd lengths, GQA, d_v != d, bottom-right causal with s_q != s_k.
CPU_SHAPES = [
    Shape(1, 2, 33, 47, 64, causal=True),
    Shape(2, 4, 40, 40, 32, h_kv=2),
    Shape(1, 2, 17, 17, 40, d_v=24),
]
FORWARD_PEERS = ("solattn-hopper", "solattn-portable", "cudnn", "fa2", "flex", "fa4", "fa3",
                 "flash-attn2")
BACKWARD_PEERS = ("solattn", "solattn-hopper", "solattn-portable", "solattn-determ", "cudnn",
                  "fa2", "fa4", "fa3")


def _peer_call(name: str, shape: Shape, x, direction: str):
    """A builder of peer ``name``'s call in ``direction``. solattn's forced kernels stay
    forced in the backward too."""
    backend = {"solattn-hopper": "hopper", "solattn-portable": "portable",
               "solattn-determ": "hopper"}.get(name)

    def build():
        if backend:
            # solattn's call (solattn-determ's: deterministic=True), forced
            call = PEERS["solattn-determ" if name == "solattn-determ" else "solattn"]
            return timed_call(call.setup(shape, x), x, direction, backend)
        return timed_call(PEERS[name].setup(shape, x), x, direction)

    return build


def _dense_rows(shapes, peers, direction):
    def rows(ctx):
        for shape in (CPU_SHAPES if ctx.cpu else shapes):
            x = inputs(shape, ctx)
            yield Row(shape.label(), {p: _peer_call(p, shape, x, direction) for p in peers},
                      work=attn_flops(shape, direction=direction), section=direction,
                      meta=shape.as_dict(),
                      reference=reference(x, direction, causal=shape.causal))
    return rows


def _quick(shapes, n):
    def rows(ctx):
        return shapes(ctx) if not ctx.quick else list(shapes(ctx))[:n]
    return rows


FORWARD = Suite("forward", "anchor forward shapes: solattn's kernels against cuDNN, FA2-4 and "
                "FlexAttention (TFLOP/s)", FORWARD_PEERS,
                _quick(_dense_rows(FORWARD_SHAPES, FORWARD_PEERS, "fwd"), 3), baseline="cudnn")
BACKWARD = Suite("backward", "anchor backward shapes (gradients of a recorded forward): solattn "
                 "against cuDNN and FA2-4 (TFLOP/s)", BACKWARD_PEERS,
                 _quick(_dense_rows(BACKWARD_SHAPES, BACKWARD_PEERS, "bwd"), 2),
                 baseline="cudnn")
# One attention layer's training work: the backward suite's shapes, forward and backward of one
# call (issue 38's "one layer" target), FLOPs 3.5x the forward's.
LAYER_PEERS = ("solattn", "cudnn", "fa2", "fa4", "fa3")
LAYER = Suite("layer", "one attention layer's forward + backward on the backward suite's shapes: "
              "solattn against cuDNN and FA2-4 (TFLOP/s)", LAYER_PEERS,
              _quick(_dense_rows(BACKWARD_SHAPES, LAYER_PEERS, "fwdbwd"), 2), baseline="cudnn")

# ---- features: the Hopper kernels against the portable ones, per feature --------------------

ALIBI = "alibi"  # (the suite's slopes 2^(-8 i / H))
FEATURES = [  # label, head dim, head dim of V, flash_attn_func keywords
    ("ALiBi", 128, 128, dict(alibi_slopes=ALIBI)),
    ("softcap 30", 128, 128, dict(softcap=30.0)),
    ("window 1024", 128, 128, dict(window_size=(1024, 0))),
    ("", 96, 96, {}),  # the padded head dims: the shape's label names them
    ("", 192, 192, {}),
    ("MLA", 192, 128, {}),
    # (dropout beside a score transform: the Hopper backward's 64-key tile at d=128; no
    # float64 check, the oracle does not draw the kernels' mask: tests/test_hopper_dropout.py)
    ("softcap 30 dropout 0.1", 128, 128, dict(softcap=30.0, dropout_p=0.1)),
    ("ALiBi dropout 0.1", 128, 128, dict(alibi_slopes=ALIBI, dropout_p=0.1)),
]
CPU_FEATURE_DIMS = {96: 48, 128: 64, 192: 80}


def _features(ctx):
    b, h, n = (1, 2, 48) if ctx.cpu else (4, 16, 4096)
    for label, d, dv, kw in FEATURES:
        if ctx.cpu:  # the same code paths at head dims the interpreter runs quickly
            d, dv = CPU_FEATURE_DIMS[d], CPU_FEATURE_DIMS[dv]
        shape = Shape(b, h, n, n, d, causal=True, d_v=dv if dv != d else None)
        x = inputs(shape, ctx)
        kw = dict(kw)
        if kw.get("alibi_slopes") == ALIBI:
            kw["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, h + 1, device=ctx.device)
                                            / h).float()
        ref_kw = dict(causal=True, **kw)

        def attn(q, k, v, kw=kw):
            from solattn import flash_attn_func

            return flash_attn_func(q, k, v, causal=True, **kw)

        for direction in ("fwd", "bwd"):
            calls = {name: (lambda backend=backend, direction=direction:
                            timed_call(attn, x, direction, backend))
                     for name, backend in (("solattn", None), ("solattn-hopper", "hopper"),
                                           ("solattn-portable", "portable"))}
            yield Row(f"{shape.label()} {label}".strip(), calls, section=direction,
                      work=attn_flops(shape, direction=direction), meta=shape.as_dict(),
                      reference=None if "dropout_p" in kw else reference(x, direction,
                                                                          **ref_kw))


FEATURES_SUITE = Suite("features", "the Hopper kernels against the portable ones on ALiBi, "
                       "softcap, a sliding window, head dims 96/192, MLA's 192/128 and dropout "
                       "beside softcap or ALiBi, forward and backward (TFLOP/s)",
                       ("solattn", "solattn-hopper", "solattn-portable"), _features,
                       baseline="solattn-portable")

# ---- dropout --------------------------------------------------------------------------------


def _sdpa_dropout(shape, x, p, direction, ctx):
    def build():
        needs_cuda(ctx)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attn(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p,
                    is_causal=shape.causal)
            return out.transpose(1, 2)

        return timed_call(attn, x, direction)
    return build


def _dropout(ctx):
    shapes = ([Shape(1, 2, 40, 40, 32), Shape(1, 2, 40, 40, 32, causal=True)] if ctx.cpu else
              [Shape(4, 16, 4096, 4096, 128, causal=c) for c in (False, True)]
              + [Shape(4, 32, 4096, 4096, 64, causal=c) for c in (False, True)]
              + [Shape(2, 8, 4096, 4096, 256, causal=c) for c in (False, True)])
    for shape in shapes:
        x = inputs(shape, ctx)
        for direction in ("fwd", "fwdbwd"):
            def ours(p, direction=direction, shape=shape, x=x):
                def attn(q, k, v):
                    from solattn import flash_attn_func

                    return flash_attn_func(q, k, v, p, causal=shape.causal)
                return lambda: timed_call(attn, x, direction)

            yield Row(shape.label(), {"solattn": ours(0.0), "solattn-p0.1": ours(0.1),
                                      "fa2-p0.1": _sdpa_dropout(shape, x, 0.1, direction, ctx)},
                      work=attn_flops(shape, direction=direction), section=direction,
                      meta=shape.as_dict())


DROPOUT = Suite("dropout", "what attention dropout costs: solattn with dropout_p 0 and 0.1 "
                "against SDPA's FLASH backend with 0.1, forward and forward + backward (TFLOP/s)",
                ("solattn", "solattn-p0.1", "fa2-p0.1"), _dropout, baseline="fa2-p0.1")

# ---- packed ---------------------------------------------------------------------------------


def _packed(ctx):
    import solattn

    sizes = [(1, 4, 40, 32)] if ctx.cpu else [(4, 16, 4096, 128), (1, 32, 4096, 64)]
    for b, h, s, d in sizes:
        h_kv = max(1, h // 8) if not ctx.cpu else 2
        for kind in ("qkvpacked", "kvpacked"):
            kvh = h if kind == "qkvpacked" else h_kv
            shape = Shape(b, h, s, s, d, causal=True, h_kv=kvh if kvh != h else None)
            q = randn(b, s, h, d, ctx=ctx, seed=1)
            kv = randn(b, s, 3 if kind == "qkvpacked" else 2, kvh, d, ctx=ctx, seed=2)
            dout = dout_of(kv[:, :, 0] if kind == "qkvpacked" else q, d)

            def packed_call(kind=kind, q=q, kv=kv, dout=dout):
                packed = kv.detach().clone().requires_grad_()
                qq = q.detach().clone().requires_grad_()
                if kind == "qkvpacked":
                    return lambda: torch.autograd.grad(
                        solattn.flash_attn_qkvpacked_func(packed, causal=True), (packed,), dout)
                return lambda: torch.autograd.grad(
                    solattn.flash_attn_kvpacked_func(qq, packed, causal=True), (qq, packed),
                    dout)

            def separate_call(kind=kind, q=q, kv=kv, dout=dout):
                parts = [t.detach().contiguous().requires_grad_() for t in kv.unbind(2)]
                qkv = parts if kind == "qkvpacked" else [q.detach().clone().requires_grad_(),
                                                        *parts]
                return lambda: torch.autograd.grad(
                    solattn.flash_attn_func(*qkv, causal=True), qkv, dout)

            yield Row(f"{shape.label()} {kind}", {"solattn": separate_call,
                                                  "solattn-packed": packed_call},
                      work=attn_flops(shape, direction="fwdbwd"), section="fwdbwd",
                      meta=shape.as_dict())


PACKED = Suite("packed", "the packed variants (qkvpacked, kvpacked) against flash_attn_func on "
               "separate q, k, v, forward + backward (TFLOP/s)", ("solattn", "solattn-packed"),
               _packed, baseline="solattn")

# ---- small-q --------------------------------------------------------------------------------

SMALL_Q_SHAPES = [  # (B, Hq, Hkv, s_q, s_k, D)
    (1, 32, 8, 1, 2048, 128), (1, 32, 8, 1, 8192, 128), (1, 32, 8, 1, 32768, 128),
    (1, 32, 8, 1, 131072, 128), (1, 32, 8, 4, 32768, 128), (1, 32, 8, 16, 32768, 128),
    (1, 32, 8, 64, 32768, 128), (1, 32, 8, 128, 32768, 128), (1, 32, 8, 256, 32768, 128),
    (8, 32, 8, 1, 8192, 128), (64, 32, 8, 1, 2048, 128), (1, 32, 4, 1, 544, 64),
    (1, 32, 4, 1, 8192, 64), (1, 32, 32, 1, 8192, 128), (1, 32, 32, 16, 8192, 128),
    (4, 32, 8, 16, 4096, 128), (1, 8, 8, 1, 32768, 256),
]
CPU_SMALL_Q = [(1, 4, 2, 1, 70, 32), (1, 4, 2, 4, 70, 32)]


def _small_q(ctx):
    import solattn

    for b, hq, hkv, sq, sk, d in (CPU_SMALL_Q if ctx.cpu else SMALL_Q_SHAPES):
        shape = Shape(b, hq, sq, sk, d, causal=True, h_kv=hkv)
        x = inputs(shape, ctx)
        calls = {
            "solattn": lambda x=x: lambda: solattn.flash_attn_func(x.q, x.k, x.v, causal=True),
            "solattn-decode": lambda x=x: lambda: solattn.flash_attn_with_kvcache(
                x.q, x.k, x.v, causal=True),
        }
        yield Row(shape.label(), calls, unit="us", meta=shape.as_dict(),
                  reference=reference(x, "fwd", causal=True))


SMALL_Q = Suite("small-q", "few query rows over many keys: flash_attn_func (the dispatcher's "
                "choice) against the split-KV decode kernel on the same K/V (us per call)",
                ("solattn", "solattn-decode"), _small_q, baseline="solattn")

# ---- sdpa-mask ------------------------------------------------------------------------------


def _masks(B, H, L, S, ctx):
    dev = ctx.device
    lens = torch.tensor([S, 3 * S // 4, S // 2, S // 4], device=dev)[:B]
    pad = (torch.arange(S, device=dev)[None, :] < lens[:, None])[:, None, None, :]
    i = torch.arange(L, device=dev)
    doc = i // max(1, L // 8)
    docm = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    add = torch.zeros(L, S, device=dev, dtype=ctx.dtype).masked_fill(~docm, float("-inf"))
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = torch.rand(B, H, L, S, device=dev, generator=g) > 0.3
    rnd[..., 0] = True
    return {"key padding (B,1,1,S)": pad, "8 causal documents bool (L,S)": docm,
            "8 causal documents additive (L,S)": add, "random 70% (B,H,L,S)": rnd}


def _sdpa_mask(ctx):
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import solattn

    B, H, L, D = (2, 2, 64, 32) if ctx.cpu else (4, 16, 4096, 128)
    q, k, v = (randn(B, H, L, D, ctx=ctx, seed=i) for i in range(3))
    do = randn(B, H, L, D, ctx=ctx, seed=3)
    flops = 4.0 * B * H * L * L * D
    for name, m in _masks(B, H, L, L, ctx).items():
        def ref(m=m):
            mm = m.double() if m.dtype != torch.bool else m
            return sdpa(q.double(), k.double(), v.double(), attn_mask=mm)

        for direction in ("fwd", "fwdbwd"):
            def call(f, m=m, direction=direction):
                def build():
                    if direction == "fwd":
                        def run():
                            with torch.no_grad():
                                return f(q, k, v, attn_mask=m)
                        return run
                    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
                    return lambda: torch.autograd.grad(f(qq, kk, vv, attn_mask=m), (qq, kk, vv),
                                                       do)
                return build

            yield Row(f"B{B} H{H} L{L} D{D} {name}", {"solattn": call(solattn.attention),
                                                      "sdpa": call(sdpa)},
                      work=flops * (3.5 if direction == "fwdbwd" else 1), section=direction,
                      reference=ref if direction == "fwd" else None)


SDPA_MASK = Suite("sdpa-mask", "solattn.attention(attn_mask=...) against torch SDPA with the "
                  "same mask (key padding, documents bool and additive, a random dense mask); "
                  "TFLOP/s over the full S x L work, forward and forward + backward",
                  ("solattn", "sdpa"), _sdpa_mask, baseline="sdpa")

__all__ = ["BACKWARD", "DROPOUT", "FEATURES_SUITE", "FORWARD", "LAYER", "PACKED", "SDPA_MASK",
           "SMALL_Q", "forced"]
