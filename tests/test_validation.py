"""Every bad input gets a ValueError/TypeError naming the argument, before any kernel launch."""

from __future__ import annotations

import pytest
import torch
from oracle import DEVICE, ON_GPU, randn

from solattn import attention, flash_attn_func, flash_attn_varlen_func


def good(b=2, s=8, h=4, h_kv=2, d=32):
    return randn(b, s, h, d), randn(b, s, h_kv, d), randn(b, s, h_kv, d)


BATCHED_CASES = {
    "batch-mismatch": (
        lambda: (randn(2, 8, 4, 32), randn(3, 8, 2, 32), randn(3, 8, 2, 32)),
        {},
        ValueError,
        r"k: expected batch",
    ),
    "seqlen-k-v-mismatch": (
        lambda: (randn(2, 8, 4, 32), randn(2, 8, 2, 32), randn(2, 9, 2, 32)),
        {},
        ValueError,
        r"v: expected seqlen_k .* = 8, got 9",
    ),
    "heads-kv-mismatch": (
        lambda: (randn(2, 8, 4, 32), randn(2, 8, 2, 32), randn(2, 8, 1, 32)),
        {},
        ValueError,
        r"v: expected nheads_kv .* = 2, got 1",
    ),
    "headdim-mismatch": (
        lambda: (randn(2, 8, 4, 32), randn(2, 8, 2, 64), randn(2, 8, 2, 32)),
        {},
        ValueError,
        r"k: expected headdim .* = 32, got 64",
    ),
    "heads-not-multiple": (
        lambda: (randn(2, 8, 4, 32), randn(2, 8, 3, 32), randn(2, 8, 3, 32)),
        {},
        ValueError,
        r"k: expected nheads_kv to divide nheads_q = 4",
    ),
    "dtype-fp32": (
        lambda: (randn(2, 8, 4, 32).float(), randn(2, 8, 2, 32), randn(2, 8, 2, 32)),
        {},
        TypeError,
        r"q: expected dtype torch.float16 or torch.bfloat16, got torch.float32",
    ),
    "dtype-mixed": (
        lambda: (randn(2, 8, 4, 32), randn(2, 8, 2, 32).bfloat16(), randn(2, 8, 2, 32)),
        {},
        TypeError,
        r"k: expected dtype torch.float16 .*, got torch.bfloat16",
    ),
    "headdim-too-big": (
        lambda: (randn(1, 8, 2, 288), randn(1, 8, 2, 288), randn(1, 8, 2, 288)),
        {},
        ValueError,
        r"q: expected head dim in \[1, 256\], got 288",
    ),
    "3d-q": (
        lambda: (randn(8, 4, 32), randn(2, 8, 2, 32), randn(2, 8, 2, 32)),
        {},
        ValueError,
        r"q: expected a 4-D tensor .* got shape \(8, 4, 32\)",
    ),
    "not-a-tensor": (
        lambda: ([1.0], randn(2, 8, 2, 32), randn(2, 8, 2, 32)),
        {},
        TypeError,
        r"q: expected a torch.Tensor, got list",
    ),
    "negative-softcap": (good, dict(softcap=-1.0), ValueError, r"softcap: expected softcap >= 0"),
    "window-below-minus-one": (
        good,
        dict(window_size=(-2, 0)),
        ValueError,
        r"window_size: expected each of \(left, right\) >= -1",
    ),
    "window-not-pair": (good, dict(window_size=(3,)), TypeError, r"window_size: expected a pair"),
    "alibi-shape": (
        good,
        dict(alibi_slopes=torch.rand(3, device=DEVICE)),
        ValueError,
        r"alibi_slopes: expected shape \(4,\) or \(2, 4\), got \(3,\)",
    ),
    "alibi-dtype": (
        good,
        dict(alibi_slopes=torch.rand(4, device=DEVICE).half()),
        TypeError,
        r"alibi_slopes: expected dtype torch.float32, got torch.float16",
    ),
    "alibi-grad": (
        good,
        dict(alibi_slopes=torch.rand(4, device=DEVICE).requires_grad_()),
        ValueError,
        r"alibi_slopes: gradients .* not supported",
    ),
    "dropout-one": (good, dict(dropout_p=1.0), ValueError,
                    r"dropout_p: expected 0 <= dropout_p < 1, got 1.0"),
    "dropout-negative": (good, dict(dropout_p=-0.1), ValueError,
                         r"dropout_p: expected 0 <= dropout_p < 1, got -0.1"),
    "dropout-type": (good, dict(dropout_p="0.1"), TypeError,
                     r"dropout_p: expected a float in \[0, 1\), got str"),
}


