"""The internal entry points under the public API: kernel dispatch -> custom ops -> autograd.

Inputs arrive validated and normalized (:func:`make_params` -> one frozen
:class:`solattn.params.AttnParams`); :mod:`solattn.interface` (flash-attn's API) and the internal
callers (``solattn.distributed``, ``solattn warmup``, benchmarks) enter here. Layers, bottom up
(QuACK's shape):

1. :func:`attn_forward` / :func:`attn_backward`: empty inputs return without a launch, the rest
   run the kernel :mod:`solattn.dispatch` picks;
2. two ``torch.library.custom_op``s, ``solattn::fwd -> (out, lse)`` and
   ``solattn::bwd -> (dq, dk, dv)``, each with a fake (meta) implementation, so
   ``torch.compile(fullgraph=True)`` traces through them without a graph break;
3. ``register_autograd`` on ``solattn::fwd``, whose backward calls ``solattn::bwd``. ``lse`` has a
   correct gradient (it only shifts ``Delta`` in the backward), so losses that use it train too.
   In eager mode the same entry points run under a plain ``torch.autograd.Function`` (the op's
   dispatch is the larger part of the host time of a small call): :func:`attn`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from solattn import validation as V
from solattn.dispatch import run_backward_kernel, run_forward_kernel
from solattn.dropout import draw_seed
from solattn.params import AttnParams, softmax_scale_or_default

# ---------------------------------------------------------------------------------------------
# Internal entry points: the one way (besides the public API) bench, scripts and
# solattn.distributed reach the kernels. Inputs must already be validated.
# ---------------------------------------------------------------------------------------------

def make_params(q, k, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
                out_dtype=None, block_table=None, q_descale=None, k_descale=None,
                v_descale=None) -> AttnParams:
    """Normalize one call's arguments (flash-attn's names and defaults) into :class:`AttnParams`.

    ``q``/``k`` give the head dim (default scale ``1/sqrt(d)``), the GQA group and, without
    ``cu_seqlens``, the sequence lengths: ``(b, s, h, d)``, or packed ``(t, h, d)`` with
    ``cu_seqlens_q/k`` and ``max_seqlen_q/k`` (``k`` a page pool ``(pages, page, h_kv, d)``
    with ``block_table``). ``out_dtype``: the forward's output dtype (None: q's; torch.float32
    for partial outputs that are merged afterwards). With ``dropout_p > 0`` the call's dropout
    seed is drawn here, on q's device (:func:`solattn.dropout.draw_seed`): one draw per call.
    ``q_descale``/``k_descale``/``v_descale``: FP8 inputs' contiguous ``(b, h_kv)`` float32
    descales (None: 1).
    """
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    if cu_seqlens_q is None:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    left, right = window_size
    dropout_p = float(dropout_p)
    return AttnParams(
        scale=scale, causal=bool(causal), window=(int(left), int(right)), softcap=float(softcap),
        alibi_slopes=alibi_slopes, group_size=q.shape[-2] // k.shape[-2],
        deterministic=bool(deterministic), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), seqused_k=seqused_k,
        out_dtype=out_dtype, block_table=block_table, dropout_p=dropout_p,
        dropout_seed=draw_seed(q.device) if dropout_p > 0 else None, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale)


def _no_work(q, k, p: AttnParams) -> bool:
    """No query row or no key at all: the result is fixed (output 0, lse -inf), no launch."""
    if p.varlen:
        return (p.cu_seqlens_q.numel() == 1 or q.shape[0] == 0 or k.shape[0] == 0
                or p.max_seqlen_q == 0 or (p.paged and p.block_table.shape[1] == 0))
    return q.numel() == 0 or k.shape[1] == 0


def attn_forward(q, k, v, p: AttnParams, *, return_lse=True, backend=None):
    """Forward of validated inputs -> ``(out, lse)`` (``lse`` None unless ``return_lse``).

    Shapes as :func:`flash_attn_func` (or packed, with ``p.cu_seqlens_q``); ``lse`` is float32
    ``(b, h, s_q)`` or ``(h, t_q)``. ``backend`` forces ``"portable"`` or ``"hopper"`` (else
    :mod:`solattn.dispatch` picks). Not differentiable: :func:`flash_attn_func` is.
    """
    if _no_work(q, k, p):
        out_dtype = p.out_dtype or (torch.bfloat16 if q.dtype == V.FP8_DTYPE else q.dtype)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=out_dtype)
        if not return_lse:
            return out, None
        shape = (q.shape[1], q.shape[0]) if p.varlen else (q.shape[0], q.shape[2], q.shape[1])
        return out, torch.full(shape, float("-inf"), dtype=torch.float32, device=q.device)
    return run_forward_kernel(q, k, v, p, return_lse=return_lse, backend=backend)


FP8_BACKWARD = "FP8 backward is not supported (float8_e4m3fn inputs: forward only)"


def attn_backward(dout, q, k, v, out, lse, p: AttnParams, *, dlse=None, backend=None,
                  grads=None):
    """Gradients ``(dq, dk, dv)`` of :func:`attn_forward`'s ``out`` (and ``lse``, through
    ``dlse``) for validated inputs; ``out``/``lse`` may be those of a larger problem (ring
    attention passes the global ones: the backward only needs them row by row). ``backend``
    forces ``"portable"`` or ``"hopper"`` (else :mod:`solattn.dispatch` picks).

    ``grads``: optional ``(dq, dk, dv)`` tensors (each may be None) to hold the gradients,
    e.g. views of a packed gradient: the Hopper backward's TMA epilogue stores dK and dV into
    them directly where it runs; every other given gradient is copied in. The returned triple
    holds the given tensors in their places."""
    if q.dtype == V.FP8_DTYPE:
        raise NotImplementedError(FP8_BACKWARD)
    if _no_work(q, k, p):
        result = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    elif p.paged:
        from solattn.paged_kv import paged_backward

        result = paged_backward(dout, q, k, v, out, lse, p, dlse=dlse, backward=attn_backward)
    else:
        result = run_backward_kernel(dout, q, k, v, out, lse, p, dlse=dlse, backend=backend,
                                     grads=grads)
    if grads is None:
        return result
    return tuple(r if g is None or r is g else g.copy_(r) for r, g in zip(result, grads))


# ---------------------------------------------------------------------------------------------
# torch.library ops (torch.compile-traceable) with autograd
# ---------------------------------------------------------------------------------------------

def _op_params(q, k, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dropout_seed, seqused_k,
               block_table, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
               window_right, softcap, deterministic, dropout_p):
    return AttnParams(
        scale=softmax_scale, causal=causal, window=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, group_size=q.shape[-2] // k.shape[-2],
        deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
        block_table=block_table, dropout_p=dropout_p, dropout_seed=dropout_seed)


@torch.library.custom_op("solattn::fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor],
            cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
            dropout_seed: Optional[Tensor], seqused_k: Optional[Tensor],
            block_table: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
            softmax_scale: float, causal: bool, window_left: int, window_right: int,
            softcap: float, deterministic: bool, dropout_p: float) -> tuple[Tensor, Tensor]:
    """Forward on validated inputs -> ``(out, lse)``. The op's scalars are
    :class:`AttnParams`' fields (an op takes tensors and scalars only); ``deterministic`` is
    unused here but saved for the backward (``register_autograd`` sees only the op's inputs).
    ``dropout_seed`` (with ``dropout_p > 0``) is an input, drawn outside the op, so the op is a
    pure function of its inputs and the backward regenerates the same mask from it."""
    p = _op_params(q, k, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dropout_seed, seqused_k,
                   block_table, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                   window_right, softcap, deterministic, dropout_p)
    # Few-row calls may run the decode kernels; their workspace is allocated per call here
    # (per_call_workspaces: a kept one does not survive torch.compile's CUDA graph trees).
    from solattn.kernels.triton.decode import per_call_workspaces

    with per_call_workspaces():
        return attn_forward(q, k, v, p, return_lse=True)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dropout_seed, seqused_k,
              block_table, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
              window_right, softcap, deterministic, dropout_p):
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    if cu_seqlens_q is not None:  # (t_q, h, d) -> lse (h, t_q)
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    else:                         # (b, s_q, h, d) -> lse (b, h, s_q)
        lse = q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    return out, lse


@torch.library.custom_op("solattn::bwd", mutates_args=())
def _bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
            dlse: Optional[Tensor], alibi_slopes: Optional[Tensor],
            cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
            dropout_seed: Optional[Tensor], seqused_k: Optional[Tensor],
            block_table: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
            softmax_scale: float, causal: bool, window_left: int, window_right: int,
            softcap: float, deterministic: bool,
            dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`_fwd_op` (the kernel :mod:`solattn.dispatch`
    picks; paged K/V through :func:`solattn.paged_kv.paged_backward`)."""
    p = _op_params(q, k, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dropout_seed, seqused_k,
                   block_table, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                   window_right, softcap, deterministic, dropout_p)
    return attn_backward(dout, q, k, v, out, lse, p, dlse=dlse)


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
              dropout_seed, seqused_k, block_table, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, softcap, deterministic, dropout_p):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dropout_seed, seqused_k, block_table
