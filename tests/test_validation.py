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
