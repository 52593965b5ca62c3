"""Reference attention in plain PyTorch: the test oracle, and the seeds' tiled algorithm.

* :func:`attention_ref` materializes the full score matrix with exactly solattn's semantics
  (flash-attn 2.x): scale, softcap, ALiBi, bottom-right-aligned causal/window masks, GQA/MQA,
  ``d_v != d_qk``; rows with no allowed key give output 0 and ``lse = -inf``. Run it in float64
  (``upcast=True``) for the oracle, or in the input dtype (``upcast=False``) for the "what does
  PyTorch itself lose in this precision" twin that the tolerance rule compares against.
* :func:`attention_tiled` is the FlashAttention algorithm written block by block (see its
  docstring); tests check it against :func:`attention_ref`.
* :func:`attention_varlen_ref` runs the oracle on each sequence of a packed varlen batch.
* :func:`masked_attention_ref` is their core, under an arbitrary boolean mask (and attention
  sinks, and a given dropout mask); the transformers backend's tests use it directly.

Layout is flash-attn's: ``q (b, s_q, h, d)``, ``k (b, s_k, h_kv, d)``, ``v (b, s_k, h_kv, d_v)``.
"""

from __future__ import annotations

import math

import torch


def allowed_mask(
    seqlen_q: int, seqlen_k: int, causal: bool, window_size: tuple[int, int], device=None
) -> torch.Tensor:
    """Boolean ``(s_q, s_k)``: True where query ``i`` may attend key ``j`` (bottom-right aligned).

    Written independently of :mod:`solattn.masking` on purpose: it is the oracle.
    """
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def _alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, dtype) -> torch.Tensor:
    """``-slope * |i + s_k - s_q - j|`` of shape ``(b or 1, h, s_q, s_k)``."""
    i = torch.arange(seqlen_q, device=slopes.device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=slopes.device)[None, :]
    dist = (i - j).abs().to(dtype)
    if slopes.dim() == 1:
        slopes = slopes[None]
    return -slopes.to(dtype)[:, :, None, None] * dist


