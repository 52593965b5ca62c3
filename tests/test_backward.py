"""Backward pass: dQ, dK, dV (and dLSE) through every public API against the one oracle.

Each test runs solattn's forward + backward and the float64 oracle's autograd on the same inputs
and output gradient, then applies flash-attn's rule with ``assert_close``: the error of solattn's
gradient must be within 2x the error of PyTorch's own low-precision autograd (plus eps).

CPU (interpreter): small shapes, fp16. GPU: bf16 + fp16, larger shapes and head dims, the
deterministic bitwise test at a size where atomics race, and peak memory linear in seqlen.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oracle import (
    DEVICE,
    DTYPES,
    FEATURES,
    ON_GPU,
    assert_close,
    feature_kwargs,
    gpu_grid,
    oracle_grads,
    randn,
    random_loss,
)

from solattn import attention, flash_attn_func, flash_attn_varlen_func
from solattn.reference import attention_ref, attention_varlen_ref

GRADS = ("dq", "dk", "dv")


def _leaves(*ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in ts]


def check_grads(fn, ref_fn, q, k, v, *, with_lse=False, factor=2.0):
    """Run ``fn(q, k, v) -> out or (out, lse)`` and compare its gradients with the oracle's
    (``factor``: :func:`oracle.assert_close`'s multiple of PyTorch's own error)."""
    qs, ks, vs = _leaves(q, k, v)
    res = fn(qs, ks, vs)
    out, lse = res if with_lse else (res, None)
    loss, dout, dlse = random_loss(out, lse)
    grads = torch.autograd.grad(loss, (qs, ks, vs))
    hi = oracle_grads(ref_fn, q, k, v, dout, upcast=True, dlse=dlse)
    lo = oracle_grads(ref_fn, q, k, v, dout, upcast=False, dlse=dlse)
    for name, g, g_hi, g_lo in zip(GRADS, grads, hi, lo):
        assert g.dtype == q.dtype and g.shape == g_hi.shape
        assert_close(name, g, g_hi, g_lo, factor=factor)
    return grads


def check_func(q, k, v, deterministic=False, with_lse=False, **kw):
    def fn(q, k, v):
        return flash_attn_func(q, k, v, deterministic=deterministic, return_lse=with_lse, **kw)

    def ref_fn(q, k, v, upcast):
        return attention_ref(q, k, v, upcast=upcast, **kw)

    return check_grads(fn, ref_fn, q, k, v, with_lse=with_lse)


def qkv(b, s_q, s_k, h, h_kv, d, dv, dtype):
    return (randn(b, s_q, h, d, dtype=dtype), randn(b, s_k, h_kv, d, dtype=dtype),
            randn(b, s_k, h_kv, dv, dtype=dtype))


if ON_GPU:
    SEQLENS = [(1, 1), (1, 300), (17, 17), (113, 257), (257, 113), (1000, 1000), (128, 128)]
    HEAD_DIMS = [(32, 32), (64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256)]
    FEAT_SEQLENS = [(200, 200), (113, 300), (300, 113)]
else:
    # (1, 1) and (17, 17): one block, as (1, 33) and (17, 40) run it; (32, 32): the other
    # tests' head dim; (40, 40): the features' masks at s_q == s_k are test_forward's
    SEQLENS = [*gpu_grid((1, 1)), (1, 33), *gpu_grid((17, 17)), (17, 40), (40, 17)]
    HEAD_DIMS = [*gpu_grid((32, 32)), (40, 40), (64, 48)]
    FEAT_SEQLENS = [*gpu_grid((40, 40)), (17, 45)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS)
def test_grad_seqlens(seqlens, causal, dtype):
    s_q, s_k = seqlens
    check_func(*qkv(2, s_q, s_k, 2, 2, 64 if ON_GPU else 32, 64 if ON_GPU else 32, dtype),
               causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", HEAD_DIMS)
def test_grad_head_dims(dims, causal, dtype):
    d, dv = dims
    s = 257 if ON_GPU else 33
    check_func(*qkv(1, s, s, 2, 2, d, dv, dtype), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlens", FEAT_SEQLENS)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_grad_features(feature, seqlens, dtype):
    s_q, s_k = seqlens
    b, h = 2, 3
    check_func(*qkv(b, s_q, s_k, h, h, 32, 32, dtype), **feature_kwargs(feature, b, h))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature", ["causal-local", "softcap-alibi-local", "alibi-batch-causal"])
def test_grad_features_deterministic(feature, dtype):
    """The deterministic path (dQ in its own kernel) over the features' mask/score code."""
    b, h = 2, 3
    check_func(*qkv(b, 40, 45, h, h, 32, 32, dtype), deterministic=True,
               **feature_kwargs(feature, b, h))


