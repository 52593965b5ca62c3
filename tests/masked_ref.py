"""Oracle for attention with an explicit boolean mask and optional sink logits.

``solattn.reference.attention_ref`` covers the kernels' own mask semantics; the sink tests and the
transformers integration need two things it does not have: a learnable per-head sink column
appended to the score matrix (gpt-oss), and an arbitrary ``(b, 1, s_q, s_k)`` mask such as the one
transformers' ``masking_utils.sdpa_mask`` builds (padding, static-cache slots, windows).
"""

from __future__ import annotations

import math

import torch

from solattn.reference import allowed_mask


def masked_attention_ref(q, k, v, allowed, *, softmax_scale=None, softcap=0.0, sinks=None,
                         upcast=True):
    """Materialized attention under a boolean mask, with optional sinks.

    Parameters
    ----------
    q : (b, s_q, h, d); k, v : (b, s_k, h_kv, d[_v]) with ``h % h_kv == 0``.
    allowed : bool, broadcastable to (b, h, s_q, s_k); True where query i may attend key j.
    softmax_scale, softcap : as :func:`solattn.flash_attn_func`.
    sinks : optional (h,) sink logits: a score column appended to every row (value 0), dropped
        after the softmax.
    upcast : True computes in float64 (the oracle); False in q's dtype (the low-precision twin).

    Returns
    -------
    out : (b, s_q, h, d_v), float64 (``upcast``) or q's dtype; rows with nothing to attend are 0.
    lse : (b, h, s_q), log-sum-exp over the allowed keys and the sink; ``-inf`` for empty rows
        without a sink.
    """
    dtype_in = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
        sinks = sinks.double() if sinks is not None else None
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    h, h_kv = q.shape[2], k.shape[2]
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=2)
        v = v.repeat_interleave(h // h_kv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    allowed = allowed.to(torch.bool).expand_as(s)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks.to(s.dtype).view(1, h, 1, 1).expand(*s.shape[:3], 1)
        s = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(s if upcast else s.float(), dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    else:
        p = p.masked_fill(~allowed.any(-1, keepdim=True), 0.0)  # empty rows: 0, not NaN
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    return (out if upcast else out.to(dtype_in)), lse


def sink_attention_ref(q, k, v, sinks, *, causal=False, window_size=(-1, -1), softmax_scale=None,
                       softcap=0.0, upcast=True):
    """flash-attn semantics (bottom-right causal / window) plus sinks, via
    :func:`masked_attention_ref`."""
    ok = allowed_mask(q.shape[1], k.shape[1], causal, window_size, device=q.device)
    return masked_attention_ref(q, k, v, ok, softmax_scale=softmax_scale, softcap=softcap,
                                sinks=sinks, upcast=upcast)


def sink_attention_varlen_ref(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """Per-sequence :func:`sink_attention_ref` on packed inputs: ``out (t_q, h, d_v)``,
    ``lse (h, t_q)``."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        o, lse = sink_attention_ref(q[cq[b]:cq[b + 1]][None], k[ck[b]:ck[b + 1]][None],
                                    v[ck[b]:ck[b + 1]][None], sinks, **kwargs)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, -1)