@pytest.mark.parametrize("case", list(BATCHED_CASES))
def test_batched_bad_inputs(case):
    make, kw, exc, pattern = BATCHED_CASES[case]
    q, k, v = make()
    with pytest.raises(exc, match=pattern):
        flash_attn_func(q, k, v, **kw)


def _varlen(lens=(3, 5)):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    t = int(cu[-1])
    return randn(t, 4, 32), randn(t, 2, 32), randn(t, 2, 32), cu


def test_varlen_cu_seqlens_dtype():
    q, k, v, cu = _varlen()
    with pytest.raises(
        TypeError, match=r"cu_seqlens_q: expected dtype torch.int32, got torch.int64"
    ):
        flash_attn_varlen_func(q, k, v, cu.long(), cu, 5, 5)


@pytest.mark.skipif(ON_GPU, reason="values of CUDA index tensors are not read (a read would "
                    "synchronize every call)")
def test_varlen_cu_seqlens_decreasing():
    q, k, v, cu = _varlen()
    bad = torch.tensor([0, 5, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: expected non-decreasing values"):
        flash_attn_varlen_func(q, k, v, cu, bad, 5, 5)


def test_varlen_cu_seqlens_length_mismatch():
    q, k, v, cu = _varlen()
    with pytest.raises(ValueError, match=r"cu_seqlens_k: expected length .* = 3, got 2"):
        flash_attn_varlen_func(q, k, v, cu, cu[:2], 5, 5)


@pytest.mark.skipif(ON_GPU, reason="values of CUDA index tensors are not read (a read would "
                    "synchronize every call)")
def test_varlen_cu_seqlens_beyond_total():
    q, k, v, cu = _varlen()
    with pytest.raises(ValueError, match=r"cu_seqlens_q: expected cu_seqlens_q\[-1\] <= 8"):
        flash_attn_varlen_func(
            q, k, v, cu + torch.tensor([0, 0, 4], dtype=torch.int32, device=DEVICE), cu, 9, 5
        )


@pytest.mark.skipif(ON_GPU, reason="values of CUDA index tensors are not read (a read would "
                    "synchronize every call)")
def test_varlen_max_seqlen_too_small():
    q, k, v, cu = _varlen()
    with pytest.raises(ValueError, match=r"max_seqlen_q: expected >= the longest sequence \(5\)"):
        flash_attn_varlen_func(q, k, v, cu, cu, 4, 5)


def test_varlen_4d_q():
    q, k, v, cu = _varlen()
    with pytest.raises(ValueError, match=r"q: expected a 3-D tensor"):
        flash_attn_varlen_func(q[None], k, v, cu, cu, 5, 5)


def test_attention_gqa_needs_flag():
    q, k, v = randn(1, 4, 8, 32), randn(1, 2, 8, 32), randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match=r"k: expected nheads = 4 .* without enable_gqa=True"):
        attention(q, k, v)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU-without-interpreter message")
def test_cpu_tensor_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = good()
    with pytest.raises(ValueError, match=r"expected a CUDA tensor.*TRITON_INTERPRET=1"):
        flash_attn_func(q, k, v)


@pytest.mark.gpu
def test_mixed_devices():
    q, k, v = good()
    with pytest.raises(ValueError, match=r"k: expected device cuda:0 .*, got cpu"):
        flash_attn_func(q, k.cpu(), v)


@pytest.mark.gpu
def test_varlen_call_does_not_synchronize():
    """A varlen forward + backward on a GPU reads no device values on the host (CUDA's sync
    debug mode turns any synchronizing op into an error)."""
    q, k, v, cu = _varlen()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_varlen_dropout_range():
    q, k, v, cu = _varlen()
    with pytest.raises(ValueError, match=r"dropout_p: expected 0 <= dropout_p < 1, got 1.5"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, 1.5)


# ---------------------------------------------------------------------------------------------
# flash-attn's argument types (issue 39): any integer pair for window_size, any real softcap
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", ["list", "tensor", "tensor-of-0d", "numpy"])
def test_window_size_any_int_pair(window):
    """window_size as flash-attn's tests pass it (``torch.randint(0, s, (2,))``), a list, numpy
    ints: the same result as the tuple of ints."""
    import numpy as np

    q, k, v = good(b=1, s=19, h=2, h_kv=1)
    given = {"list": [3, 2], "tensor": torch.tensor([3, 2]),
             "tensor-of-0d": (torch.tensor(3), torch.tensor(2)),
             "numpy": (np.int64(3), np.int32(2))}[window]
    out = flash_attn_func(q, k, v, window_size=given, softcap=5)
    ref = flash_attn_func(q, k, v, window_size=(3, 2), softcap=5.0)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("window, match", [
    (torch.tensor([1.5, 2.0]), "window_size: expected a pair of ints .* dtype torch.float32"),
    (torch.tensor([1, 2, 3]), r"window_size: expected a pair of ints .* shape \(3,\)"),
    ((1.5, 2), r"window_size: expected a pair of ints \(left, right\), got tuple \(1.5, 2\)"),
    (3, "window_size: expected a pair of ints .* got int 3"),
])
def test_window_size_bad_types(window, match):
    q, k, v = good()
    with pytest.raises(TypeError, match=match):
        flash_attn_func(q, k, v, window_size=window)


def test_softcap_bad_type():
    q, k, v = good()
    with pytest.raises(TypeError, match="softcap: expected a float, got str"):
        flash_attn_func(q, k, v, softcap="1")


def test_kvcache_window_tensor_and_int_seqlens():
    """flash_attn_with_kvcache takes the same pairs, and cache_seqlens as an int."""
    from solattn import flash_attn_with_kvcache

    q = randn(2, 1, 2, 32)
    kc, vc = randn(2, 24, 1, 32), randn(2, 24, 1, 32)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=20, window_size=torch.tensor([4, 0]))
    lens = torch.full((2,), 20, dtype=torch.int32, device=DEVICE)
    ref = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(4, 0))
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------
# Index values: flash-attn's block_table capacity error; SOLATTN_CHECK strict mode
# ---------------------------------------------------------------------------------------------

