"""Forward pass: flash_attn_func / flash_attn_varlen_func / attention against the one oracle.

CPU (interpreter): small shapes, fp16. GPU: bf16 + fp16 and the full grid of head dims and
sequence lengths. Every output is compared with ``assert_close`` (flash-attn's 2x rule).
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import (
    DEVICE,
    DTYPES,
    FEATURES,
    ON_GPU,
    ON_SM90,
    assert_close,
    assert_lse_close,
    feature_kwargs,
    gpu_grid,
    randn,
)

from solattn import attention, flash_attn_func, flash_attn_varlen_func
from solattn.reference import attention_ref, attention_varlen_ref

# (seqlen_q, seqlen_k) pairs: equal, q < k, q > k, 1-row decode-like, ragged tails.
if ON_GPU:
    SEQLENS = [
        (1, 1),
        (1, 1000),
        (17, 17),
        (17, 257),
        (128, 128),
        (257, 17),
        (257, 1000),
        (1000, 1000),
        (1000, 257),
        (128, 1),
    ]
    HEAD_DIMS = [
        (32, 32),
        (40, 40),
        (64, 64),
        (80, 80),
        (96, 96),
        (128, 128),
        (192, 192),
        (256, 256),
        (192, 128),
    ]
else:
    # (1, 1) and (17, 17): one block, as (1, 40) and (17, 40) run it; (32, 32): the other
    # tests' head dim
    SEQLENS = [*gpu_grid((1, 1)), (1, 40), *gpu_grid((17, 17)), (17, 40), (40, 17)]
    HEAD_DIMS = [*gpu_grid((32, 32)), (40, 40), (64, 48)]


def run_and_check(q, k, v, *, name="out", check_lse=True, **kw):
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    ref_lo, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert out.dtype == q.dtype
    assert_close(name, out, ref, ref_lo)
    if check_lse:
        assert_lse_close(lse, ref_lse.float())
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS)
def test_seqlens(seqlens, causal, dtype):
    s_q, s_k = seqlens
    q, k, v = (
        randn(2, s_q, 2, 64, dtype=dtype),
        randn(2, s_k, 2, 64, dtype=dtype),
        randn(2, s_k, 2, 64, dtype=dtype),
    )
    run_and_check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", HEAD_DIMS)
def test_head_dims(dims, causal, dtype):
    d, dv = dims
    s = 257 if ON_GPU else 33
    q, k, v = (
        randn(1, s, 3, d, dtype=dtype),
        randn(1, s, 3, d, dtype=dtype),
        randn(1, s, 3, dv, dtype=dtype),
    )
    run_and_check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seqlens",
    [*gpu_grid((40, 40)), (17, 45), *gpu_grid((45, 17))] + ([(257, 1000)] if ON_GPU else []),
)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature, seqlens, dtype):
    s_q, s_k = seqlens
    b, h = 2, 3
    q, k, v = (randn(b, s, h, 32, dtype=dtype) for s in (s_q, s_k, s_k))
    run_and_check(q, k, v, **feature_kwargs(feature, b, h))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(6, 2), (6, 1), *gpu_grid((4, 4))], ids=["gqa", "mqa", "mha"])
def test_gqa(heads, causal, dtype):
    h, h_kv = heads
    s = 129 if ON_GPU else 20
    q, k, v = (
        randn(2, s, h, 32, dtype=dtype),
        randn(2, s + 3, h_kv, 32, dtype=dtype),
        randn(2, s + 3, h_kv, 32, dtype=dtype),
    )
    run_and_check(q, k, v, causal=causal)


def test_fully_masked_rows_are_zero_not_nan():
    # window (0, -1)... with seqlen_q > seqlen_k and causal: the first s_q - s_k rows see nothing.
    q, k, v = randn(1, 20, 2, 32), randn(1, 5, 2, 32), randn(1, 5, 2, 32)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert not torch.isnan(out).any()
    assert torch.all(out[:, :15] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :15]))
    run_and_check(q, k, v, causal=True)


def _varlen_inputs(lens_q, lens_k, h, h_kv, d, dv, dtype):
    cu_q = torch.tensor(
        [0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=DEVICE
    )
    cu_k = torch.tensor(
        [0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=DEVICE
    )
    q = randn(int(cu_q[-1]), h, d, dtype=dtype)
    k = randn(int(cu_k[-1]), h_kv, d, dtype=dtype)
    v = randn(int(cu_k[-1]), h_kv, dv, dtype=dtype)
    return q, k, v, cu_q, cu_k


VARLEN_CASES = {
    "equal": ([5, 17, 1, 33], [5, 17, 1, 33]),
    "zero-length": ([0, 9, 0, 21, 3], [4, 0, 0, 21, 7]),
    "q-shorter": ([3, 1, 12], [20, 7, 30]),
    "q-longer": ([20, 7, 30], [3, 1, 12]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(causal=True),
        dict(window_size=(4, 2)),
        dict(causal=True, softcap=3.0, alibi=True),
    ],
    ids=["full", "causal", "local", "causal-softcap-alibi"],
)
@pytest.mark.parametrize("case", [*gpu_grid("equal"), "zero-length", *gpu_grid("q-shorter"),
                                  "q-longer"])
def test_varlen(case, kw, dtype):
    lens_q, lens_k = VARLEN_CASES[case]
    if ON_GPU:
        lens_q, lens_k = [n * 9 for n in lens_q], [n * 9 for n in lens_k]
    h, h_kv = 4, 2
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, h, h_kv, 32, 40, dtype)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(len(lens_q), h, device=DEVICE) * 0.3
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **kw
    )
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, **kw)
    ref_lo, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **kw)
    assert out.shape == (q.shape[0], h, 40) and lse.shape == (h, q.shape[0])
    assert_close("out", out, ref, ref_lo)
    assert_lse_close(lse, ref_lse.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["packed-qkv", "bhsd-transposed", "sliced-heads"])
def test_strided_inputs(layout, dtype):
    b, s, h, d = 2, (300 if ON_GPU else 30), 4, 32
    if layout == "packed-qkv":  # (b, s, 3, h, d) as produced by a fused QKV projection
        qkv = randn(b, s, 3, h, d, dtype=dtype)
        q, k, v = qkv.unbind(2)
    elif layout == "bhsd-transposed":  # SDPA layout viewed as flash-attn layout
        q, k, v = (randn(b, h, s, d, dtype=dtype).transpose(1, 2) for _ in range(3))
    else:  # every other head of a wider tensor, and a head-dim slice
        q = randn(b, s, 2 * h, d, dtype=dtype)[:, :, ::2]
        k = randn(b, s, h, 2 * d, dtype=dtype)[..., :d]
        v = randn(b, s, h, d, dtype=dtype)
    assert not q.is_contiguous()
    run_and_check(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape",
    [*gpu_grid((2, 4, 2, 33, 33)), (1, 4, 4, 17, 40), (1, 4, 1, 40, 17)],
    ids=["square-gqa", "q-shorter", "q-longer-mqa"],
)
def test_attention_matches_sdpa(shape, causal, dtype):
    b, h, h_kv, s_q, s_k = shape
    q = randn(b, h, s_q, 32, dtype=dtype)
    k, v = randn(b, h_kv, s_k, 32, dtype=dtype), randn(b, h_kv, s_k, 32, dtype=dtype)
    out = attention(q, k, v, is_causal=causal, enable_gqa=h != h_kv)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=h != h_kv
    )
    ref_lo = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=h != h_kv
    ).to(dtype)
    assert out.shape == (b, h, s_q, 32)
    assert_close("attention", out, ref, ref_lo)


def test_empty_inputs():
    q, k, v = randn(0, 5, 2, 32), randn(0, 5, 2, 32), randn(0, 5, 2, 32)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (0, 5, 2, 32) and lse.shape == (0, 2, 5)
    out = flash_attn_func(randn(2, 0, 2, 32), randn(2, 5, 2, 32), randn(2, 5, 2, 32))
    assert out.shape == (2, 0, 2, 32)
    # seqlen_k = 0: every row sees nothing -> zeros, lse -inf
    q = randn(2, 3, 2, 32)
    out, lse = flash_attn_func(q, randn(2, 0, 2, 32), randn(2, 0, 2, 32), return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.gpu
@pytest.mark.slow
def test_beyond_int32_offsets():
    """128k tokens x 130 heads x d128: 2.2e9 elements per tensor (> 2**31); a local window keeps
    the work small. Rows at the end of the sequence (offsets > 2**31) are checked on a few heads."""
    s, h, d = 131072, 130, 128
    assert s * h * d > 2**31
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    window = (127, 0)
    out = flash_attn_func(q, k, v, window_size=window)
    rows = slice(s - 200, s)
    keys = slice(s - 200 - 127, s)
    for head in (0, h - 1):
        sl = (slice(None), rows, slice(head, head + 1))
        slk = (slice(None), keys, slice(head, head + 1))
        ref, _ = attention_ref(q[sl], k[slk], v[slk], window_size=window)
        ref_lo, _ = attention_ref(q[sl], k[slk], v[slk], window_size=window, upcast=False)
        assert_close("out[-200:]", out[sl], ref, ref_lo)
    del q, k, v, out
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_default_scale_is_inverse_sqrt_d():
    q, k, v = (randn(1, 64, 2, 80, dtype=torch.bfloat16) for _ in range(3))
    a = flash_attn_func(q, k, v)
    b = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(80))
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["portable", "hopper"])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_output(causal, backend):
    """``out_dtype=torch.float32`` (ring attention's partial outputs): the same accumulator,
    stored unrounded; rounding it gives the default output bit for bit."""
    from solattn.core import attn_forward, make_params
    from solattn.dispatch import forced_backend

    if backend == "hopper" and not ON_SM90:
        pytest.skip("the Hopper kernel runs on sm_90 only")
    dtype = DTYPES[0]
    s_q, s_k, d = (200, 300, 128) if ON_GPU else (40, 70, 32)
    q = randn(2, s_q, 4, d, dtype=dtype)
    k, v = randn(2, s_k, 2, d, dtype=dtype), randn(2, s_k, 2, d, dtype=dtype)
    with forced_backend(backend):
        out32, lse32 = attn_forward(q, k, v, make_params(q, k, causal=causal,
                                                         out_dtype=torch.float32))
        out, lse = attn_forward(q, k, v, make_params(q, k, causal=causal))
    assert out32.dtype == torch.float32 and out.dtype == dtype
    assert torch.equal(out32.to(dtype), out)
    assert torch.equal(lse32, lse)
    ref, _ = attention_ref(q, k, v, causal=causal)
    assert (out32.double() - ref).abs().max() <= (out.double() - ref).abs().max()