@pytest.mark.parametrize("dtype", DTYPES)
# The group summation is the same code with and without the causal mask (a constexpr of its
# own, which test_grad_seqlens covers): the interpreter keeps each dQ strategy once, one with
# the mask and one without; the GPU suite runs the four.
@pytest.mark.parametrize("causal,deterministic", [
    (False, False), (True, True),
    *[pytest.param(c, d, marks=pytest.mark.gpu_grid) for c, d in ((False, True), (True, False))],
])
@pytest.mark.parametrize("heads", [(6, 2), *gpu_grid((6, 1))], ids=["gqa", "mqa"])
def test_grad_gqa(heads, causal, deterministic, dtype, atomic_dq):
    """dK/dV are summed over each group's query heads (no repeated K/V); dQ by atomics or by
    its own kernel (deterministic)."""
    h, h_kv = heads
    s = 200 if ON_GPU else 33
    check_func(*qkv(2, s, s + 7, h, h_kv, 32, 32, dtype), causal=causal,
               deterministic=deterministic)
    assert bool(atomic_dq) == deterministic


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(4, 2))],
                         ids=["full", "causal", "local"])
def test_grad_lse(kw, dtype):
    """A loss that uses the returned lse gets the exact gradient (lse rows of -inf ignored)."""
    check_func(*qkv(2, 45, 30, 2, 1, 32, 32, dtype), with_lse=True, **kw)


VARLEN_CASES = {
    "ragged": ([5, 17, 1, 33], [9, 17, 30, 2]),
    "zero-length": ([0, 12, 0, 7], [4, 0, 0, 19]),
    "long": ([300, 45, 129], [200, 300, 1]) if ON_GPU else ([40, 3], [21, 40]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kw", [*gpu_grid(dict()), dict(causal=True),
                                dict(window_size=(4, 2), softcap=3.0)],
                         ids=["full", "causal", "local-softcap"])
@pytest.mark.parametrize("case", [*gpu_grid("ragged"), *list(VARLEN_CASES)[1:]])
def test_grad_varlen(case, kw, deterministic, dtype, atomic_dq):
    lens_q, lens_k = VARLEN_CASES[case]
    h, h_kv, d = 4, 2, 32
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).to(torch.int32)
    q = randn(sum(lens_q), h, d, dtype=dtype)
    k, v = randn(sum(lens_k), h_kv, d, dtype=dtype), randn(sum(lens_k), h_kv, d, dtype=dtype)

    def fn(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                      deterministic=deterministic, **kw)

    def ref_fn(q, k, v, upcast):
        return attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=upcast, **kw)

    check_grads(fn, ref_fn, q, k, v)
    assert bool(atomic_dq) == deterministic


def test_grad_varlen_rows_past_the_last_sequence_are_zero():
    """Packed rows after cu_seqlens[-1] belong to no sequence: their gradient is exactly 0."""
    q, k, v = randn(20, 2, 32), randn(20, 2, 32), randn(20, 2, 32)
    cu = torch.tensor([0, 5, 12], device=DEVICE, dtype=torch.int32)
    qs, ks, vs = _leaves(q, k, v)
    out = flash_attn_varlen_func(qs, ks, vs, cu, cu, 7, 7)
    out[:12].float().sum().backward()
    for g in (qs.grad, ks.grad, vs.grad):
        assert torch.isfinite(g).all()
        assert torch.count_nonzero(g[12:]) == 0
        assert torch.count_nonzero(g[:12]) > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["packed-qkv", "bhsd-transposed", "sliced-heads"])
def test_grad_strided_inputs(layout, dtype):
    """Arbitrary strides in q, k, v and in the incoming gradient."""
    b, s, h, d = 2, 37, 3, 32
    if layout == "packed-qkv":
        qkv_ = randn(b, s, 3, h, d, dtype=dtype)
        q, k, v = qkv_.unbind(2)
    elif layout == "bhsd-transposed":
        q, k, v = (randn(b, h, s, d, dtype=dtype).transpose(1, 2) for _ in range(3))
    else:
        q, k, v = (randn(b, s, 2 * h, d, dtype=dtype)[:, :, ::2] for _ in range(3))
    check_func(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [*gpu_grid((2, 4, 2, 33, 33)), (1, 4, 4, 17, 40),
                                   (1, 4, 1, 40, 17)],
                         ids=["gqa-square", "q-shorter", "mqa-q-longer"])