def _paged_cache(pages=4, page=16, max_pages=1):
    kc, vc = randn(pages, page, 1, 32), randn(pages, page, 1, 32)
    table = torch.zeros(1, max_pages, dtype=torch.int32, device=DEVICE)
    return randn(1, 1, 2, 32), kc, vc, table


@pytest.mark.parametrize("append", [False, True])
def test_kvcache_block_table_capacity(append):
    """flash-attn's test_flash_attn_kvcache_paged_block_table_bounds: keys past what the block
    table addresses raise RuntimeError naming block_table (also a ValueError); exactly at
    capacity runs."""
    from solattn import flash_attn_with_kvcache
    from solattn.validation import BlockTableCapacityError

    q, kc, vc, table = _paged_cache()
    kn = vn = None
    if append:
        kn, vn = randn(1, 1, 1, 32), randn(1, 1, 1, 32)
    over = torch.full((1,), 16 if append else 17, dtype=torch.int32, device=DEVICE)
    for exc in (RuntimeError, ValueError):
        with pytest.raises(exc, match="block_table"):
            flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=over, block_table=table)
    with pytest.raises(BlockTableCapacityError, match="block_table"):
        flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=17, block_table=table)
    ok = torch.full((1,), 16, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=ok, block_table=table)
    assert out.shape == (1, 1, 2, 32) and not out.isnan().any()


def test_kvcache_new_keys_beyond_capacity():
    from solattn import flash_attn_with_kvcache

    q, kc, vc = randn(1, 1, 2, 32), randn(1, 8, 1, 32), randn(1, 8, 1, 32)
    with pytest.raises(ValueError, match=r"k: expected seqlen_new \(k.shape\[1\]\) <= 8"):
        flash_attn_with_kvcache(q, kc, vc, k=randn(1, 9, 1, 32), v=randn(1, 9, 1, 32),
                                cache_seqlens=0)


