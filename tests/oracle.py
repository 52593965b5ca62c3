"""The tolerance rule and tensor helpers every test file uses (one copy)."""

from __future__ import annotations

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
GPU_GRID = pytest.mark.gpu_grid
# An sm_90 GPU: the Hopper (Gluon) kernels run only there. ``sm90``: skip a test elsewhere.
ON_SM90 = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) GPU: the Gluon kernels "
                                              "use wgmma, TMA and setmaxnreg")


def gpu_grid(*values):
    """Parametrize values that the interpreter run (CPU) deselects: each runs kernel code that a
    kept value already runs there. The GPU suite runs them all (tests/conftest.py)."""
    return [pytest.param(v, marks=GPU_GRID) for v in values]


def randn(*shape, dtype=torch.float16, device=DEVICE, requires_grad=False):
    return torch.randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; NaN anywhere counts as infinite error."""
    d = (a.double() - b.double()).abs()
    if torch.isnan(d).any():
        return float("inf")
    return d.max().item() if d.numel() else 0.0


def assert_close(
    name: str,
    out: torch.Tensor,
    ref_hi: torch.Tensor,
    ref_lo: torch.Tensor,
    factor: float = 2.0,
    eps: float = 1e-5,
) -> None:
    """flash-attn's rule: ``|out - ref| <= factor * |ref_lowp - ref| + eps`` (max abs errors).

    ``ref_hi`` is the float64 oracle; ``ref_lo`` the same computation by PyTorch in the input
    dtype, i.e. the error a plain PyTorch implementation already makes.
    """
    assert out.shape == ref_hi.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref_hi.shape)}"
    err = max_err(out, ref_hi)
    base = max_err(ref_lo, ref_hi)
    assert err <= factor * base + eps, (
        f"{name}: max error {err:.3e} > {factor} x PyTorch-{ref_lo.dtype} error {base:.3e} + {eps}"
    )


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, atol: float = 2e-3) -> None:
    """LSE is fp32 in both: compare directly; -inf must match -inf exactly."""
    assert lse.shape == ref.shape, f"lse: shape {tuple(lse.shape)} != {tuple(ref.shape)}"
    assert lse.dtype == torch.float32
    inf_mask = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), inf_mask), "lse: -inf rows differ from the oracle"
    assert not torch.isnan(lse).any(), "lse: NaN"
    finite = ~inf_mask
    if finite.any():
        err = (lse[finite].double() - ref[finite].double()).abs().max().item()
        assert err <= atol, f"lse: max error {err:.3e} > {atol}"


# The feature matrix forward and backward tests share: name -> flash_attn_func keyword arguments
# ("alibi": "heads" | "batch" becomes slopes of shape (h,) | (b, h) in feature_kwargs).
FEATURES = {
    "local": dict(window_size=(7, 3)),
    "local-left-only": dict(window_size=(10, -1)),
    "local-right-only": dict(window_size=(-1, 5)),
    "causal-local": dict(causal=True, window_size=(12, -1)),
    "softcap": dict(softcap=2.0),
    "causal-softcap": dict(causal=True, softcap=10.0),
    "alibi": dict(alibi="heads"),
    "alibi-batch-causal": dict(alibi="batch", causal=True),
    "softcap-alibi-local": dict(softcap=5.0, alibi="heads", window_size=(9, 4)),
    "scale": dict(softmax_scale=0.3),
}


def feature_kwargs(feature: str, b: int, h: int) -> dict:
    """Keyword arguments of one FEATURES entry for a (b, *, h, *) problem (random slopes)."""
    kw = dict(FEATURES[feature])
    alibi = kw.pop("alibi", None)
    if alibi == "heads":
        kw["alibi_slopes"] = torch.rand(h, device=DEVICE) * 0.3
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(b, h, device=DEVICE) * 0.3
    return kw


def random_loss(out, lse=None):
    """``(loss, dout, dlse)``: ``sum(out * dout)`` for a random output gradient, plus, when
    ``lse`` is given, ``sum(lse * dlse)`` over its finite rows for a random ``dlse`` (``None``
    without), in fp32; the test's gradients are of ``loss``, the oracle's of the same terms
    (:func:`oracle_grads`)."""
    dout = torch.randn_like(out)
    loss = (out.float() * dout.float()).sum()
    dlse = None
    if lse is not None:
        dlse = torch.randn_like(lse)
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum()
    return loss, dout, dlse


def oracle_grads(ref_fn, q, k, v, dout, *, upcast, dlse=None):
    """Autograd of the oracle ``ref_fn(q, k, v, upcast=upcast) -> (out, lse)`` (e.g.
    :func:`solattn.reference.attention_ref` with its masks bound), in float64 (``upcast``) or
    in the inputs' dtype: the gradients of ``sum(out * dout)``, plus ``sum(lse * dlse)`` over
    the rows whose ``lse`` is finite when ``dlse`` is given."""
    dt = torch.float64 if upcast else None
    qs, ks, vs = (t.detach().to(dt or t.dtype).clone().requires_grad_() for t in (q, k, v))
    out, lse = ref_fn(qs, ks, vs, upcast=upcast)
    loss = (out * dout.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * dlse.to(lse.dtype)).sum()
    return torch.autograd.grad(loss, (qs, ks, vs))
