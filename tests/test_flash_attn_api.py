"""flash-attn 2.x's API surface beyond the three main functions: the packed variants
(``flash_attn_qkvpacked_func``, ``_kvpacked_func`` and their varlen twins), ``return_attn_probs``,
``return_softmax_lse`` and flash-attn's positional argument order, so code written for flash-attn
runs after the import swap.

Outputs and gradients go against the one oracle (:mod:`solattn.reference`, flash-attn's 2x rule);
the positional-order tests compare a positional call with the same call by keyword.
CPU (interpreter): fp16, small shapes. GPU: bf16 + fp16.
"""

from __future__ import annotations

import pytest
import torch
from oracle import DEVICE, DTYPES, ON_GPU, ON_SM90, assert_close, assert_lse_close, gpu_grid, randn
from test_backward import check_grads
from test_kvcache import kvcache_ref, make_cache
from test_paged_varlen import paged_cache

import solattn
from solattn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from solattn.reference import attention_ref, attention_varlen_ref

S = 200 if ON_GPU else 24
D = 128 if ON_GPU else 32  # (on an H100/H200: the Hopper backward, whose dK/dV go in place)
LENS = [37, 1, 150, 0, 64] if ON_GPU else [9, 1, 17, 0, 6]

# flash-attn 2.x keyword arguments the packed variants pass through (besides the inputs).
PACKED_FEATURES = {
    "full": dict(),
    "causal": dict(causal=True),
    "local-softcap": dict(window_size=(5, 2), softcap=4.0),
}


def _cu(lens):
    return torch.tensor([0] + list(lens), device=DEVICE).cumsum(0).to(torch.int32)


def _packed_call(api, h, h_kv, kw, deterministic):
    """``(fn, ref_fn, (q, k, v))`` for :func:`check_grads`: ``fn`` packs its q, k, v leaves
    (``torch.stack``) and calls the packed function ``api``, so their gradients are the slices
    of the packed gradient that function returns."""
    if api in ("qkvpacked", "kvpacked"):
        q, k, v = randn(2, S, h, D), randn(2, S, h_kv, D), randn(2, S, h_kv, D)

        def ref_fn(q, k, v, upcast):
            return attention_ref(q, k, v, upcast=upcast, **kw)

        if api == "qkvpacked":
            def fn(q, k, v):
                return flash_attn_qkvpacked_func(torch.stack((q, k, v), 2),
                                                 deterministic=deterministic, **kw)
        else:
            def fn(q, k, v):
                return flash_attn_kvpacked_func(q, torch.stack((k, v), 2),
                                                deterministic=deterministic, **kw)
        return fn, ref_fn, (q, k, v)
    cu = _cu(LENS)
    total, max_len = int(sum(LENS)), max(LENS)
    q, k, v = randn(total, h, D), randn(total, h_kv, D), randn(total, h_kv, D)

    def ref_fn(q, k, v, upcast):
        return attention_varlen_ref(q, k, v, cu, cu, upcast=upcast, **kw)

    if api == "varlen_qkvpacked":
        def fn(q, k, v):
            return flash_attn_varlen_qkvpacked_func(torch.stack((q, k, v), 1), cu, max_len,
                                                    deterministic=deterministic, **kw)
    else:
        def fn(q, k, v):
            return flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), 1), cu, cu, max_len,
                                                   max_len, deterministic=deterministic, **kw)
    return fn, ref_fn, (q, k, v)


# deterministic=True: the unpacked functions' backward, tested in test_backward.py
@pytest.mark.parametrize("deterministic", [False, *gpu_grid(True)])
@pytest.mark.parametrize("feature", list(PACKED_FEATURES))
@pytest.mark.parametrize("api,heads", [("qkvpacked", (4, 4)), ("kvpacked", (6, 2)),
                                       ("varlen_qkvpacked", (4, 4)),
                                       ("varlen_kvpacked", (6, 2))],
                         ids=["qkvpacked", "kvpacked-gqa", "varlen-qkvpacked",
                              "varlen-kvpacked-gqa"])
