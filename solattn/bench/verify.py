"""Every timed implementation is first checked against the float64 oracle on small shapes.

:func:`check` runs one ``setup(shape, inputs) -> attn`` (a peer of :mod:`solattn.bench.peers` or
a step of :mod:`solattn.bench.ladder`) on a shape and compares its output and, with ``grads``, its
dQ/dK/dV with :func:`solattn.reference.attention_ref` in float64, by flash-attn's rule
(:func:`solattn.bench.core.tolerance`). A failed check makes ``solattn bench`` exit non-zero.
"""

from __future__ import annotations

import torch

from .core import Shape, make_inputs, short_error, tolerance
from .peers import PeerUnavailable


def _entry(name, shape, what, ok, err=None, bound=None, note=None) -> dict:
    return dict(name=name, shape=shape.label(), what=what, ok=ok, err=err, bound=bound, note=note)


def check(name: str, setup, shape: Shape, *, dtype, device, grads: bool = False,
          strict: bool = False) -> list[dict]:
    """Checks of ``setup``'s attention on ``shape``: one entry for the output and, with
    ``grads``, one per gradient. ``ok`` is None for a skip (the implementation cannot run the
    shape); ``strict`` (solattn's own code) turns an unexpected exception into a failure."""
    from solattn.reference import attention_ref

    x = make_inputs(shape, dtype=dtype, device=device)
    try:
        attn = setup(shape, x)
        with torch.no_grad():
            out = attn(x.q, x.k, x.v)
    except (PeerUnavailable, NotImplementedError) as exc:
        return [_entry(name, shape, "out", None, note=short_error(exc))]
    except Exception as exc:  # noqa: BLE001 - a peer that fails here is reported, not fatal
        return [_entry(name, shape, "out", False if strict else None, note=short_error(exc))]
    hi, _ = attention_ref(x.q, x.k, x.v, causal=shape.causal)
    lo, _ = attention_ref(x.q, x.k, x.v, causal=shape.causal, upcast=False)
    ok, err, bound = tolerance(out, hi, lo)
    entries = [_entry(name, shape, "out", ok, err, bound)]
    if not grads:
        return entries
    try:
        q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
        out = attn(q, k, v)
        g = torch.Generator(device=device).manual_seed(1)
        dout = torch.randn(out.shape, generator=g, device=device, dtype=dtype)
        got = torch.autograd.grad(out, (q, k, v), dout)
    except Exception as exc:  # noqa: BLE001 - no backward for this shape
        return entries + [_entry(name, shape, "grads", False if strict else None,
                                 note=short_error(exc))]
    qh, kh, vh = (t.detach().double().requires_grad_() for t in (x.q, x.k, x.v))
    ref_hi = torch.autograd.grad(attention_ref(qh, kh, vh, causal=shape.causal)[0],
                                 (qh, kh, vh), dout.double())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
    ref_lo = torch.autograd.grad(attention_ref(ql, kl, vl, causal=shape.causal, upcast=False)[0],
                                 (ql, kl, vl), dout)
    for what, a, h, l in zip(("dq", "dk", "dv"), got, ref_hi, ref_lo):
        ok, err, bound = tolerance(a, h, l)
        entries.append(_entry(name, shape, what, ok, err, bound))
    return entries


def line(entry: dict) -> str:
    """One human-readable verification line."""
    head = f"  verify {entry['name']:<18} {entry['shape']:<34} {entry['what']:<5}"
    if entry["ok"] is None:
        return f"{head} skipped ({entry['note']})"
    if entry["err"] is None:
        return f"{head} FAIL ({entry['note']})"
    verdict = "ok" if entry["ok"] else "FAIL"
    return f"{head} max err {entry['err']:.2e} (bound {entry['bound']:.2e}) {verdict}"


def failed(entries) -> list[dict]:
    return [e for e in entries if e["ok"] is False]
