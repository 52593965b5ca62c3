"""Attention sinks: ``flash_attn_*(..., sinks=)`` (:func:`solattn.sinks.apply_sinks` on the LSE).

Forward (out, lse) and backward (dq, dk, dv and d sinks) against a float64 oracle that appends
the sink column to the score matrix (``solattn.reference``, ``sinks=``), with flash-attn's 2x
rule: the error of solattn with sinks must be within twice the error of the same oracle run in
the input dtype.
"""

from __future__ import annotations

import pytest
import torch
from oracle import DEVICE, DTYPES, ON_GPU, assert_close, assert_lse_close, gpu_grid, randn

from solattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from solattn.reference import attention_ref, attention_varlen_ref
from solattn.sinks import apply_sinks

# name -> flash_attn_func keyword arguments (all with GQA: 4 query heads over 2 kv heads)
CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-window": dict(causal=True, window_size=(5, 0)),
    "window-softcap": dict(window_size=(4, 3), softcap=5.0),
}
# CPU: (17, 17) runs the blocks (9, 30) and (30, 9) run
SEQLENS = ([*gpu_grid((17, 17)), (9, 30), (30, 9)] if not ON_GPU
           else [(113, 113), (1, 257), (257, 113)])


def _sinks(h, dtype):
    """Mixed sink logits: a large one (dominates its rows), a tiny one (no effect), two usual."""
    return torch.tensor([4.0, -30.0, 0.5, -1.0], device=DEVICE)[:h].to(dtype)


def _leaves(*ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in ts]


def _check_grads(g, g_hi, g_lo, dtype):
    """2x rule per gradient. ``dsinks`` is a reduction over all b * s_q rows of a head into a few
    numbers, so the twin's max error is a sample of 4 and can be small by luck: its eps is one
    ``dtype`` ulp of the largest value (the rounding of ``out`` to ``dtype`` alone costs that)."""
    for name, a, a_hi, a_lo in zip(("dq", "dk", "dv", "dsinks"), g, g_hi, g_lo):
        eps = 1e-5
        if name == "dsinks":
            eps = torch.finfo(dtype).eps * a_hi.abs().max().item()
        assert_close(name, a, a_hi, a_lo, eps=eps)


def _grads(outs, leaves, dout, dlse):
    out, lse = outs
    loss = (out.double() * dout.double()).sum()
    loss = loss + (lse.double() * dlse.double()).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink_dtype", ["float32", *gpu_grid("input")])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", list(CASES))
