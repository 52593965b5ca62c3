"""Registry of the attention implementations timed side by side.

A :class:`Peer`'s ``setup(shape, inputs)`` returns ``attn(q, k, v) -> out``: flash-attn layout in
and out (``(b, s, h, d)``; peers that want another layout convert views only), differentiable
when the peer has a backward. It raises :class:`PeerUnavailable` with a reason when it cannot run
the shape (package missing, feature unsupported); a call that fails later (an unsupported head
dim found at the first launch) is reported by the caller the same way. Every peer gets the same
inputs. solattn itself is called through the public API, a kernel forced with
:func:`solattn.dispatch.forced_backend`.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from .core import DIRECTIONS, Inputs, Shape


class PeerUnavailable(Exception):
    """The peer cannot run this shape here; the message says why."""


@dataclass(frozen=True)
class Peer:
    """One implementation. ``compile_s`` / ``compile_per`` only feed the sweep's up-front time
    estimate: rough seconds per compilation on an H100 host with cold caches, and what a
    compilation is keyed on (``"shape"``: every shape, ``"config"``: head dim, causal, grad)."""

    name: str
    setup: object
    directions: tuple = DIRECTIONS
    doc: str = ""
    compile_s: float = 0.0
    compile_per: str = "config"


def _needs_cuda(x: Inputs) -> None:
    if x.q.device.type != "cuda":
        raise PeerUnavailable("needs a CUDA device")


def _solattn(backend: str | None, deterministic: bool = False):
    def setup(shape: Shape, x: Inputs):
        from solattn import flash_attn_func
        from solattn.dispatch import forced_backend

        if backend is None:
            return lambda q, k, v: flash_attn_func(q, k, v, causal=shape.causal,
                                                   deterministic=deterministic)

        def attn(q, k, v):
            with forced_backend(backend):  # NotImplementedError when it cannot run the call
                return flash_attn_func(q, k, v, causal=shape.causal,
                                       deterministic=deterministic)

        return attn

    return setup


def _sdpa(backend_name: str):
    def setup(shape: Shape, x: Inputs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        _needs_cuda(x)
        if shape.causal and shape.s_q != shape.s_k:
            raise PeerUnavailable("SDPA's causal mask is top-left aligned: a different problem")
        backend = getattr(SDPBackend, backend_name)
        gqa = shape.kv_heads != shape.h

        def attn(q, k, v):
            with sdpa_kernel(backend), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "kernel not used because ..." before raising
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    is_causal=shape.causal, enable_gqa=gqa)
            return out.transpose(1, 2)

        return attn

    return setup


@functools.lru_cache(maxsize=None)
def _flex_compiled():
    """One ``torch.compile(flex_attention)`` for the process (public name: :func:`flex_compiled`).
    A sweep compiles it for dozens of shapes: dynamo's recompile limit (8) would silently fall
    back to the eager (materializing) flex_attention after the eighth, so the limits are
    raised."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    for name, value in (("recompile_limit", 4096), ("cache_size_limit", 4096),
                        ("accumulated_recompile_limit", 65536),
                        ("accumulated_cache_size_limit", 65536)):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), value))
    # a score_mod's Python-float constant (softcap's cap) stays a constant: torch 2.11's flex
    # cannot compile it as a symbol
    if hasattr(cfg, "specialize_float"):
        cfg.specialize_float = True
    # the backward is timed as repeated autograd.grad(retain_graph=True) over one recorded
    # forward, which a compiled backward with donated buffers refuses
    functorch_cfg = getattr(getattr(torch, "_functorch", None), "config", None)
    if functorch_cfg is not None and hasattr(functorch_cfg, "donated_buffer"):
        functorch_cfg.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


def flex_compiled():
    """torch's ``flex_attention`` compiled once for the process (see :func:`_flex_compiled`)."""
    return _flex_compiled()


