"""Helpers the suites share: seeded inputs, solattn calls under a forced kernel, the float64
reference of a dense call and of its gradients."""

from __future__ import annotations

import contextlib
import functools

import torch

from ..core import Inputs, Shape, make_inputs
from ..peers import PeerUnavailable


def forced(backend: str | None):
    """``forced_backend(backend)`` of the dispatcher (a no-op context for None)."""
    if backend is None:
        return contextlib.nullcontext()
    return _forced_backend()(backend)


@functools.cache
def _forced_backend():
    """The imported solattn's ``forced_backend``, found once (timed calls enter :func:`forced`
    on every run): ``solattn.dispatch``'s, or in trees from before that module, timed by
    `--trees`, ``solattn.backends``'."""
    import importlib
    import os

    import solattn

    here = os.path.dirname(os.path.abspath(solattn.__file__))
    name = "dispatch" if os.path.exists(os.path.join(here, "dispatch.py")) else "backends"
    return importlib.import_module(f"solattn.{name}").forced_backend


def needs_cuda(ctx) -> None:
    if ctx.cpu:
        raise PeerUnavailable("needs a CUDA GPU")


def randn(*shape, ctx, seed: int = 0, dtype=None, grad: bool = False) -> torch.Tensor:
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    t = torch.randn(*shape, generator=g, device=ctx.device, dtype=dtype or ctx.dtype)
    return t.requires_grad_(grad)


def inputs(shape: Shape, ctx) -> Inputs:
    return make_inputs(shape, dtype=ctx.dtype, device=ctx.device)


def dout_of(q: torch.Tensor, d_v: int) -> torch.Tensor:
    """The output gradient :func:`solattn.bench.core.direction_fn` uses (seed 1)."""
    g = torch.Generator(device=q.device).manual_seed(1)
    return torch.randn(*q.shape[:-1], d_v, generator=g, device=q.device, dtype=q.dtype)


def timed_call(attn, x: Inputs, direction: str, backend: str | None = None):
    """The no-argument callable that runs ``attn(q, k, v)`` in ``direction`` (``fwd`` without
    autograd, ``bwd`` the gradients of one recorded forward, ``fwdbwd`` both), the whole call
    -- the backward included -- under ``forced_backend(backend)``."""
    from ..core import direction_fn

    with forced(backend):
        fn = direction_fn(attn, x, direction)
    if backend is None:
        return fn

    def run():
        with forced(backend):
            return fn()

    return run


def reference(x: Inputs, direction: str, **kw):
    """The float64 output (``fwd``) or dQ (``bwd``, ``fwdbwd``) of :func:`attention_ref` on
    ``x`` with the output gradient of :func:`dout_of`."""
    from solattn.reference import attention_ref

    def ref():
        q, k, v = (t.detach().double().requires_grad_() for t in (x.q, x.k, x.v))
        out = attention_ref(q, k, v, **kw)[0]
        if direction == "fwd":
            return out
        return torch.autograd.grad(out, (q, k, v), dout_of(x.q, x.v.shape[-1]).double())

    return ref
