"""Public attention entry points: validation -> normalization -> dispatch.

The flash-attn 2.x API (``flash_attn_func``, ``flash_attn_varlen_func``) and an SDPA-layout
``attention``. Every argument is checked on the host before a kernel is launched; the user's
``(causal, window_size, softcap, alibi_slopes)`` are normalized once into the kernels' constexpr
flags (:func:`solattn.masking.window_params`), and :mod:`solattn.backends` picks the kernel.
"""

from __future__ import annotations

import math

import torch

from solattn import validation as V
from solattn.backends import device_arch, select_forward
from solattn.masking import window_params


def _forward(q, k, v, *, softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, seqused_k=None,
             backend=None):
    """Normalized forward on validated inputs -> ``(out, lse)`` (lse None unless asked)."""
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    has_left, has_right, left, right = window_params(causal, tuple(window_size))
    varlen = cu_seqlens_q is not None
    name = select_forward(q, head_dim=q.shape[-1], head_dim_v=v.shape[-1], varlen=varlen,
                          has_alibi=alibi_slopes is not None, backend=backend)
    kwargs = dict(scale=scale, has_left=has_left, has_right=has_right, left=left, right=right,
                  softcap=float(softcap), alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, seqused_k=seqused_k,
                  return_lse=return_lse)
    if name == "hopper":
        from solattn.kernels.hopper.forward import attn_fwd as hopper_fwd
        return hopper_fwd(q, k, v, **kwargs)
    from solattn.kernels.triton.forward import attn_fwd
    return attn_fwd(q, k, v, arch=device_arch(q.device), **kwargs)


def _check_batched(q, k, v, softmax_scale, window_size, softcap, alibi_slopes):
    V.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    V.check_tensor("k", k, 4, "(batch, seqlen_k, nheads_kv, headdim)")
    V.check_tensor("v", v, 4, "(batch, seqlen_k, nheads_kv, headdim_v)")
    V.check_dtypes(q=q, k=k, v=v)
    dev = V.check_devices(q=q, k=k, v=v)
    b, s_q, h, d = q.shape
    V.check_dim("k", k.shape[0], b, "batch (q.shape[0])")
    V.check_dim("v", v.shape[0], b, "batch (q.shape[0])")
    V.check_dim("v", v.shape[1], k.shape[1], "seqlen_k (k.shape[1])")
    V.check_dim("v", v.shape[2], k.shape[2], "nheads_kv (k.shape[2])")
    V.check_dim("k", k.shape[3], d, "headdim (q.shape[3])")
    V.check_heads(h, k.shape[2])
    V.check_head_dims(q, v)
    V.check_scalars(softmax_scale, window_size, softcap)
    V.check_alibi(alibi_slopes, b, h, dev)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, return_lse=False):
    """Exact attention, flash-attn 2.x compatible.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads, headdim), fp16 or bf16, CUDA (or CPU under TRITON_INTERPRET=1).
    k : (batch, seqlen_k, nheads_kv, headdim); ``nheads % nheads_kv == 0`` (GQA/MQA).
    v : (batch, seqlen_k, nheads_kv, headdim_v); ``headdim_v`` may differ from ``headdim``.
        Head dims up to 256, any size. Any strides.
    softmax_scale : float, default ``1 / sqrt(headdim)``.
    causal : bool. Aligned to the bottom-right corner when ``seqlen_q != seqlen_k``::

            seqlen_q = 2, seqlen_k = 5:      1 1 1 1 0
                                             1 1 1 1 1

    window_size : (left, right), -1 = unbounded. Query ``i`` sees keys ``j`` with
        ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``.
    softcap : float >= 0. If > 0, scores are ``softcap * tanh(scale * q.k / softcap)``.
    alibi_slopes : (nheads,) or (batch, nheads) float32; adds
        ``-slope * |i + seqlen_k - seqlen_q - j|`` to the (capped) score.
    return_lse : also return the log-sum-exp of each row (natural log).

    Returns
    -------
    out : (batch, seqlen_q, nheads, headdim_v), q's dtype. A row that sees no key is 0.
    lse : (batch, nheads, seqlen_q) float32, only with ``return_lse``; ``-inf`` for empty rows.
    """
    _check_batched(q, k, v, softmax_scale, window_size, softcap, alibi_slopes)
    out, lse = _forward(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        return_lse=return_lse)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, return_lse=False):
    """Exact attention over a packed batch of variable-length sequences (flash-attn 2.x).

    Parameters
    ----------
    q : (total_q, nheads, headdim); sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
    k, v : (total_k, nheads_kv, headdim) / (total_k, nheads_kv, headdim_v).
    cu_seqlens_q, cu_seqlens_k : (batch + 1,) int32, non-decreasing, starting at 0. Zero-length
        sequences are allowed.
    max_seqlen_q, max_seqlen_k : int, at least the longest query / key sequence.
    Other arguments as :func:`flash_attn_func`; masks align each sequence's own bottom-right
    corner. ALiBi slopes of shape (batch, nheads) index the batch by sequence.

    Returns
    -------
    out : (total_q, nheads, headdim_v); lse : (nheads, total_q) float32 with ``return_lse``.
    """
    V.check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    V.check_tensor("k", k, 3, "(total_k, nheads_kv, headdim)")
    V.check_tensor("v", v, 3, "(total_k, nheads_kv, headdim_v)")
    V.check_dtypes(q=q, k=k, v=v)
    dev = V.check_devices(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    batch = V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, dev, total=q.shape[0])
    batch_k = V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, dev, total=k.shape[0])
    V.check_dim("cu_seqlens_k", batch_k + 1, batch + 1, "length (len(cu_seqlens_q))")
    V.check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    V.check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    h, d = q.shape[1], q.shape[2]
    V.check_dim("v", v.shape[0], k.shape[0], "total_k (k.shape[0])")
    V.check_dim("v", v.shape[1], k.shape[1], "nheads_kv (k.shape[1])")
    V.check_dim("k", k.shape[2], d, "headdim (q.shape[2])")
    V.check_heads(h, k.shape[1])
    V.check_head_dims(q, v)
    V.check_scalars(softmax_scale, window_size, softcap)
    V.check_alibi(alibi_slopes, batch, h, dev)
    out, lse = _forward(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        return_lse=return_lse, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q)
    return (out, lse) if return_lse else out


