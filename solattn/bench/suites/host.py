"""``host``: host (CPU) time per call of the public API on tiny shapes, where the GPU work is a
few microseconds: N calls back to back, synchronized at both ends, the median of blocks (the
Python and launch overhead a user pays as long as the GPU keeps up). SDPA's FLASH and cuDNN
backends on the same problems; a document-masked FlexAttention call against torch's compiled
flex_attention."""

from __future__ import annotations

import torch

from ..peers import PeerUnavailable, flex_compiled
from ..suite import Row, Suite
from .common import needs_cuda, randn


def _sdpa(backend_name, ctx, *args, **kw):
    def build():
        needs_cuda(ctx)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(*args, **kw)
        return run
    return build


def _rows(ctx):
    import solattn

    B, L, H, D = 1, 128, 8, 64
    q, k, v = (randn(B, L, H, D, ctx=ctx, seed=i) for i in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    g = randn(B, L, H, D, ctx=ctx, seed=3)
    for causal in (True, False):
        tag = "causal" if causal else "full"
        yield Row(f"B{B} L{L} H{H} D{D} {tag}", {
            "solattn": lambda c=causal: lambda: solattn.flash_attn_func(q, k, v, causal=c),
            "fa2": _sdpa("FLASH_ATTENTION", ctx, qt, kt, vt, is_causal=causal),
            "cudnn": _sdpa("CUDNN_ATTENTION", ctx, qt, kt, vt, is_causal=causal)},
            unit="us", timer="host", section="fwd")

        def fwdbwd(fn):
            def build():
                qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
                return lambda: fn(qq, kk, vv).backward(g)
            return build

        def sdpa_fwdbwd(name, c=causal):
            inner = _sdpa(name, ctx)

            def build():
                inner()  # needs a GPU
                from torch.nn.attention import SDPBackend, sdpa_kernel

                def attn(q, k, v):
                    with sdpa_kernel(getattr(SDPBackend, name)):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            is_causal=c).transpose(1, 2)
                return fwdbwd(attn)()
            return build

        yield Row(f"B{B} L{L} H{H} D{D} {tag}", {
            "solattn": fwdbwd(lambda q, k, v, c=causal: solattn.flash_attn_func(q, k, v,
                                                                                 causal=c)),
            "fa2": sdpa_fwdbwd("FLASH_ATTENTION"), "cudnn": sdpa_fwdbwd("CUDNN_ATTENTION")},
            unit="us", timer="host", section="fwdbwd")
        if causal:  # the backward on the calling thread (torch runs it on its device thread)
            def single_thread(build):
                def wrapped():
                    fn = build()

                    def run():
                        with torch.autograd.set_multithreading_enabled(False):
                            return fn()
                    return run
                return wrapped

            yield Row(f"B{B} L{L} H{H} D{D} {tag} autograd single-threaded", {
                "solattn": single_thread(fwdbwd(
                    lambda q, k, v: solattn.flash_attn_func(q, k, v, causal=True))),
                "fa2": single_thread(sdpa_fwdbwd("FLASH_ATTENTION")),
                "cudnn": single_thread(sdpa_fwdbwd("CUDNN_ATTENTION"))},
                unit="us", timer="host", section="fwdbwd")
    # a decode step: one new token appended to a 4096-token cache
    Lc = 64 if ctx.cpu else 4096
    kc, vc = (randn(1, Lc + 8, 8, 128, ctx=ctx, seed=i) for i in (4, 5))
    qd = randn(1, 1, 32, 128, ctx=ctx, seed=6)
    kn, vn = (randn(1, 1, 8, 128, ctx=ctx, seed=i) for i in (7, 8))
    lens = torch.full((1,), Lc, dtype=torch.int32, device=ctx.device)
    yield Row(f"decode step B1 Hq32 Hkv8 D128 L{Lc}", {
        "solattn": lambda: lambda: solattn.flash_attn_with_kvcache(
            qd, kc, vc, cache_seqlens=lens, causal=True),
        "fa2": _sdpa("FLASH_ATTENTION", ctx, qd.transpose(1, 2), kc[:, :Lc].transpose(1, 2),
                     vc[:, :Lc].transpose(1, 2), enable_gqa=True),
        "cudnn": _sdpa("CUDNN_ATTENTION", ctx, qd.transpose(1, 2), kc[:, :Lc].transpose(1, 2),
                       vc[:, :Lc].transpose(1, 2), enable_gqa=True)},
        unit="us", timer="host", section="decode")
    # the cache stays at Lc: every call appends at the same position
    yield Row(f"decode step B1 Hq32 Hkv8 D128 L{Lc} (append)", {
        "solattn": lambda: lambda: solattn.flash_attn_with_kvcache(
            qd, kc, vc, kn, vn, cache_seqlens=lens, causal=True),
        "fa2": _sdpa("FLASH_ATTENTION", ctx, qd.transpose(1, 2), kc[:, :Lc].transpose(1, 2),
                     vc[:, :Lc].transpose(1, 2), enable_gqa=True),
        "cudnn": _sdpa("CUDNN_ATTENTION", ctx, qd.transpose(1, 2), kc[:, :Lc].transpose(1, 2),
                       vc[:, :Lc].transpose(1, 2), enable_gqa=True)},
        unit="us", timer="host", section="decode")
    # FlexAttention with a document mask
    from solattn.flex import create_block_mask, flex_attention
    from solattn.flex import examples as ex

    ids = (torch.arange(L, device=ctx.device) // 32).to(torch.int32)
    mask = ex.document_causal(ids)
    bm = create_block_mask(mask, None, None, L, L, device=ctx.device,
                           **({"BLOCK_SIZE": 32} if ctx.cpu else {}))

    def torch_flex():
        needs_cuda(ctx)
        try:
            from torch.nn.attention.flex_attention import create_block_mask as tcbm
        except ImportError as exc:
            raise PeerUnavailable(f"torch has no flex_attention ({exc})") from exc
        tbm = tcbm(mask, None, None, L, L, device=ctx.device)
        compiled = flex_compiled()
        return lambda: compiled(qt, kt, vt, block_mask=tbm)

    def flex_grad(fn, backward: bool):
        def build():
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (qt, kt, vt))
            if not backward:
                return lambda: fn(qq, kk, vv)
            gt = g.transpose(1, 2)
            return lambda: torch.autograd.grad(fn(qq, kk, vv), (qq, kk, vv), gt)
        return build

    def torch_flex_grad(backward: bool):
        def build():
            fn = torch_flex()  # needs a GPU and torch's flex_attention
            del fn
            from torch.nn.attention.flex_attention import create_block_mask as tcbm

            tbm = tcbm(mask, None, None, L, L, device=ctx.device)
            compiled = flex_compiled()
            return flex_grad(lambda q, k, v: compiled(q, k, v, block_mask=tbm), backward)()
        return build

    def ours(q, k, v):
        return flex_attention(q, k, v, block_mask=bm)

    yield Row(f"flex B{B} L{L} H{H} D{D} documents", {
        "solattn": lambda: lambda: flex_attention(qt, kt, vt, block_mask=bm),
        "flex": torch_flex}, unit="us", timer="host", section="fwd")
    yield Row(f"flex B{B} L{L} H{H} D{D} documents, inputs require grad", {
        "solattn": flex_grad(ours, False), "flex": torch_flex_grad(False)},
        unit="us", timer="host", section="fwd")
    yield Row(f"flex B{B} L{L} H{H} D{D} documents", {
        "solattn": flex_grad(ours, True), "flex": torch_flex_grad(True)},
        unit="us", timer="host", section="fwdbwd")


HOST = Suite("host", "host (CPU) time per call on tiny shapes: flash_attn_func forward and "
             "forward + backward, a decode step, a FlexAttention call, against SDPA and torch's "
             "compiled flex_attention (us per call)", ("solattn", "fa2", "cudnn", "flex"), _rows,
             baseline="cudnn")
