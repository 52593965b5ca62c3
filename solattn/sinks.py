"""Attention sinks: a learnable per-head logit that joins every row's softmax (gpt-oss).

With a sink logit ``s_h`` for head ``h``, each query row's softmax runs over its keys *and* one
extra "sink" column of score ``s_h`` whose value vector is zero. Only the denominator changes::

    lse_sink = log(exp(lse) + exp(s_h)) = logaddexp(lse, s_h)
    out_sink = out * exp(lse - lse_sink)            (= out * sigmoid(lse - s_h))

so the kernels need no change: :func:`apply_sinks` rescales their output by their fp32
log-sum-exp. It is built from differentiable torch ops, so gradients reach ``q``/``k``/``v``
through ``out`` and ``lse`` (solattn's ``lse`` output has an exact gradient) and reach ``sinks``.
"""

from __future__ import annotations

import torch

# layout name -> (out's shape, lse's shape), for error messages
_LAYOUTS = {
    "bshd": ("(batch, seqlen, nheads, headdim)", "(batch, nheads, seqlen)"),
    "thd": ("(total, nheads, headdim)", "(nheads, total)"),
}


def _check(out, lse, sinks, layout: str) -> int:
    """Validate the three tensors for ``layout``; return the number of heads."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected one of {sorted(_LAYOUTS)}, got {layout!r}")
    out_layout, lse_layout = _LAYOUTS[layout]
    for name, t in (("out", out), ("lse", lse), ("sinks", sinks)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    ndim = 4 if layout == "bshd" else 3
    if out.dim() != ndim:
        raise ValueError(f"out: expected a {ndim}-D tensor {out_layout} (layout={layout!r}), "
                         f"got shape {tuple(out.shape)}")
    if layout == "bshd":
        b, s, h, _ = out.shape
        expected_lse = (b, h, s)
    else:
        t, h, _ = out.shape
        expected_lse = (h, t)
    if tuple(lse.shape) != expected_lse:
        raise ValueError(f"lse: expected shape {expected_lse} = {lse_layout} for out of shape "
                         f"{tuple(out.shape)}, got {tuple(lse.shape)}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse: expected dtype torch.float32, got {lse.dtype}")
    if out.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"out: expected dtype float16, bfloat16 or float32, got {out.dtype}")
    if tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks: expected shape ({h},) (nheads), got {tuple(sinks.shape)}")
    if sinks.dtype not in (torch.float32, out.dtype):
        raise TypeError(f"sinks: expected dtype torch.float32 or {out.dtype} (out's dtype), "
                        f"got {sinks.dtype}")
    for name, t in (("lse", lse), ("sinks", sinks)):
        if t.device != out.device:
            raise ValueError(f"{name}: expected device {out.device} (out's), got {t.device}")
    return h


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *,
                layout: str = "bshd") -> tuple[torch.Tensor, torch.Tensor]:
    """Fold per-head sink logits into an attention output and its log-sum-exp.

    Parameters
    ----------
    out : attention output, q's dtype (fp16 / bf16; fp32 accepted). ``layout="bshd"``:
        (batch, seqlen_q, nheads, headdim_v), as :func:`solattn.flash_attn_func` returns;
        ``layout="thd"``: (total_q, nheads, headdim_v), as :func:`solattn.flash_attn_varlen_func`.
    lse : float32 natural-log log-sum-exp of the same call (``return_lse=True``):
        (batch, nheads, seqlen_q) for ``"bshd"``, (nheads, total_q) for ``"thd"``; ``-inf`` on
        rows that saw no key.
    sinks : (nheads,) sink logits, float32 or out's dtype, same device. The sink shares the
        softmax of every row of its head but contributes a zero value vector. A row that saw no
        key attends only to its sink: output 0, ``lse_sink = sinks[h]``.
    layout : ``"bshd"`` (batched) or ``"thd"`` (varlen).

    Returns
    -------
    out_sink : out's shape and dtype, ``out * exp(lse - logaddexp(lse, sinks[h]))``.
    lse_sink : float32, lse's shape, ``logaddexp(lse, sinks[h])``.

    Computed in float32 and cast back once. Differentiable in ``out``, ``lse`` and ``sinks``
    (``sinks.grad`` has ``sinks``' dtype).
    """
    h = _check(out, lse, sinks, layout)
    s = sinks.float()
    s = s.view(1, h, 1) if layout == "bshd" else s.view(h, 1)
    lse_sink = torch.logaddexp(lse, s)
    # Both -inf (an empty row with a -inf sink) would give -inf - -inf = NaN: such a row has no
    # probability mass at all, its output stays 0.
    scale = torch.exp(torch.where(torch.isneginf(lse_sink), lse_sink, lse - lse_sink))
    scale = scale.permute(0, 2, 1) if layout == "bshd" else scale.transpose(0, 1)
    out_sink = (out.float() * scale.unsqueeze(-1)).to(out.dtype)
    return out_sink, lse_sink
