"""flash-attn's API: validation -> normalization -> :mod:`solattn.core`.

The flash-attn 2.x functions (``flash_attn_func``, ``flash_attn_varlen_func`` and their packed
variants) and an SDPA-layout ``attention``. Every argument is checked on the host before a
kernel is launched (:mod:`solattn.validation`); the user's ``(dropout_p, softmax_scale, causal,
window_size, softcap, alibi_slopes, varlen lengths)`` are normalized once, by
:func:`solattn.core.make_params`, into one frozen :class:`solattn.params.AttnParams` that every
launcher reads; :mod:`solattn.core` runs the call (custom ops, autograd) on the kernel
:mod:`solattn.dispatch` picks.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from solattn import validation as V
from solattn.core import FP8_BACKWARD, EagerPackedAttention, attn, attn_forward, make_params
from solattn.dropout import draw_seed
from solattn.kernels.triton.attn_probs import attn_probs
from solattn.launch import PlanCache
from solattn.params import AttnParams
from solattn.sinks import apply_sinks


def _check_batched(q, k, v, dropout_p, softmax_scale, window_size, softcap, alibi_slopes,
                   allow_fp8=False):
    V.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    V.check_tensor("k", k, 4, "(batch, seqlen_k, nheads_kv, headdim)")
    V.check_tensor("v", v, 4, "(batch, seqlen_k, nheads_kv, headdim_v)")
    V.check_dtypes(allow_fp8, q=q, k=k, v=v)
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
    V.check_dropout(dropout_p)
    V.check_alibi(alibi_slopes, b, h, dev)


# A call's validated arguments -> its AttnParams. The key holds everything _check_batched and
# make_params read: the tensors' types, shapes, dtypes and devices and the scalar arguments
# (with the window's element types: -1.0 hashes like -1 but is rejected; dropout_p's type: a
# bool is rejected). Only CUDA calls without tensor-valued parameters (ALiBi) are kept. A cached
# AttnParams with dropout carries the seed of the call that built it: each call draws its own.
_BATCHED = PlanCache()


def _batched_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, deterministic) -> AttnParams:
    """:func:`_check_batched` then :func:`make_params`, or the cached result of both (with a
    fresh dropout seed)."""
    key = None
    if (alibi_slopes is None and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and type(window_size) is tuple and len(window_size) == 2 and q.is_cuda):
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
               v.device, dropout_p, type(dropout_p), softmax_scale, type(softmax_scale), causal,
               window_size, type(window_size[0]), type(window_size[1]), softcap, type(softcap),
               deterministic)
        try:
            p = _BATCHED.get(key)
        except TypeError:  # an unhashable argument: validation says what is wrong with it
            p = key = None
        if p is not None:
            if p.has_dropout:
                p = dataclasses.replace(p, dropout_seed=draw_seed(q.device))
            return p
    _check_batched(q, k, v, dropout_p, softmax_scale, window_size, softcap, alibi_slopes)
    p = make_params(q, k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    deterministic=deterministic)
    if key is not None:
        _BATCHED.put(key, p)
    return p


def _returned(out, lse, return_lse, return_attn_probs, q=None, k=None, p=None):
    """What a flash-attn style call returns: ``out``; ``(out, lse)`` with ``return_lse``;
    flash-attn's ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs``: ``S_dmask`` is
    None as flash-attn's without dropout, and with dropout (``p.has_dropout``, the call's
    ``q``, ``k`` and parameters) the probabilities with the dropped ones negated
    (:mod:`solattn.kernels.triton.attn_probs`)."""
    if return_attn_probs:
        s_dmask = None
        if p is not None and p.has_dropout:
            with torch.no_grad():
                s_dmask = attn_probs(q.detach(), k.detach(), lse.detach(), p)
        return out, lse, s_dmask
    return (out, lse) if return_lse else out


def _check_attn_probs(return_attn_probs, dropout_p) -> None:
    if not return_attn_probs:
        return
    V.check_dropout(dropout_p)
    if dropout_p > 0 and torch.compiler.is_compiling():
        raise NotImplementedError(
            "return_attn_probs with dropout_p > 0 under torch.compile: S_dmask (the "
            "probabilities with the dropout pattern in their signs, a testing output) is "
            f"computed eagerly only; got dropout_p={dropout_p}. Pass return_lse=True for "
            "(out, lse)")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_lse=False, sinks=None, q_descale=None,
                    k_descale=None, v_descale=None):
    """Exact attention, flash-attn 2.x compatible (its positional order, through
    ``return_attn_probs``; solattn's own arguments are keyword-only).

    Parameters
    ----------
    q : (batch, seqlen_q, nheads, headdim), fp16 or bf16, CUDA (or CPU under TRITON_INTERPRET=1);
        or float8_e4m3fn (q, k, v all three; forward only, sm_90 GPUs only: see ``q_descale``).
    k : (batch, seqlen_k, nheads_kv, headdim); ``nheads % nheads_kv == 0`` (GQA/MQA).
    v : (batch, seqlen_k, nheads_kv, headdim_v); ``headdim_v`` may differ from ``headdim``.
        Head dims up to 256, any size. Any strides.
    dropout_p : float in [0, 1): attention dropout (training; pass 0.0 in evaluation, as with
        flash-attn). Each probability of the softmax is dropped with probability ``dropout_p``
        and the kept ones are scaled by ``1 / (1 - dropout_p)``; the mask is drawn from torch's
        default generator on q's device (reproducible under ``torch.manual_seed``, different
        on successive calls; :mod:`solattn.dropout`) and regenerated exactly by the backward.
        The returned ``lse`` is the undropped softmax's. Runs on the portable kernel.
    softmax_scale : float, default ``1 / sqrt(headdim)``.
    causal : bool. Aligned to the bottom-right corner when ``seqlen_q != seqlen_k``::

            seqlen_q = 2, seqlen_k = 5:      1 1 1 1 0
                                             1 1 1 1 1

    window_size : (left, right), -1 = unbounded. Query ``i`` sees keys ``j`` with
        ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``.
    softcap : float >= 0. If > 0, scores are ``softcap * tanh(scale * q.k / softcap)``.
    alibi_slopes : (nheads,) or (batch, nheads) float32; adds
        ``-slope * |i + seqlen_k - seqlen_q - j|`` to the (capped) score.
    deterministic : bool. Backward only: with True, gradients are bitwise identical from run to
        run (dQ in its own kernel, no float atomics; with dropout: for the same seed); with
        False dQ may be summed with atomics.
    return_attn_probs : flash-attn's flag: return ``(out, lse, S_dmask)``. ``S_dmask`` is None
        without dropout (as flash-attn's); with ``dropout_p > 0`` it is a testing output, the
        probabilities ``(batch, nheads, seqlen_q, seqlen_k)`` in q's dtype with each dropped
        one negated (:mod:`solattn.kernels.triton.attn_probs`: normalized, unpadded; flash-attn
        pads to multiples of 128 and stores them unnormalized). It takes ``seqlen_q *
        seqlen_k`` elements per head, computed eagerly (``NotImplementedError`` under
        ``torch.compile``).
    return_lse : also return the log-sum-exp of each row (natural log): ``(out, lse)``.
    sinks : optional (nheads,) attention-sink logits (gpt-oss), float32 or q's dtype: each row's
        softmax also spans one extra column of score ``sinks[h]`` and value 0
        (:func:`solattn.sinks.apply_sinks`, exact, fp32). Differentiable.
    q_descale, k_descale, v_descale : FP8 only (flash-attn 3's interface): optional
        (batch, nheads_kv) float32; the inputs' values are ``q * q_descale[b, h // group]`` (and
        so for k and v), None meaning 1. The FP8 forward (Hopper sm_90; head dims 64, 128, 256
        with ``headdim_v == headdim``; causal, local windows, softcap, GQA, LSE; no dropout,
        ALiBi or sinks, not under ``torch.compile``) folds ``q_descale * k_descale`` into the
        softmax scale, rounds the probabilities (times 2**8) to e4m3 for ``P V`` and multiplies
        the output by ``v_descale``; it returns bf16. Its error against the exact attention of
        the dequantized inputs is documented in docs/hopper-forward.md ("FP8"). No backward:
        inputs that require grad (with grad mode on) raise ``NotImplementedError``.

    Returns
    -------
    out : (batch, seqlen_q, nheads, headdim_v), q's dtype (bf16 for float8_e4m3fn inputs). A
        row that sees no key is 0.
    lse : (batch, nheads, seqlen_q) float32, only with ``return_lse`` or ``return_attn_probs``;
        ``-inf`` for empty rows.

    Differentiable in ``q``, ``k``, ``v`` (``loss.backward()`` runs solattn's backward)
    and through ``lse``, whose gradient is exact. Works under ``torch.compile(fullgraph=True)``.
    """
    _check_attn_probs(return_attn_probs, dropout_p)
    window_size, softcap = V.as_window(window_size), V.as_real("softcap", softcap)
    if (getattr(q, "dtype", None) == V.FP8_DTYPE or q_descale is not None
            or k_descale is not None or v_descale is not None):
        out, lse = _fp8_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                alibi_slopes, deterministic, sinks, q_descale, k_descale,
                                v_descale)
        return _returned(out, lse, return_lse, return_attn_probs)
    p = _batched_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic)
    out, lse = attn(q, k, v, p)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, layout="bshd")
    return _returned(out, lse, return_lse, return_attn_probs, q, k, p)


def _fp8_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 deterministic, sinks, q_descale, k_descale, v_descale):
    """:func:`flash_attn_func` on float8_e4m3fn inputs: every check before the launch (the
    ordinary ones, the GPU, the descales, the features the FP8 kernel covers), then the
    Hopper FP8 forward -> ``(out bf16, lse)``. Forward only: no autograd."""
    V.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    if q.dtype != V.FP8_DTYPE:
        raise TypeError(f"q_descale, k_descale, v_descale: only with float8_e4m3fn inputs, got "
                        f"q.dtype={q.dtype}")
    V.check_fp8_device("q", q.device)
    _check_batched(q, k, v, dropout_p, softmax_scale, window_size, softcap, alibi_slopes,
                   allow_fp8=True)
    p = _fp8_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, deterministic, sinks, q_descale, k_descale, v_descale,
                    batch=q.shape[0])
    return attn_forward(q, k, v, p, return_lse=True, backend="hopper")


def _fp8_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, sinks, q_descale, k_descale, v_descale, batch, **varlen):
    """The FP8 checks after the ordinary ones (``flash_attn_func``'s or the varlen entry's):
    q's dtype, the device, sinks, tracing, grad mode, the descales (``(batch, h_kv)``, batch
    the number of sequences for varlen), the features the FP8 kernel covers -> the call's
    :class:`AttnParams`."""
    if q.dtype != V.FP8_DTYPE:
        raise TypeError(f"q_descale, k_descale, v_descale: only with float8_e4m3fn inputs, got "
                        f"q.dtype={q.dtype}")
    V.check_fp8_device("q", q.device)
    if sinks is not None:
        raise NotImplementedError("sinks: not supported with float8_e4m3fn inputs")
    if torch.compiler.is_compiling():
        raise NotImplementedError("float8_e4m3fn inputs: flash_attn_func is not traceable by "
                                  "torch.compile (call it outside the compiled region)")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError(FP8_BACKWARD + "; call it under torch.no_grad() or with "
                                  "inputs that do not require grad")
    h_kv = k.shape[-2]
    descales = {name: V.check_descale(name, t, batch, h_kv, q.device)
                for name, t in (("q_descale", q_descale), ("k_descale", k_descale),
                                ("v_descale", v_descale))}
    p = make_params(q, k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    deterministic=deterministic, **descales, **varlen)
    from solattn.kernels.hopper.forward_plan import fp8_unsupported

    why = fp8_unsupported(q, v, p)
    if why:
        raise NotImplementedError(why)
    return p


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                  block_table, softmax_scale, window_size, softcap, alibi_slopes,
                  allow_fp8=False):
    """Validate a varlen call; returns ``(seqused_k, block_table)`` ready for the kernels."""
    paged = block_table is not None
    kv_rows = "num_pages, page_size" if paged else "total_k"
    V.check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    V.check_tensor("k", k, 4 if paged else 3, f"({kv_rows}, nheads_kv, headdim)")
    V.check_tensor("v", v, 4 if paged else 3, f"({kv_rows}, nheads_kv, headdim_v)")
    V.check_dtypes(allow_fp8, q=q, k=k, v=v)
    dev = V.check_devices(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          seqused_k=seqused_k, block_table=block_table)
    batch = V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, dev, total=q.shape[0])
    if cu_seqlens_k is None:
        if not (paged and seqused_k is not None):
            raise ValueError("cu_seqlens_k: expected a (batch + 1,) int32 tensor, got None (it "
                             "may be None only for paged keys counted by seqused_k, with "
                             "block_table and seqused_k both given)")
    else:
        # Paged keys are counted, not located, by cu_seqlens_k: no bound from k's rows.
        batch_k = V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, dev,
                                     total=None if paged else k.shape[0])
        V.check_dim("cu_seqlens_k", batch_k + 1, batch + 1, "length (len(cu_seqlens_q))")
    V.check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    V.check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    h, d = q.shape[1], q.shape[2]
    dims = ("num_pages", "page_size", "nheads_kv") if paged else ("total_k", "nheads_kv")
    for i, what in enumerate(dims):
        V.check_dim("v", v.shape[i], k.shape[i], f"{what} (k.shape[{i}])")
    V.check_dim("k", k.shape[-1], d, "headdim (q.shape[2])")
    V.check_heads(h, k.shape[-2])
    V.check_head_dims(q, v)
    V.check_scalars(softmax_scale, window_size, softcap)
    V.check_alibi(alibi_slopes, batch, h, dev)
    if seqused_k is not None:
        seqused_k = V.check_seqused_k(seqused_k, batch, dev)
    if paged:
        if k.shape[1] < 1:
            raise ValueError(f"k: expected page_size (k.shape[1], with block_table) >= 1, "
                             f"got {k.shape[1]}")
        block_table = V.check_block_table(block_table, batch, dev)
    V.check_key_counts(cu_seqlens_k, seqused_k, block_table, num_pages=k.shape[0],
                       page_size=k.shape[1])
    return seqused_k, block_table


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, return_lse=False,
                           sinks=None, seqused_k=None, q_descale=None, k_descale=None,
                           v_descale=None):
    """Exact attention over a packed batch of variable-length sequences (flash-attn 2.x), the
    keys contiguous or in a paged KV cache (serving: chunked prefill, mixed prefill/decode).

    Parameters
    ----------
    q : (total_q, nheads, headdim); sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
    k, v : without ``block_table``, (total_k, nheads_kv, headdim) / (total_k, nheads_kv,
        headdim_v), sequence ``b`` at rows ``cu_seqlens_k[b]:``. With ``block_table``, the
        paged cache (num_pages, page_size, nheads_kv, headdim[_v]), read in place (no copy):
        key ``j`` of sequence ``b`` is row ``j % page_size`` of page
        ``block_table[b, j // page_size]``. Any ``page_size >= 1`` (flash-attn 2 requires a
        multiple of 256); pages that are a multiple of the kernel's key tile (32 to 128 keys by
        head dim and GPU: 128 and 256 always are) read one page number per tile, others one per
        key row.
    cu_seqlens_q, cu_seqlens_k : (batch + 1,) int32, non-decreasing, starting at 0. Zero-length
        sequences are allowed. With ``block_table``, ``cu_seqlens_k`` only counts each
        sequence's keys (``cu_seqlens_k[b+1] - cu_seqlens_k[b]``, as flash-attn reads it), and
        may be None when ``seqused_k`` is given. Values (and ``max_seqlen_*`` against them) are
        checked on CPU tensors only: on a GPU a check would synchronize every call, and invalid
        values there are undefined behaviour, as in flash-attn.
    max_seqlen_q, max_seqlen_k : int, at least the longest query / key sequence.
    block_table : optional (batch, max_pages_per_seq) int32, last stride 1: the pages of each
        sequence, in order. Entries past a sequence's keys are never read (padding is fine).
    seqused_k : optional (batch,) int32: sequence ``b`` uses only its first ``seqused_k[b]``
        keys (with or without ``block_table``); it replaces the ``cu_seqlens_k`` count.
    Positional order: flash-attn 2.6's, through ``block_table``; the rest are keyword-only.
    Other arguments as :func:`flash_attn_func` (``dropout_p``, ``deterministic``, ``sinks``,
    ``return_attn_probs`` included; no ``dropout_p`` with ``block_table``); masks align each
    sequence's own bottom-right corner, with ``seqlen_k`` its used key count: a chunk of ``n``
    new queries at the end of ``L`` cached keys (chunked prefill; ``n = 1`` is a decode step)
    sees, with ``causal``, keys ``j <= L - n + i`` for its query ``i``::

            n = 2, L = 5:      1 1 1 1 0
                               1 1 1 1 1

    ALiBi slopes of shape (batch, nheads) index the batch by sequence.

    float8_e4m3fn ``q``, ``k``, ``v`` with ``q_descale``, ``k_descale``, ``v_descale``
    (optional (batch, nheads_kv) float32, ``batch`` the number of sequences) run the FP8
    forward as :func:`flash_attn_func` does (Hopper only, forward only, bf16 output; contiguous
    keys: no ``block_table``, no ``seqused_k``).

    Returns
    -------
    out : (total_q, nheads, headdim_v); lse : (nheads, total_q) float32 with ``return_lse``
    (``(out, lse, None)`` with ``return_attn_probs``).

    Differentiable like :func:`flash_attn_func`; rows past ``cu_seqlens[-1]`` and keys past
    ``seqused_k`` get zero gradients. The backward of a paged call (rare: training does not
    page) gathers each sequence's pages into contiguous keys, runs the varlen backward and
    scatter-adds dK/dV back into page-shaped gradients (pages shared by sequences sum). The
    forward always runs the portable Triton kernel when paged (the Hopper kernel's TMA loads
    address contiguous sequences).
    """
    _check_attn_probs(return_attn_probs, dropout_p)
    window_size, softcap = V.as_window(window_size), V.as_real("softcap", softcap)
    fp8 = (getattr(q, "dtype", None) == V.FP8_DTYPE or q_descale is not None
           or k_descale is not None or v_descale is not None)
    seqused_k, block_table = _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
        softmax_scale, window_size, softcap, alibi_slopes, allow_fp8=fp8)
    if fp8:
        p = _fp8_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, sinks, q_descale, k_descale, v_descale,
                        batch=cu_seqlens_q.numel() - 1, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                        block_table=block_table)
        out, lse = attn_forward(q, k, v, p, return_lse=True, backend="hopper")
        return _returned(out, lse, return_lse, return_attn_probs)
    V.check_dropout(dropout_p)
    if dropout_p > 0 and block_table is not None:
        raise NotImplementedError("dropout_p: no attention dropout with block_table (a paged "
                                  f"KV cache is for inference); got dropout_p={dropout_p}")
    p = make_params(
        q, k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
        block_table=block_table)
    out, lse = attn(q, k, v, p)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, layout="thd")
    return _returned(out, lse, return_lse, return_attn_probs, q, k, p)


# ---------------------------------------------------------------------------------------------
# flash-attn's packed variants: q, k, v (or k, v) stacked in one tensor, as a fused projection
# writes them. The forward runs on views (no copy: every kernel takes any strides). The batched
# variants' gradient is allocated packed and filled in place where the Hopper backward's dK/dV
# epilogue runs (EagerPackedAttention: only dQ is copied in; elsewhere each gradient is copied
# into its view); the varlen variants' arrives through ``unbind``'s backward, one
# ``torch.stack``. (flash-attn writes all three in place. H200, forward + backward against
# separate tensors: qkvpacked MHA d=128 1.04-1.05x the time, d=64 1.03x, kvpacked GQA 1.00-1.04x;
# docs/journal/2026-11-27.md, sixteenth session.)
# ---------------------------------------------------------------------------------------------

def _packed_func(first, kv, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, deterministic, return_attn_probs, return_lse, sinks):
    """:func:`flash_attn_func` on the views ``q, k, v`` of the packed ``first`` (``qkv``, with
    ``kv`` None) or of ``q`` and ``kv``: eager calls that need a gradient run
    :class:`EagerPackedAttention`, the rest (no gradient, ``torch.compile``, FP8)
    :func:`flash_attn_func` itself."""
    wants_grad = torch.is_grad_enabled() and (first.requires_grad
                                              or (kv is not None and kv.requires_grad))
    if (not wants_grad or torch.compiler.is_compiling()
            or getattr(q, "dtype", None) == V.FP8_DTYPE):
        return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs,
                               return_lse=return_lse, sinks=sinks)
    _check_attn_probs(return_attn_probs, dropout_p)
    window_size, softcap = V.as_window(window_size), V.as_real("softcap", softcap)
    p = _batched_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic)
    out, lse = EagerPackedAttention.apply(first, kv, p)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, layout="bshd")
    return _returned(out, lse, return_lse, return_attn_probs, q, k, p)


def _unpack(name: str, t, parts: int, layout: str):
    """The ``parts`` views of ``t`` along its packing dim (third from last), after checking its
    rank and that dim's size."""
    ndim = layout.count(",") + 1
    V.check_tensor(name, t, ndim, layout)
    V.check_dim(name, t.shape[-3], parts,
                f"shape[{ndim - 3}] (the packed {'q, k, v' if parts == 3 else 'k, v'})")
    return t.unbind(ndim - 3)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, return_lse=False,
                              sinks=None):
    """:func:`flash_attn_func` on ``qkv (batch, seqlen, 3, nheads, headdim)`` (flash-attn's
    signature; q, k and v have the same heads: see :func:`flash_attn_kvpacked_func` for
    GQA/MQA). Returns as :func:`flash_attn_func`; the gradient is ``dqkv``, packed like
    ``qkv``."""
    q, k, v = _unpack("qkv", qkv, 3, "(batch, seqlen, 3, nheads, headdim)")
    return _packed_func(qkv, None, q, k, v, dropout_p, softmax_scale, causal, window_size,
                        softcap, alibi_slopes, deterministic, return_attn_probs, return_lse,
                        sinks)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, return_lse=False,
                             sinks=None):
    """:func:`flash_attn_func` on ``q (batch, seqlen_q, nheads, headdim)`` and
    ``kv (batch, seqlen_k, 2, nheads_kv, headdim)`` (flash-attn's signature; GQA/MQA when
    ``nheads_kv < nheads``). The gradient of ``kv`` is packed like ``kv``."""
    k, v = _unpack("kv", kv, 2, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    return _packed_func(q, kv, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_attn_probs, return_lse, sinks)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, return_lse=False, sinks=None):
    """:func:`flash_attn_varlen_func` on ``qkv (total, 3, nheads, headdim)``, queries and keys
    split by the same ``cu_seqlens`` (flash-attn's signature). The gradient is packed like
    ``qkv``."""
    q, k, v = _unpack("qkv", qkv, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  return_lse=return_lse, sinks=sinks)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, return_lse=False, sinks=None):
    """:func:`flash_attn_varlen_func` on ``q (total_q, nheads, headdim)`` and
    ``kv (total_k, 2, nheads_kv, headdim)`` (flash-attn's signature). The gradient of ``kv`` is
    packed like ``kv``."""
    k, v = _unpack("kv", kv, 2, "(total_k, 2, nheads_kv, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  return_lse=return_lse, sinks=sinks)


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, deterministic=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (same arguments, in
    the same order).

    Parameters
    ----------
    q : (batch, nheads, seqlen_q, headdim); k, v : (batch, nheads_kv, seqlen_k, headdim[_v]).
    attn_mask : None, or as SDPA's: a bool tensor (True: the query attends to the key) or a
        tensor of q's dtype added to the scaled scores, broadcastable to (batch, nheads,
        seqlen_q, seqlen_k). Runs on the FlexAttention kernels
        (:func:`solattn.flex.sdpa_mask.masked_attention`): blocks the mask empties are skipped,
        blocks it leaves whole run unmasked. Gradients reach a float mask that requires grad.
        A query whose keys are all masked gets 0 (SDPA's math backend: NaN).
    dropout_p : attention dropout, as SDPA's argument (see :func:`flash_attn_func`; solattn's
        own random stream, so the masks differ from SDPA's).
    is_causal : as SDPA (not with ``attn_mask``). Note SDPA aligns causal to the *top-left*
        corner; for ``seqlen_q != seqlen_k`` this function follows SDPA (top-left), unlike
        flash_attn_func.
    scale : default ``1 / sqrt(headdim)``.
    enable_gqa : allow ``nheads_kv < nheads`` (as SDPA's argument of the same name).
    deterministic : bitwise-reproducible backward (see :func:`flash_attn_func`); keyword only,
        and not with ``attn_mask`` (the flex backward sums dQ with float atomics).

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
    if attn_mask is not None:
        from solattn.flex.sdpa_mask import masked_attention

        if is_causal:
            raise ValueError("attn_mask: expected None with is_causal=True (as SDPA: put the "
                             "causal mask into attn_mask), got a tensor")
        if deterministic:
            raise NotImplementedError("attention: deterministic=True with attn_mask is not "
                                      "supported (its FlexAttention backward sums dQ with float "
                                      "atomics)")
        V.check_attn_mask(attn_mask, q, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
        return masked_attention(q, k, v, attn_mask, scale=scale, enable_gqa=enable_gqa,
                                dropout_p=dropout_p)
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
    out = flash_attn_func(qt, kt, vt, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal,
                          window_size=window, deterministic=deterministic)
    return out.transpose(1, 2)