def test_sinks_fwd_bwd(case, seqlens, sink_dtype, dtype):
    kw = CASES[case]
    s_q, s_k = seqlens
    b, h, h_kv, d = 2, 4, 2, 32
    q, k, v = randn(b, s_q, h, d, dtype=dtype), randn(b, s_k, h_kv, d, dtype=dtype), \
        randn(b, s_k, h_kv, d, dtype=dtype)
    sinks = _sinks(h, torch.float32 if sink_dtype == "float32" else dtype)

    leaves = _leaves(q, k, v, sinks)
    out_s, lse_s = flash_attn_func(*leaves[:3], return_lse=True, sinks=leaves[3], **kw)
    assert out_s.dtype == dtype and lse_s.dtype == torch.float32

    hi_leaves = _leaves(q, k, v, sinks, dtype=torch.float64)
    lo_leaves = _leaves(q, k, v, sinks)
    hi = attention_ref(*hi_leaves[:3], sinks=hi_leaves[3], upcast=True, **kw)
    lo = attention_ref(*lo_leaves[:3], sinks=lo_leaves[3], upcast=False, **kw)
    assert_close("out", out_s, hi[0], lo[0])
    assert_lse_close(lse_s, hi[1].float())

    dout, dlse = torch.randn_like(out_s), torch.randn_like(lse_s)
    g = _grads((out_s, lse_s), leaves, dout, dlse)
    g_hi = _grads(hi, hi_leaves, dout, dlse)
    g_lo = _grads(lo, lo_leaves, dout, dlse)
    assert [a.dtype for a in g] == [t.dtype for t in leaves]
    _check_grads(g, g_hi, g_lo, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_varlen(dtype):
    """Packed batch with an empty query sequence and rows that see no key (window on s_q > s_k):
    those rows attend only to their sink (out 0, lse = sink)."""
    h, h_kv, d = 4, 2, 32
    cu_q = torch.tensor([0, 13, 13, 30], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 7, 19, 40], dtype=torch.int32, device=DEVICE)
    kw = dict(causal=True, window_size=(3, 0), softcap=0.0)
    q = randn(30, h, d, dtype=dtype)
    k, v = randn(40, h_kv, d, dtype=dtype), randn(40, h_kv, d, dtype=dtype)
    sinks = _sinks(h, torch.float32)

    leaves = _leaves(q, k, v, sinks)
    _, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 21, return_lse=True, **kw)
    out_s, lse_s = flash_attn_varlen_func(*leaves[:3], cu_q, cu_k, 17, 21, return_lse=True,
                                          sinks=leaves[3], **kw)

    hi_leaves = _leaves(q, k, v, sinks, dtype=torch.float64)
    lo_leaves = _leaves(q, k, v, sinks)
    hi = attention_varlen_ref(*hi_leaves[:3], cu_q, cu_k, sinks=hi_leaves[3], upcast=True,
                              **kw)
    lo = attention_varlen_ref(*lo_leaves[:3], cu_q, cu_k, sinks=lo_leaves[3], upcast=False,
                              **kw)
    assert_close("out", out_s, hi[0], lo[0])
    assert_lse_close(lse_s, hi[1].float())
    empty = torch.isinf(lse)  # rows of sequence 0 (13 queries over 7 keys) see no key
    assert empty.any() and not torch.isinf(lse_s).any()
    assert torch.equal(lse_s[empty], sinks.expand(30, h).T[empty])

    dout, dlse = torch.randn_like(out_s), torch.randn_like(lse_s)
    g = _grads((out_s, lse_s), leaves, dout, dlse)
    g_hi = _grads(hi, hi_leaves, dout, dlse)
    g_lo = _grads(lo, lo_leaves, dout, dlse)
    _check_grads(g, g_hi, g_lo, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_kvcache(dtype):
    """Decode over a cache: ``flash_attn_with_kvcache(..., sinks=)``."""
    b, h, h_kv, d, cap = 2, 4, 2, 32, 24
    k_cache = randn(b, cap, h_kv, d, dtype=dtype)
    v_cache = randn(b, cap, h_kv, d, dtype=dtype)
    lens = torch.tensor([5, 19], dtype=torch.int32, device=DEVICE)
    q = randn(b, 1, h, d, dtype=dtype)
    sinks = _sinks(h, dtype)
    out_s, lse_s = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                           return_lse=True, sinks=sinks)
    for i, n in enumerate(lens.tolist()):
        qkv = (q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n])
        hi = attention_ref(*qkv, causal=True, sinks=sinks)
        lo = attention_ref(*qkv, causal=True, sinks=sinks, upcast=False)
        assert_close("out", out_s[i:i + 1], hi[0], lo[0])
        assert_lse_close(lse_s[i:i + 1], hi[1].float())


def test_sinks_neg_inf_no_nan():
    """A -inf sink is no sink; with an empty row as well the row stays 0 (never NaN)."""
    out = torch.randn(1, 3, 2, 8, dtype=torch.float16, device=DEVICE)
    lse = torch.tensor([[[0.5, float("-inf"), 1.0], [float("-inf"), 2.0, 0.0]]], device=DEVICE)
    sinks = torch.tensor([float("-inf"), float("-inf")], device=DEVICE)
    out_s, lse_s = apply_sinks(out, lse, sinks)
    assert not torch.isnan(out_s).any()
    finite = ~torch.isinf(lse)
    assert torch.equal(lse_s, lse)
    assert torch.equal(out_s.permute(0, 2, 1, 3)[finite], out.permute(0, 2, 1, 3)[finite])
    assert (out_s.permute(0, 2, 1, 3)[~finite] == 0).all()


@pytest.mark.parametrize("bad, match", [
    (dict(layout="bhsd"), "layout: expected one of"),
    (dict(lse=torch.zeros(2, 3, 4)), r"lse: expected shape \(2, 4, 3\)"),
    (dict(lse=torch.zeros(2, 4, 3, dtype=torch.float16)), "lse: expected dtype torch.float32"),
    (dict(sinks=torch.zeros(3)), r"sinks: expected shape \(4,\)"),
    (dict(sinks=torch.zeros(4, dtype=torch.bfloat16)), "sinks: expected dtype torch.float32 or"),
    (dict(out=torch.zeros(2, 3, 4)), "out: expected a 4-D tensor"),
    (dict(sinks=[0.0] * 4), "sinks: expected a torch.Tensor"),
])
def test_apply_sinks_validation(bad, match):
    args = dict(out=torch.zeros(2, 3, 4, 8, dtype=torch.float16), lse=torch.zeros(2, 4, 3),
                sinks=torch.zeros(4), layout="bshd")
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        apply_sinks(args["out"], args["lse"], args["sinks"], layout=args["layout"])