def masked_attention_ref(q, k, v, allowed, *, softmax_scale=None, softcap=0.0, bias=None,
                         sinks=None, dropout_mask=None, dropout_p=0.0, upcast=True):
    """Materialized attention under an arbitrary boolean mask: the core of every oracle here.

    ``allowed`` is bool, broadcastable to ``(b, h, s_q, s_k)``: True where query ``i`` may
    attend key ``j`` (e.g. transformers' padding / static-cache masks). ``bias`` (broadcastable
    to the scores, e.g. ALiBi) is added after the softcap. ``sinks`` (h,): a score column
    appended to every row (value 0) and dropped after the softmax (gpt-oss attention sinks).
    ``dropout_mask`` (bool, ``(b, h, s_q, s_k)``): attention dropout with a given mask, True =
    kept; kept probabilities are scaled by ``1 / (1 - dropout_p)`` (the LSE is undropped).
    Returns ``(out (b, s_q, h, d_v), lse (b, h, s_q))``: float64 with ``upcast`` (the oracle),
    else computed in the input dtype (``lse`` in float32), like a naive PyTorch user. Rows that
    see nothing give output 0 and ``lse = -inf`` (the sink's logit with sinks).
    """
    dtype_in = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    h, h_kv = q.shape[2], k.shape[2]
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=2)
        v = v.repeat_interleave(h // h_kv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
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
    if dropout_mask is not None:
        p = p.masked_fill(~dropout_mask, 0.0) * (1.0 / (1.0 - dropout_p))
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    return (out if upcast else out.to(dtype_in)), lse


def attention_ref(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    upcast=True,
    sinks=None,
    dropout_mask=None,
    dropout_p=0.0,
):
    """Materialized attention with solattn's semantics (flash-attn 2.x: bottom-right aligned
    causal / window masks, softcap, ALiBi, GQA, optional sinks, dropout with a given mask).
    Returns ``(out (b, s_q, h, d_v), lse (b, h, s_q))``; see :func:`masked_attention_ref` for
    ``upcast`` and ``dropout_mask``.
    """
    s_q, s_k = q.shape[1], k.shape[1]
    bias = None
    if alibi_slopes is not None:
        bias = _alibi_bias(alibi_slopes, s_q, s_k, torch.float64 if upcast else q.dtype)
    ok = allowed_mask(s_q, s_k, causal, window_size, device=q.device)
    return masked_attention_ref(q, k, v, ok, softmax_scale=softmax_scale, softcap=softcap,
                                bias=bias, sinks=sinks, dropout_mask=dropout_mask,
                                dropout_p=dropout_p, upcast=upcast)


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """Oracle for packed varlen inputs: ``out (t_q, h, d_v)``, ``lse (h, t_q)``. A
    ``dropout_mask`` is ``(batch, h, max_seqlen_q, max_seqlen_k)``, sequence ``b``'s mask in
    the top-left corner of ``dropout_mask[b]``."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qb = q[cq[b] : cq[b + 1]][None]
        kb, vb = k[ck[b] : ck[b + 1]][None], v[ck[b] : ck[b + 1]][None]
        slopes = kwargs.get("alibi_slopes")
        kw = dict(kwargs)
        if slopes is not None and slopes.dim() == 2:
            kw["alibi_slopes"] = slopes[b]
        if kw.get("dropout_mask") is not None:
            kw["dropout_mask"] = kw["dropout_mask"][b : b + 1, :, : qb.shape[1], : kb.shape[1]]
        o, lse = attention_ref(qb, kb, vb, **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, -1)


def attention_tiled(
    q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), block_m=64, block_n=64
):
    """FlashAttention's forward, tile by tile, in plain PyTorch (float32 accumulators).

    The score matrix ``S = Q K^T`` never exists whole. For a block of ``block_m`` query rows the
    keys are visited ``block_n`` at a time, and three running quantities per row are kept:

    * ``m`` - the largest score seen so far (the softmax's stabilizing shift),
    * ``l`` - the sum of ``exp(s - m)`` over the keys seen so far,
    * ``O`` - the sum of ``exp(s - m) * v`` over the keys seen so far (un-normalized output).

    When a new block raises the maximum from ``m`` to ``m'``, every earlier term was computed
    against the old shift, so ``l`` and ``O`` are multiplied by ``alpha = exp(m - m')`` before the
    new block's terms are added. After the last block ``O / l`` is exactly ``softmax(S) V``, and
    ``lse = m + log(l)`` is the row's log-sum-exp (what backward and split-KV merging need).

    Masked scores are ``-inf``; a row whose keys are all masked so far keeps ``m = -inf``, so the
    shift used is 0 there (``exp(-inf - 0) = 0``) and the row ends with ``l = 0``: output 0, lse
    ``-inf``. Returns ``(out (b, s_q, h, d_v) in q's dtype, lse (b, h, s_q) float32)``.
    """
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=2)
        v = v.repeat_interleave(h // h_kv, dim=2)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
    ok = allowed_mask(s_q, s_k, causal, window_size, device=q.device)
    out = torch.empty(b, h, s_q, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q.device)
    for i0 in range(0, s_q, block_m):
        qi = qf[:, :, i0 : i0 + block_m]
        rows = qi.shape[2]
        m = torch.full((b, h, rows), float("-inf"), device=q.device)
        l = torch.zeros((b, h, rows), device=q.device)
        o = torch.zeros((b, h, rows, v.shape[-1]), device=q.device)
        for j0 in range(0, s_k, block_n):
            s = (qi @ kf[:, :, j0 : j0 + block_n].transpose(-1, -2)) * scale
            s = s.masked_fill(~ok[i0 : i0 + block_m, j0 : j0 + block_n], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - shift[..., None])
            alpha = torch.exp(m - shift)
            l = l * alpha + p.sum(-1)
            o = o * alpha[..., None] + p @ vf[:, :, j0 : j0 + block_n]
            m = m_new
        empty = l == 0
        out[:, :, i0 : i0 + block_m] = o / torch.where(empty, torch.ones_like(l), l)[..., None]
        lse[:, :, i0 : i0 + block_m] = torch.where(
            empty, torch.full_like(l, float("-inf")), m + torch.log(torch.where(empty, 1.0, l))
        )
    return out.transpose(1, 2).to(q.dtype), lse


def flex_attention_ref(q, k, v, score_mod=None, mask_mod=None, scale=None, upcast=True,
                       dropout_mask=None, dropout_p=0.0):
    """FlexAttention materialized, with torch's semantics, in its ``(B, H, L, E)`` layout.

    The score matrix ``q @ k^T * scale`` gets ``score_mod`` (evaluated on broadcast index tensors
    ``b (B,1,1,1)``, ``h (1,H,1,1)``, ``q_idx (1,1,L,1)``, ``kv_idx (1,1,1,S)``, int32, ``h`` the
    query head) and ``-inf`` where ``mask_mod`` is False; GQA repeats K/V heads. Rows with no
    finite score give output 0 and ``lse = -inf`` (and no NaN in gradients). Gradients reach
    ``q``, ``k``, ``v`` and the tensors the mods capture. ``upcast``: float64 (the oracle) or the
    input dtype (the low-precision twin). ``dropout_mask`` (bool ``(B, H, L, S)``, True =
    kept): dropout with a given mask, as :func:`masked_attention_ref`. Returns
    ``(out (B, H, L, Ev), lse (B, H, L))``.
    """
    dtype_in = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    B, H, L, E = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    dev = q.device
    b = torch.arange(B, dtype=torch.int32, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, dtype=torch.int32, device=dev).view(1, H, 1, 1)
    qi = torch.arange(L, dtype=torch.int32, device=dev).view(1, 1, L, 1)
    ki = torch.arange(S, dtype=torch.int32, device=dev).view(1, 1, 1, S)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).expand(B, H, L, S)
        if not upcast:  # a mod's fp32 captured tensors promote; the twin stays in the input dtype
            s = s.to(dtype_in)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki).to(torch.bool).expand(B, H, L, S),
                          float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)
    s = torch.where(empty, torch.zeros_like(s), s)
    lse = torch.logsumexp(s if upcast else s.float(), dim=-1)
    lse = lse.masked_fill(empty[..., 0], float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    if dropout_mask is not None:
        p = p.masked_fill(~dropout_mask, 0.0) * (1.0 / (1.0 - dropout_p))
    out = p.to(v.dtype) @ v
    return (out if upcast else out.to(dtype_in)), lse