def test_strict_mode_reads_device_values(monkeypatch):
    """SOLATTN_CHECK=1 (validation.STRICT): index tensors' values are checked wherever they
    live; without it only CPU tensors' are (values_unreadable)."""
    from solattn import validation

    t = torch.zeros(3, dtype=torch.int32)
    assert not validation.values_unreadable(t)
    cuda_like = type("FakeCuda", (), {"is_cuda": True})()
    monkeypatch.setattr(validation, "STRICT", False)
    assert validation.values_unreadable(cuda_like)
    monkeypatch.setattr(validation, "STRICT", True)
    assert not validation.values_unreadable(cuda_like)


def test_strict_mode_block_mask_indices(monkeypatch):
    """SOLATTN_CHECK=1 checks a BlockMask's counts and indices on the host."""
    from solattn import validation
    from solattn.flex import create_block_mask, flex_attention

    monkeypatch.setattr(validation, "STRICT", True)
    q = randn(1, 1, 32, 16)
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, 32, 32, device=DEVICE,
                           BLOCK_SIZE=16)
    bm.kv_indices[0, 0, 1, 0] = 7
    with pytest.raises(ValueError, match=r"block_mask.kv_indices: expected the listed block "
                                         r"indices in \[0, 2\)"):
        flex_attention(q, q, q, block_mask=bm)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU path's value checks (GPU: fuzz test)")
def test_kvcache_cpu_values_named():
    from solattn import flash_attn_with_kvcache

    q, kc, vc = randn(2, 1, 2, 32), randn(2, 8, 1, 32), randn(2, 8, 1, 32)
    bad = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_batch_idx: expected values in"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, cache_batch_idx=bad)
    lens = torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_leftpad: expected 0 <= cache_leftpad"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                cache_leftpad=torch.tensor([0, 4], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# Flex: an op the tracer cannot handle is named (NotImplementedError)
# ---------------------------------------------------------------------------------------------

def test_flex_untraceable_op_named():
    from solattn.flex import flex_attention

    def weird(score, b, h, q_idx, kv_idx):
        return torch.fft.fft(score).real

    q = randn(1, 1, 16, 16)
    with pytest.raises(NotImplementedError,
                       match=r"score_mod `weird` uses torch\.fft\.fft, which cannot be traced "
                             r".*Supported: arithmetic, comparisons, torch\.where"):
        flex_attention(q, q, q, score_mod=weird)


# ---------------------------------------------------------------------------------------------
# bf16 under Triton's interpreter: computed in float32 (solattn.interpreter), or refused
# ---------------------------------------------------------------------------------------------

interpreter_only = pytest.mark.skipif(ON_GPU, reason="Triton's CPU interpreter path")


@interpreter_only
def test_interpreter_bf16_matches_oracle():
    """bf16 under TRITON_INTERPRET=1: forward and gradients within the oracle's tolerance
    (Triton's interpreter alone returns values around 1e9 here)."""
    from oracle import assert_close

    from solattn.reference import attention_ref

    torch.manual_seed(0)
    q, k, v = (randn(1, 37, 2, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    hi = [t.detach().double().requires_grad_() for t in (q, k, v)]
    lo = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_hi = attention_ref(*hi, causal=True)[0]
    out_lo = attention_ref(*lo, causal=True, upcast=False)[0]
    assert_close("out", out, out_hi, out_lo)
    g_hi = torch.autograd.grad(out_hi, hi, dout.double())
    g_lo = torch.autograd.grad(out_lo, lo, dout)
    for name, g, gh, gl in zip("qkv", grads, g_hi, g_lo):
        assert g.dtype == torch.bfloat16
        assert_close(f"d{name}", g, gh, gl)


@interpreter_only
def test_interpreter_bf16_refused_without_hook(monkeypatch):
    """Where the interpreter could not be hooked, bf16 raises before any launch."""
    from solattn import interpreter

    monkeypatch.setattr(interpreter, "BF16_OK", False)
    q, k, v = (randn(1, 8, 2, 32, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="bfloat16 under TRITON_INTERPRET=1"):
        flash_attn_func(q, k, v)
