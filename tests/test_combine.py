"""flash_attn_combine: merging attention over disjoint key sets equals attention over the union."""

from __future__ import annotations

import pytest
import torch
from oracle import DEVICE, DTYPES, assert_close, assert_lse_close, randn

from solattn import flash_attn_combine
from solattn.reference import attention_ref


def _split_attention(q, k, v, bounds, causal=False):
    """Attention of q over each key slice ``[bounds[i], bounds[i+1])`` with the oracle (float64).

    Returns ``(out_partial (S, b, s_q, h, d) float32, lse_partial (S, b, s_q, h) float32)``.
    The causal mask of the whole problem is applied to each slice (a slice is a column range).
    """
    s_q, s_k = q.shape[1], k.shape[1]
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        # Window (-1, right) in the sliced problem keeps the original bottom-right diagonal.
        right = (s_k - s_q) - lo - (hi - lo - s_q) if causal else -1
        o, lse = attention_ref(q, k[:, lo:hi], v[:, lo:hi], softmax_scale=q.shape[-1] ** -0.5,
                               window_size=(-1, right) if causal else (-1, -1))
        outs.append(o.float())
        lses.append(lse.float().transpose(1, 2))
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("bounds", [[0, 37], [0, 10, 37], [0, 1, 2, 20, 37], [0, 0, 37, 37]])
@pytest.mark.parametrize("causal", [False, True])
def test_combine_matches_full_attention(bounds, causal):
    q, k, v = randn(2, 3, 4, 32), randn(2, 37, 4, 32), randn(2, 37, 4, 32)
    op, lp = _split_attention(q, k, v, bounds, causal)
    out, lse = flash_attn_combine(op, lp, out_dtype=torch.float16)
    ref_hi, ref_lse = attention_ref(q, k, v, causal=causal)
    ref_lo, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    assert out.dtype == torch.float16 and out.shape == (2, 3, 4, 32)
    assert_close("combine out", out, ref_hi, ref_lo)
    assert_lse_close(lse.transpose(1, 2), ref_lse.float(), atol=1e-4)


def test_combine_empty_parts_ignored_even_nan():
    op = randn(3, 5, 16, dtype=torch.float32)
    lp = torch.randn(3, 5, device=DEVICE)
    lp[1] = float("-inf")
    op[1] = float("nan")  # an empty part's output is never read
    lp[:, 4] = float("-inf")  # a row where every part is empty
    out, lse = flash_attn_combine(op, lp)
    w = torch.softmax(lp[[0, 2], :4], dim=0)
    ref = (w[..., None] * op[[0, 2], :4]).sum(0)
    torch.testing.assert_close(out[:4], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:4], torch.logsumexp(lp[[0, 2], :4], dim=0))
    assert (out[4] == 0).all() and lse[4] == float("-inf")


def test_combine_is_associative():
    op = randn(4, 2, 3, 6, 64, dtype=torch.float32)
    lp = torch.randn(4, 2, 3, 6, device=DEVICE) * 3
    full, lse_full = flash_attn_combine(op, lp)
    a, la = flash_attn_combine(op[:2], lp[:2])
    b, lb = flash_attn_combine(op[2:], lp[2:])
    nested, lse_nested = flash_attn_combine(torch.stack([a, b]), torch.stack([la, lb]))
    torch.testing.assert_close(nested, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_nested, lse_full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [(7,), (2, 5), (2, 3, 4), (2, 2, 3, 2)])
def test_combine_any_row_shape(rows):
    op = randn(3, *rows, 24, dtype=torch.float32)
    lp = torch.randn(3, *rows, device=DEVICE)
    out, lse = flash_attn_combine(op, lp)
    w = torch.softmax(lp, dim=0)
    torch.testing.assert_close(out, (w[..., None] * op).sum(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(lp, dim=0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [24, 128])
def test_combine_many_parts(head_dim):
    """More parts than one step of the merge takes (8 at d=24, 4 at d=128), some of them empty
    (LSE -inf, output NaN: never read), one row empty in every part."""
    op = randn(41, 2, 9, head_dim, dtype=torch.float32)
    lp = torch.randn(41, 2, 9, device=DEVICE) * 3
    lp[::3] = float("-inf")
    op[::3] = float("nan")
    lp[:, 1, 4] = float("-inf")
    out, lse = flash_attn_combine(op, lp)
    w = torch.softmax(lp, dim=0).nan_to_num(0.0)
    ref = (w[..., None] * op.nan_to_num(0.0)).sum(0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(lp, dim=0), atol=1e-5, rtol=1e-5)
    assert (out[1, 4] == 0).all() and lse[1, 4] == float("-inf")


@pytest.mark.parametrize("case,exc,msg", [
    ("lse_shape", ValueError, "lse_partial: expected shape"),
    ("lse_dtype", TypeError, "lse_partial: expected dtype torch.float32"),
    ("out_dtype", TypeError, "out_dtype"),
    ("not_tensor", TypeError, "expected torch.Tensors"),
])
def test_combine_bad_inputs(case, exc, msg):
    op = randn(2, 3, 4, 16, dtype=torch.float32)
    lp = torch.zeros(2, 3, 4, device=DEVICE)
    kw = {}
    if case == "lse_shape":
        lp = lp[:, :2]
    elif case == "lse_dtype":
        lp = lp.half()
    elif case == "out_dtype":
        kw["out_dtype"] = torch.int32
    elif case == "not_tensor":
        lp = lp.tolist()
    with pytest.raises(exc, match=msg):
        flash_attn_combine(op, lp, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_combine_large(dtype):
    q, k, v = randn(4, 2, 16, 128, dtype=dtype), randn(4, 4099, 16, 128, dtype=dtype), \
        randn(4, 4099, 16, 128, dtype=dtype)
    bounds = [0, 1000, 1001, 3000, 4099]
    op, lp = _split_attention(q, k, v, bounds)
    out, lse = flash_attn_combine(op, lp, out_dtype=dtype)
    ref_hi, ref_lse = attention_ref(q, k, v)
    ref_lo, _ = attention_ref(q, k, v, upcast=False)
    assert_close("combine out", out, ref_hi, ref_lo)
    assert_lse_close(lse.transpose(1, 2), ref_lse.float(), atol=1e-4)