_FWD_TENSORS = 9


def _fwd_setup_context(ctx, inputs, output):
    out, lse = output
    q, k, v, *extras = inputs[:_FWD_TENSORS]
    ctx.save_for_backward(q, k, v, out, lse, *extras)
    ctx.scalars = inputs[_FWD_TENSORS:]  # max_seqlen_q ... dropout_p


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, *extras = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, dlse, *extras, *ctx.scalars)
    return (dq, dk, dv) + (None,) * (_FWD_TENSORS - 3 + len(ctx.scalars))


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager-mode autograd over the same entry points as the custom ops (:func:`attn_forward`,
    :func:`attn_backward`): a Python custom op's dispatch costs about 100 us a call (H100,
    torch 2.11), more than the kernel on small problems. ``torch.compile`` traces the ops."""

    @staticmethod
    def forward(ctx, q, k, v, p):
        out, lse = attn_forward(q, k, v, p, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = p
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        return (*attn_backward(dout, q, k, v, out, lse, ctx.params, dlse=dlse), None)


class EagerPackedAttention(torch.autograd.Function):
    """:class:`_EagerAttention` over flash-attn's packed layouts: ``qkv`` (``kv`` None) or
    ``q`` and ``kv``, packed along dim -3. The backward allocates the packed gradient and has
    :func:`attn_backward` fill its views: the Hopper backward stores dK and dV there itself,
    so only dQ (or nothing, for ``kv``) is copied, where autograd through ``unbind`` would
    stack all three gradients."""

    @staticmethod
    def forward(ctx, first, kv, p):
        q, k, v = first.unbind(-3) if kv is None else (first, *kv.unbind(-3))
        out, lse = attn_forward(q, k, v, p, return_lse=True)
        ctx.save_for_backward(first, kv, out, lse)
        ctx.params = p
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        first, kv, out, lse = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        if kv is None:
            dqkv = torch.empty_like(first)
            attn_backward(dout, *first.unbind(-3), out, lse, ctx.params, dlse=dlse,
                          grads=dqkv.unbind(-3))
            return dqkv, None, None
        dkv = torch.empty_like(kv)
        dq, _, _ = attn_backward(dout, first, *kv.unbind(-3), out, lse, ctx.params, dlse=dlse,
                                 grads=(None, *dkv.unbind(-3)))
        return dq, dkv, None


def attn(q, k, v, p: AttnParams):
    """Validated inputs and their :class:`AttnParams` -> ``(out, lse)``, differentiable: the
    custom op while ``torch.compile`` traces, else the eager autograd function, or no autograd
    at all when no input requires a gradient."""
    if torch.compiler.is_compiling():
        left, right = p.window
        return _fwd_op(q, k, v, p.alibi_slopes, p.cu_seqlens_q, p.cu_seqlens_k, p.dropout_seed,
                       p.seqused_k, p.block_table, p.max_seqlen_q, p.max_seqlen_k, p.scale,
                       p.causal, left, right, p.softcap, p.deterministic, p.dropout_p)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(q, k, v, p)
    return attn_forward(q, k, v, p, return_lse=True)