def test_packed_forward_and_grads(api, heads, feature, deterministic):
    fn, ref_fn, (q, k, v) = _packed_call(api, *heads, PACKED_FEATURES[feature], deterministic)
    check_grads(fn, ref_fn, q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_gradient_is_packed(dtype):
    """A packed leaf gets one gradient of its own shape; ``return_lse`` and ``sinks`` pass
    through (the lse of a call with sinks spans the sink column, as flash_attn_func's)."""
    qkv = randn(2, S, 3, 4, 32, dtype=dtype, requires_grad=True)
    sinks = torch.randn(4, device=DEVICE)
    out, lse = flash_attn_qkvpacked_func(qkv, causal=True, return_lse=True, sinks=sinks)
    ref_out, ref_lse = flash_attn_func(*(t.detach() for t in qkv.unbind(2)), causal=True,
                                       return_lse=True, sinks=sinks)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    out.float().sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape and qkv.grad.dtype == dtype
    assert torch.isfinite(qkv.grad).all() and torch.count_nonzero(qkv.grad[:, :, 2]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90,
                    reason="the Hopper backward needs sm_90")
@pytest.mark.parametrize("layout", ["qkv", "kv"])
def test_hopper_backward_writes_packed_grads_in_place(layout):
    """Given views of a packed gradient, the Hopper backward's TMA epilogue stores dK and dV
    into them (returns those very tensors), bitwise equal to the dK and dV it returns on its
    own; the packed functions' gradients then match the oracle (test_packed_forward_and_grads
    runs them at d=128 on the GPU)."""
    from solattn.core import attn_forward, make_params
    from solattn.kernels.hopper.backward_plan import attn_bwd

    b, s, h, d = 2, 300, 4, 128
    packed = randn(b, s, 3 if layout == "qkv" else 2, h, d, dtype=torch.bfloat16)
    if layout == "qkv":
        q, k, v = packed.unbind(2)
    else:
        q, (k, v) = randn(b, s, h, d, dtype=torch.bfloat16), packed.unbind(2)
    p = make_params(q, k, causal=True)
    out, lse = attn_forward(q, k, v, p)
    dout = torch.randn_like(out)
    _, dk_ref, dv_ref = attn_bwd(dout, q, k, v, out, lse, p)
    grad = torch.empty_like(packed)
    views = grad.unbind(2)
    _, dk, dv = attn_bwd(dout, q, k, v, out, lse, p, grads=(None, *views[-2:]))
    assert dk is views[-2] and dv is views[-1]
    assert torch.equal(dk, dk_ref) and torch.equal(dv, dv_ref)


@pytest.mark.parametrize("api", ["func", "varlen"])
def test_return_attn_probs(api):
    """flash-attn's ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``; S_dmask
    is None without dropout (as flash-attn's), the LSE is the oracle's; the 11th (varlen: 15th)
    positional argument is that flag, as in flash-attn."""
    if api == "func":
        q, k, v = randn(2, S, 4, 32), randn(2, S, 2, 32), randn(2, S, 2, 32)
        args = (q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False)
        ref, ref_lse = attention_ref(q, k, v, causal=True)
        ref_lo, _ = attention_ref(q, k, v, causal=True, upcast=False)
        call, inputs = flash_attn_func, args[:3]
    else:
        cu = _cu(LENS)
        total = int(sum(LENS))
        q, k, v = randn(total, 4, 32), randn(total, 2, 32), randn(total, 2, 32)
        args = (q, k, v, cu, cu, max(LENS), max(LENS), 0.0, None, True, (-1, -1), 0.0, None,
                False)
        ref, ref_lse = attention_varlen_ref(q, k, v, cu, cu, causal=True)
        ref_lo, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True, upcast=False)
        call, inputs = flash_attn_varlen_func, args[:7]
    for res in (call(*args, return_attn_probs=True), call(*args, True)):
        assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
        assert_close("out", res[0], ref, ref_lo)
        assert_lse_close(res[1], ref_lse.float())
    # with dropout, S_dmask (its values: test_dropout.py::test_attn_probs_s_dmask*)
    s_dmask = call(*inputs, dropout_p=0.1, return_attn_probs=True)[2]
    assert s_dmask.shape == ((2, 4, S, S) if api == "func" else (len(LENS), 4, max(LENS),
                                                                max(LENS)))