def attention(q, k, v, is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (no mask, no dropout).

    Parameters
    ----------
    q : (batch, nheads, seqlen_q, headdim); k, v : (batch, nheads_kv, seqlen_k, headdim[_v]).
    is_causal : as SDPA. Note SDPA aligns causal to the *top-left* corner; for
        ``seqlen_q != seqlen_k`` this function follows SDPA (top-left), unlike flash_attn_func.
    scale : default ``1 / sqrt(headdim)``.
    enable_gqa : allow ``nheads_kv < nheads`` (as SDPA's argument of the same name).

    Returns (batch, nheads, seqlen_q, headdim_v), a view of a (batch, seqlen_q, nheads, d_v)
    buffer (no copies of inputs or output: the kernel reads any strides).
    """
    for name, t, layout in (("q", q, "(batch, nheads, seqlen_q, headdim)"),
                            ("k", k, "(batch, nheads_kv, seqlen_k, headdim)"),
                            ("v", v, "(batch, nheads_kv, seqlen_k, headdim_v)")):
        V.check_tensor(name, t, 4, layout)
    if not enable_gqa and k.shape[1] != q.shape[1]:
        raise ValueError(f"k: expected nheads = {q.shape[1]} (q.shape[1]) without enable_gqa=True, "
                         f"got {k.shape[1]}")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    window = (-1, -1)
    s_q, s_k = q.shape[2], k.shape[2]
    if is_causal and s_q < s_k:
        # SDPA's causal is top-left aligned (query i sees keys j <= i): keys j >= s_q are seen by
        # no query, so drop them (a view) and the problem becomes square.
        kt, vt = kt[:, :s_q], vt[:, :s_q]
    elif is_causal and s_q > s_k:
        # Top-left in bottom-right terms: j <= i + s_k - s_q + right with right = s_q - s_k.
        window, is_causal = (-1, s_q - s_k), False
    out = flash_attn_func(qt, kt, vt, softmax_scale=scale, causal=is_causal, window_size=window)
    return out.transpose(1, 2)
