"""Registry of forward implementations timed side by side: ``setup(shape, inputs) -> fn or None``.

A peer returns None when it cannot run the shape (missing package, unsupported feature); the
table then shows "-". Every peer gets the same inputs (flash-attn layout) and converts views only.
"""

from __future__ import annotations

import torch

from solattn.bench.core import Inputs, Shape


def run_solattn(shape: Shape, x: Inputs, backend: str):
    """solattn's forward with one backend forced (plain attention, no lse): ``out``."""
    from solattn.interface import _forward

    return _forward(
        x.q,
        x.k,
        x.v,
        softmax_scale=None,
        causal=shape.causal,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        return_lse=False,
        backend=backend,
    )[0]


def _solattn(backend: str):
    def setup(shape: Shape, x: Inputs):
        from solattn.backends import select_forward

        try:
            picked = select_forward(
                x.q,
                head_dim=shape.d,
                head_dim_v=shape.dv,
                varlen=False,
                has_alibi=False,
                backend=backend,
            )
        except NotImplementedError:
            return None
        if picked != backend:
            return None

        return lambda: run_solattn(shape, x, backend)

    return setup


def _if_runs(fn, errors=(RuntimeError,)):
    """``fn`` if one call of it succeeds (the peer supports this shape), else None."""
    try:
        fn()
    except errors:
        return None
    return fn


def _sdpa(backend_name: str):
    def setup(shape: Shape, x: Inputs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
        gqa = shape.kv_heads != shape.h
        if shape.causal and shape.s_q != shape.s_k:
            return None  # SDPA's causal is top-left aligned: a different problem

        def fn():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=shape.causal, enable_gqa=gqa
                )

        return _if_runs(fn)

    return setup


def _flex(shape: Shape, x: Inputs):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
    block_mask = None
    if shape.causal:
        off = shape.s_k - shape.s_q

        def causal(b, h, i, j):
            return j <= i + off

        block_mask = create_block_mask(causal, None, None, shape.s_q, shape.s_k, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    gqa = shape.kv_heads != shape.h

    def fn():
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    return _if_runs(fn, Exception)  # a peer that cannot compile this shape is skipped


def _fa4(shape: Shape, x: Inputs):
    """FlashAttention-4 (CuTe DSL) when installed beside us (see CONTRIBUTING.md)."""
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4
    except Exception:  # noqa: BLE001 - not installed, or its DSL runtime is missing
        return None

    def fn():
        out = fa4(x.q, x.k, x.v, causal=shape.causal)
        return out[0] if isinstance(out, tuple) else out

    return _if_runs(fn, Exception)


# name -> setup. Order is the table's column order.
FORWARD_PEERS = {
    "solattn-hopper": _solattn("hopper"),
    "solattn-portable": _solattn("portable"),
    "cudnn": _sdpa("CUDNN_ATTENTION"),
    "fa2": _sdpa("FLASH_ATTENTION"),
    "flex": _flex,
    "fa4": _fa4,
}


# ---- backward: ``setup(shape, inputs) -> fn`` where fn runs the backward only -------------------


def _grad_fn(out, inputs, dout):
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def _solattn_bwd(shape: Shape, x: Inputs):
    from solattn import flash_attn_func

    q, k, v = (t.detach().requires_grad_() for t in (x.q, x.k, x.v))
    out = flash_attn_func(q, k, v, causal=shape.causal)
    return _grad_fn(out, (q, k, v), torch.randn_like(out))


def _sdpa_bwd(backend_name: str):
    def setup(shape: Shape, x: Inputs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if shape.causal and shape.s_q != shape.s_k:
            return None
        q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (x.q, x.k, x.v))
        try:
            with sdpa_kernel(getattr(SDPBackend, backend_name)):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=shape.causal, enable_gqa=shape.kv_heads != shape.h
                )
        except RuntimeError:
            return None
        return _grad_fn(out, (q, k, v), torch.randn_like(out))

    return setup


BACKWARD_PEERS = {
    "solattn": _solattn_bwd,
    "cudnn": _sdpa_bwd("CUDNN_ATTENTION"),
    "fa2": _sdpa_bwd("FLASH_ATTENTION"),
}


# ---- decode: ``setup(q, k_cache, v_cache, seqlens) -> fn`` (one step, s_q = q.shape[1]) --------


def _solattn_decode(page_size: int | None):
    def setup(q, kc, vc, seqlens):
        from solattn import flash_attn_with_kvcache

        table = None
        if page_size:
            b, L, h_kv, d = kc.shape
            n = b * L // page_size
            perm = torch.randperm(n, device=kc.device)  # pages in allocation order, shuffled
            pk = torch.empty(n, page_size, h_kv, d, dtype=kc.dtype, device=kc.device)
            pv = torch.empty_like(pk)
            pk[perm] = kc.reshape(n, page_size, h_kv, d)
            pv[perm] = vc.reshape(n, page_size, h_kv, d)
            kc, vc, table = pk, pv, perm.view(b, L // page_size).to(torch.int32)
        return lambda: flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=True
        )

    return setup


def _sdpa_decode(backend_name: str):
    def setup(q, kc, vc, seqlens):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if q.shape[1] != 1:
            return None  # SDPA's causal is top-left aligned: not a KV-cache mask
        qt, kt, vt = (t.transpose(1, 2) for t in (q, kc, vc))
        backend = getattr(SDPBackend, backend_name)

        def fn():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        return _if_runs(fn)

    return setup


DECODE_PEERS = {
    "solattn": _solattn_decode(None),
    "solattn-paged16": _solattn_decode(16),
    "solattn-paged256": _solattn_decode(256),
    "cudnn": _sdpa_decode("CUDNN_ATTENTION"),
    "fa2": _sdpa_decode("FLASH_ATTENTION"),
}