def test_varlen_block_table_is_flash_attns_sixteenth_argument():
    """flash-attn 2.6 passes ``block_table`` after ``return_attn_probs``: a positional paged
    call gives the keyword call's output."""
    lens = [9, 30]
    k_cache, v_cache, table, _, _ = paged_cache(lens, 16, 2, 32, 32, torch.float16)
    cu_k = _cu(lens)
    cu_q = _cu([1, 5])
    q = randn(6, 4, 32)
    positional = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, max(lens), 0.0,
                                        None, True, (-1, -1), 0.0, None, False, False, table)
    keyword = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, max(lens),
                                     causal=True, block_table=table)
    assert torch.equal(positional, keyword)


def test_kvcache_positional_order_and_return_softmax_lse():
    """flash-attn 2.x's order after ``softcap``: ``rotary_interleaved, alibi_slopes,
    num_splits, return_softmax_lse``; ``return_softmax_lse`` (flash-attn's name) and
    ``return_lse`` both return the oracle's LSE."""
    lens = [20, 7]
    kc = make_cache(2, 32, 2, 32, torch.float16, {0: (0, 20), 1: (0, 7)})
    vc = make_cache(2, 32, 2, 32, torch.float16, {0: (0, 20), 1: (0, 7)})
    q = randn(2, 1, 4, 32)
    slopes = torch.rand(4, device=DEVICE) * 0.3
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out_hi, lse_hi, out_lo, _, _ = kvcache_ref(q, kc, vc, None, None, lens, causal=True,
                                               alibi_slopes=slopes)
    positional = flash_attn_with_kvcache(q, kc, vc, None, None, None, None, seqlens, None, None,
                                         None, None, True, (-1, -1), 0.0, True, slopes, 2, True)
    by_name = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                      alibi_slopes=slopes, num_splits=2,
                                      return_softmax_lse=True)
    ours = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                   alibi_slopes=slopes, num_splits=2, return_lse=True)
    for out, lse in (positional, by_name, ours):
        assert_close("out", out, out_hi, out_lo)
        assert_lse_close(lse, lse_hi)


PACKED_BAD = {
    "qkv-rank": (lambda: flash_attn_qkvpacked_func(randn(2, 8, 4, 32)), ValueError,
                 r"qkv: expected a 5-D tensor of shape \(batch, seqlen, 3, nheads, headdim\), "
                 r"got shape \(2, 8, 4, 32\)"),
    "qkv-parts": (lambda: flash_attn_qkvpacked_func(randn(2, 8, 2, 4, 32)), ValueError,
                  r"qkv: expected shape\[2\] \(the packed q, k, v\) = 3, got 2"),
    "kv-parts": (lambda: flash_attn_kvpacked_func(randn(2, 8, 4, 32), randn(2, 8, 3, 2, 32)),
                 ValueError, r"kv: expected shape\[2\] \(the packed k, v\) = 2, got 3"),
    "varlen-qkv-rank": (lambda: flash_attn_varlen_qkvpacked_func(randn(2, 8, 3, 4, 32), _cu([8]),
                                                                 8),
                        ValueError, r"qkv: expected a 4-D tensor of shape \(total, 3, nheads, "
                                    r"headdim\)"),
    "varlen-kv-type": (lambda: flash_attn_varlen_kvpacked_func(randn(8, 4, 32), None, _cu([8]),
                                                               _cu([8]), 8, 8),
                       TypeError, r"kv: expected a torch.Tensor, got NoneType"),
}


@pytest.mark.parametrize("case", list(PACKED_BAD))
def test_packed_bad_inputs(case):
    call, exc, pattern = PACKED_BAD[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_packed_names_exported():
    for name in ("flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"):
        assert name in solattn.__all__ and callable(getattr(solattn, name))