def _flex(shape: Shape, x: Inputs):
    _needs_cuda(x)
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as exc:
        raise PeerUnavailable(f"torch has no flex_attention ({exc})") from exc
    compiled = _flex_compiled()
    block_mask = None
    if shape.causal:
        off = shape.s_k - shape.s_q

        def causal(b, h, i, j):
            return j <= i + off  # bottom-right aligned, as flash-attn

        block_mask = create_block_mask(causal, None, None, shape.s_q, shape.s_k,
                                       device=x.q.device)
    gqa = shape.kv_heads != shape.h

    def attn(q, k, v):
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       block_mask=block_mask, enable_gqa=gqa)
        return out.transpose(1, 2)

    return attn


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _fa4(shape: Shape, x: Inputs):
    """FlashAttention-4 (CuTe DSL) when installed beside us (see CONTRIBUTING.md)."""
    _needs_cuda(x)
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4
    except Exception as exc:  # noqa: BLE001 - not installed, or its DSL runtime is missing
        raise PeerUnavailable(f"flash_attn.cute not importable ({type(exc).__name__})") from exc
    return lambda q, k, v: _first(fa4(q, k, v, causal=shape.causal))


def _fa3(shape: Shape, x: Inputs):
    """FlashAttention-3 (the ``hopper/`` build of flash-attn: module ``flash_attn_interface``)."""
    _needs_cuda(x)
    try:
        from flash_attn_interface import flash_attn_func as fa3
    except Exception as exc:  # noqa: BLE001
        raise PeerUnavailable(f"flash_attn_interface not importable ({type(exc).__name__})") \
            from exc
    return lambda q, k, v: _first(fa3(q, k, v, causal=shape.causal))


def _flash_attn2(shape: Shape, x: Inputs):
    """The flash-attn 2.x package itself (SDPA's FLASH_ATTENTION backend is the ``fa2`` peer)."""
    _needs_cuda(x)
    try:
        import flash_attn
        from flash_attn import flash_attn_func as fa2
    except Exception as exc:  # noqa: BLE001
        raise PeerUnavailable(f"flash_attn 2.x not importable ({type(exc).__name__})") from exc
    if not str(getattr(flash_attn, "__version__", "")).startswith("2."):
        raise PeerUnavailable(f"flash_attn {getattr(flash_attn, '__version__', '?')} is not 2.x")
    return lambda q, k, v: _first(fa2(q, k, v, causal=shape.causal))


# name -> Peer, in the tables' column order.
PEERS = {p.name: p for p in [
    Peer("solattn", _solattn(None), doc="public API, default dispatch (Hopper forward on sm_90)",
         compile_s=15.0),
    Peer("solattn-hopper", _solattn("hopper"), ("fwd",), "Gluon sm_90 forward, forced",
         compile_s=20.0),
    Peer("solattn-portable", _solattn("portable"), ("fwd",), "portable Triton forward, forced",
         compile_s=10.0),
    Peer("solattn-determ", _solattn(None, deterministic=True), ("bwd", "fwdbwd"),
         "deterministic=True, the Gluon sm_90 kernels forced (backward suite)", compile_s=20.0),
    Peer("cudnn", _sdpa("CUDNN_ATTENTION"), doc="torch SDPA, CUDNN_ATTENTION backend"),
    Peer("fa2", _sdpa("FLASH_ATTENTION"), doc="torch SDPA, FLASH_ATTENTION backend (FA2)"),
    Peer("flex", _flex, doc="torch.compile(flex_attention, dynamic=False)", compile_s=8.0,
         compile_per="shape"),
    Peer("fa4", _fa4, doc="flash_attn.cute (FlashAttention-4, CuTe DSL)", compile_s=20.0),
    Peer("fa3", _fa3, doc="flash_attn_interface (FlashAttention-3)"),
    Peer("flash-attn2", _flash_attn2, doc="flash_attn 2.x package"),
]}

# The default `solattn bench` tables (the anchors of BENCHMARKS.md).
FORWARD_DEFAULT = ["solattn-hopper", "solattn-portable", "cudnn", "fa2", "flex", "fa4", "fa3",
                   "flash-attn2"]
BACKWARD_DEFAULT = ["solattn", "cudnn", "fa2"]
SWEEP_DEFAULT = ["solattn", "solattn-portable", "cudnn", "fa2", "flex", "fa4", "fa3",
                 "flash-attn2"]


# ---- decode: ``setup(q, k_cache, v_cache, seqlens) -> fn`` (one step, s_q = q.shape[1]) --------


def _if_runs(fn, errors=(RuntimeError,)):
    """``fn`` if one call of it succeeds (the peer supports this shape), else None."""
    try:
        fn()
    except errors:
        return None
    return fn


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