def test_grad_attention_matches_sdpa(shape, causal, dtype):
    """``attention`` (SDPA layout, top-left causal) against SDPA's math written out in torch."""
    b, h, h_kv, s_q, s_k = shape
    q = randn(b, h, s_q, 32, dtype=dtype)
    k, v = randn(b, h_kv, s_k, 32, dtype=dtype), randn(b, h_kv, s_k, 32, dtype=dtype)

    def fn(q, k, v):
        return attention(q, k, v, is_causal=causal, enable_gqa=True)

    def ref_fn(q, k, v, upcast):
        # SDPA's math path, in float64 or in the input dtype (the low-precision twin)
        k, v = (t.repeat_interleave(h // h_kv, dim=1) for t in (k, v))
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if causal:  # top-left aligned: query i sees keys j <= i (never an empty row)
            ok = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
            s = s.masked_fill(~ok, float("-inf"))
        return torch.softmax(s, dim=-1) @ v, None

    check_grads(fn, ref_fn, q, k, v)


def test_fully_masked_rows_have_zero_grad_not_nan():
    """Causal with seqlen_q > seqlen_k: the first queries see no key (output 0, lse -inf)."""
    q, k, v = qkv(1, 40, 10, 2, 2, 32, 32, torch.float16)
    grads = check_func(q, k, v, causal=True, with_lse=True)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.count_nonzero(grads[0][:, :30]) == 0


def test_empty_inputs_backward():
    for s_q, s_k in ((0, 5), (5, 0)):
        q, k, v = _leaves(*qkv(2, s_q, s_k, 2, 2, 32, 32, torch.float16))
        out = flash_attn_func(q, k, v)
        out.float().sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
        assert torch.count_nonzero(k.grad) == 0 and torch.count_nonzero(v.grad) == 0


def test_alibi_slopes_requiring_grad_raise():
    q, k, v = qkv(1, 8, 8, 2, 2, 32, 32, torch.float16)
    slopes = torch.rand(2, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=slopes)


def _grads_bits(deterministic, **kw):
    torch.manual_seed(1)
    b, s, h, d = (2, 1031, 8, 64) if ON_GPU else (1, 45, 2, 32)
    q, k, v = _leaves(*qkv(b, s, s, h, h // 2, d, d, DTYPES[0]))
    out = flash_attn_func(q, k, v, deterministic=deterministic, **kw)
    out.backward(torch.randn_like(out))
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_is_bitwise_reproducible(causal):
    first = _grads_bits(True, causal=causal)
    for _ in range(3 if ON_GPU else 1):
        again = _grads_bits(True, causal=causal)
        for name, a, b in zip(GRADS, first, again):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} changed"


def test_deterministic_and_default_agree(atomic_dq):
    """Both dQ strategies (its own kernel; fp32 atomics) compute the same gradient up to the
    summation order."""
    det = _grads_bits(True)
    assert len(atomic_dq) == 1
    fast = _grads_bits(False)
    assert len(atomic_dq) == 1
    for name, a, b in zip(GRADS, det, fast):
        scale = a.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * scale, name


@pytest.mark.gpu
def test_memory_linear_in_seqlen():
    """Peak memory of forward + backward grows linearly (no N x N buffer): 8x the tokens costs
    about 8x the memory, not 64x."""
    def peak(s):
        torch.cuda.empty_cache()
        q, k, v = _leaves(*qkv(1, s, s, 8, 8, 128, 128, torch.bfloat16))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = flash_attn_func(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - base
        del q, k, v, out
        return used

    peak(1024)  # warm up (compilation, allocator)
    small, large = peak(4096), peak(32768)
    ratio = large / small
    assert ratio < 10, f"peak memory grew {ratio:.1f}x for 8x the tokens ({small} -> {large} B)"
    # An N x N fp32 score matrix at 32k tokens and 8 heads alone would be 32 GiB.
    assert large < 2 * 1024**3, f"peak memory {large / 2**20:.0f} MiB at 32k tokens"


@pytest.mark.parametrize("atomic_dq", [False, True], ids=["dq-kernel", "atomic-dq"])
@pytest.mark.parametrize("split_dkdv", [False, True], ids=["fused-dkdv", "split-dkdv"])
def test_grad_every_kernel_strategy(split_dkdv, atomic_dq, monkeypatch, fresh_plans):
    """Each (dQ strategy, dK/dV split) the config table can pick gives oracle-close gradients."""
    from solattn import configs

    if ON_GPU:
        cfg = dataclasses.replace(configs.bwd_config(90, 64, 64), atomic_dq=atomic_dq,
                                  split_dkdv=split_dkdv)
        monkeypatch.setattr(configs, "bwd_config", lambda *a, **k: cfg)
    else:
        monkeypatch.setattr(configs.portable, "_BWD_INTERPRET", dataclasses.replace(
            configs.portable._BWD_INTERPRET, atomic_dq=atomic_dq, split_dkdv=split_dkdv))
    b, h = 2, 3
    check_func(*qkv(b, 45, 40, h, 1, 64, 64, DTYPES[0]), causal=True, softcap=4.0,
               alibi_slopes=torch.rand(h, device=DEVICE) * 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("s_q,s_k,routed", [(1, 4097, True), (6, 600, True), (16, 9000, True),
                                            (200, 700, False)])
def test_few_query_rows_run_the_decode_kernels(s_q, s_k, routed, monkeypatch):
    """flash_attn_func calls of few query rows (configs.small_q_decode) run their forward on
    the decode kernels (the decode route of solattn.dispatch.FORWARD); output, LSE and the
    backward's gradients are the oracle's."""
    import solattn.kernels.triton.decode as decode

    calls = []
    real = decode.decode_forward
    monkeypatch.setattr(decode, "decode_forward", lambda *a: calls.append(1) or real(*a))
    q, k, v = qkv(1, s_q, s_k, 4, 2, 128, 128, torch.bfloat16)
    check_func(q, k, v, causal=True, with_lse=True)
    assert bool(calls) is routed
