"""The Hopper (sm_90) Gluon forward against the one oracle, plus its CPU-side checks.

GPU tests call the launcher directly (``solattn.kernels.hopper.forward_plan.attn_fwd``) so they test
this kernel whatever the dispatcher would pick; they skip without an sm_90 device. The AOT test
compiles the kernel for sm_90 with no GPU (what CI runs).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from oracle import assert_close, assert_lse_close, randn, sm90

from solattn.core import make_params
from solattn.reference import attention_ref, attention_varlen_ref

GPU_DTYPES = [torch.bfloat16, torch.float16]


def _hopper():
    from solattn.kernels.hopper import forward_plan
    return forward_plan


def run_hopper(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None,
               config=None, alibi_slopes=None):
    p = make_params(q, k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes)
    return _hopper().attn_fwd(q, k, v, p, return_lse=True, config=config)


def check(q, k, v, **kw):
    out, lse = run_hopper(q, k, v, **kw)
    ref_kw = {key: val for key, val in kw.items() if key != "config"}
    ref, ref_lse = attention_ref(q, k, v, **ref_kw)
    ref_lo, _ = attention_ref(q, k, v, upcast=False, **ref_kw)
    assert_close("out", out, ref, ref_lo)
    assert_lse_close(lse, ref_lse.float())


# (batch, seqlen_q, seqlen_k, heads, kv heads): ragged tails, one row, GQA/MQA, s_q != s_k.
SHAPES = [
    (2, 113, 113, 4, 4),
    (1, 1000, 1000, 3, 1),
    (2, 128, 4097, 4, 2),
    (1, 517, 200, 2, 2),
    (1, 1, 17, 2, 2),
    (1, 256, 256, 8, 2),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward(shape, causal, d, dtype):
    b, s_q, s_k, h, h_kv = shape
    q = randn(b, s_q, h, d, dtype=dtype)
    k = randn(b, s_k, h_kv, d, dtype=dtype)
    v = randn(b, s_k, h_kv, d, dtype=dtype)
    check(q, k, v, causal=causal)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("window_size,causal,softcap", [
    ((64, 64), False, 0.0),
    ((300, 0), False, 0.0),
    ((17, -1), False, 0.0),
    ((-1, 5), False, 0.0),
    ((-1, -1), True, 30.0),
    ((100, -1), True, 0.0),
    ((-1, -1), False, 5.0),
])
def test_window_softcap(window_size, causal, softcap, dtype):
    q = randn(2, 700, 4, 128, dtype=dtype)
    k = randn(2, 900, 2, 128, dtype=dtype)
    v = randn(2, 900, 2, 128, dtype=dtype)
    check(q, k, v, causal=causal, window_size=window_size, softcap=softcap)


def _slopes(batch, h, per_batch):
    """ALiBi slopes as flash-attn's tests draw them: (h,) or (batch, h) float32 in [0, 1)."""
    shape = (batch, h) if per_batch else (h,)
    return torch.rand(*shape, dtype=torch.float32, device="cuda")


# (masks and softcap, (batch, h) slopes rather than (h,)): each a compiled variant per head dim
ALIBI_CASES = {
    "full": (dict(), False),
    "causal-batched": (dict(causal=True), True),
    "window-softcap": (dict(window_size=(100, 7), softcap=5.0), False),
    "causal-softcap-batched": (dict(causal=True, softcap=30.0), True),
    "right": (dict(window_size=(-1, 40)), False),
}


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", list(ALIBI_CASES))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("shape", [(2, 700, 900, 4, 2), (1, 517, 200, 3, 1), (2, 113, 113, 4, 4)])
def test_alibi(shape, d, case):
    """ALiBi (``-slope * |i + s_k - s_q - j|``) with masks, softcap, GQA/MQA, s_q != s_k."""
    b, s_q, s_k, h, h_kv = shape
    kw, per_batch = ALIBI_CASES[case]
    q = randn(b, s_q, h, d, dtype=torch.bfloat16)
    k = randn(b, s_k, h_kv, d, dtype=torch.bfloat16)
    v = randn(b, s_k, h_kv, d, dtype=torch.bfloat16)
    check(q, k, v, alibi_slopes=_slopes(b, h, per_batch), **kw)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dims", [(96, 96), (192, 192), (192, 128)], ids=str)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(64, 3), softcap=5.0),
                                dict(causal=True, alibi=True)],
                         ids=["full", "causal", "window-softcap", "causal-alibi"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[3]])
def test_padded_head_dims(shape, kw, dims, dtype=torch.bfloat16):
    """Head dims 96 and 192 (in 128- and 256-wide tiles) and ``d_v = 128 < d = 192`` (MLA)."""
    b, s_q, s_k, h, h_kv = shape
    d, d_v = dims
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = _slopes(b, h, True)
    q = randn(b, s_q, h, d, dtype=dtype)
    k = randn(b, s_k, h_kv, d, dtype=dtype)
    v = randn(b, s_k, h_kv, d_v, dtype=dtype)
    check(q, k, v, **kw)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dims", [(96, 96), (192, 128)], ids=str)
def test_padded_head_dims_fp16(dims):
    """fp16 (the parametrized test above runs bf16), causal, GQA, ragged."""
    test_padded_head_dims(SHAPES[2], dict(causal=True), dims, dtype=torch.float16)


@pytest.mark.gpu
@sm90
def test_padded_head_dims_float32_out_and_strides():
    """The register epilogue of a padded / narrower O (float32 output: masked column stores)
    and q, k, v sliced out of wider tensors (TMA reads them in place, zeros past d)."""
    big = randn(2, 300, 4, 256, dtype=torch.bfloat16)
    q, k = big[..., :192], randn(2, 400, 2, 256, dtype=torch.bfloat16)[..., :192]
    v = randn(2, 400, 2, 256, dtype=torch.bfloat16)[..., 64:192]
    p = make_params(q, k, causal=True, out_dtype=torch.float32)
    out, lse = _hopper().attn_fwd(q, k, v, p, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    ref_lo, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert out.dtype == torch.float32 and out.shape == (2, 300, 4, 128)
    assert_close("out", out, ref, ref_lo)
    assert_lse_close(lse, ref_lse.float())


@pytest.mark.gpu
@sm90
def test_non_contiguous_inputs():
    """Any strides: q/k/v sliced out of a packed qkv tensor (TMA reads them in place)."""
    qkv = randn(2, 300, 3, 4, 128, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    check(q, k, v, causal=True)


@pytest.mark.gpu
@sm90
def test_deterministic():
    """The same input run 20 times gives bitwise identical output and lse (no races)."""
    q = randn(2, 1031, 8, 128, dtype=torch.bfloat16)
    k = randn(2, 1031, 2, 128, dtype=torch.bfloat16)
    v = randn(2, 1031, 2, 128, dtype=torch.bfloat16)
    out0, lse0 = run_hopper(q, k, v, causal=True)
    for _ in range(20):
        out, lse = run_hopper(q, k, v, causal=True)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)


# Packed sequences: zero-length ones, q shorter / longer than k, one row, several tiles long.
HOPPER_VARLEN_CASES = {
    "mixed": ([300, 17, 0, 1000, 129], [300, 17, 5, 1000, 129]),
    "q-shorter": ([1, 130, 0, 257], [700, 131, 64, 900]),
    "q-longer": ([700, 131, 64, 900], [1, 130, 0, 257]),
}


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(100, 7), softcap=5.0)],
                         ids=["full", "causal", "window-softcap"])
@pytest.mark.parametrize("case", list(HOPPER_VARLEN_CASES))
def test_varlen(case, kw, d, dtype):
    """Packed sequences (``cu_seqlens``): each one equals attention on its own rows, GQA."""
    lens_q, lens_k = HOPPER_VARLEN_CASES[case]
    h, h_kv = 4, 2
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    q = randn(sum(lens_q), h, d, dtype=dtype)
    k = randn(sum(lens_k), h_kv, d, dtype=dtype)
    v = randn(sum(lens_k), h_kv, d, dtype=dtype)
    p = make_params(q, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                    max_seqlen_k=max(lens_k), **kw)
    out, lse = _hopper().attn_fwd(q, k, v, p, return_lse=True)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, **kw)
    ref_lo, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    assert_close("out", out, ref, ref_lo)
    assert_lse_close(lse, ref_lse.float())


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dims,kw", [
    ((128, 128), dict(causal=True, alibi=True)),
    ((128, 128), dict(alibi=True)),
    ((64, 64), dict(causal=True, alibi=True)),
    ((96, 96), dict(causal=True)),
    ((192, 192), dict()),
    ((192, 128), dict(causal=True)),
    ((192, 128), dict(window_size=(100, 7), softcap=5.0, alibi=True)),
], ids=str)
@pytest.mark.parametrize("case", list(HOPPER_VARLEN_CASES))
def test_varlen_features(case, dims, kw):
    """Varlen with ALiBi ((batch, h) slopes index the sequence) and the padded head dims."""
    lens_q, lens_k = HOPPER_VARLEN_CASES[case]
    h, h_kv = 4, 2
    d, d_v = dims
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = _slopes(len(lens_q), h, True)
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = randn(sum(lens_q), h, d, dtype=torch.bfloat16)
    k = randn(sum(lens_k), h_kv, d, dtype=torch.bfloat16)
    v = randn(sum(lens_k), h_kv, d_v, dtype=torch.bfloat16)
    p = make_params(q, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                    max_seqlen_k=max(lens_k), **kw)
    out, lse = _hopper().attn_fwd(q, k, v, p, return_lse=True)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, **kw)
    ref_lo, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **kw)
    assert out.shape == (q.shape[0], h, d_v)
    assert_close("out", out, ref, ref_lo)
    assert_lse_close(lse, ref_lse.float())


@pytest.mark.gpu
@sm90
def test_new_features_dispatch():
    """ALiBi and head dims 96 / 192 / 192-128 run here when forced; by default where
    :func:`preferred` says so."""
    from solattn.dispatch import FORWARD, selected
    q = randn(1, 128, 2, 192, dtype=torch.bfloat16)
    v = randn(1, 128, 2, 128, dtype=torch.bfloat16)
    q128 = randn(1, 128, 2, 128, dtype=torch.bfloat16)
    cases = [(q, v, make_params(q, q)),
             (q128, q128, make_params(q128, q128, alibi_slopes=_slopes(1, 2, False)))]
    for q_, v_, p in cases:
        assert selected(FORWARD, q_, q_, v_, p, backend="hopper") == "hopper"
        expected = "hopper" if _hopper().preferred(q_, v_, p)[0] else "portable"
        assert selected(FORWARD, q_, q_, v_, p) == expected


@pytest.mark.gpu
@sm90
def test_varlen_dispatch():
    """``flash_attn_varlen_func`` picks this kernel for packed sequences (and is right)."""
    from solattn import flash_attn_varlen_func
    from solattn.dispatch import FORWARD, selected
    q = randn(300, 4, 128, dtype=torch.bfloat16)
    k = randn(600, 2, 128, dtype=torch.bfloat16)
    v = randn(600, 2, 128, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 250, 600], dtype=torch.int32, device="cuda")
    p = make_params(q, k, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200,
                    max_seqlen_k=350)
    assert selected(FORWARD, q, k, v, p) == "hopper"
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 350, causal=True)
    ref, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    ref_lo, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)
    assert_close("out", out, ref, ref_lo)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward(causal):
    """Gradients through ``flash_attn_varlen_func`` when its forward (and saved LSE) come from
    this kernel: the backward reads the LSE in the ``(h, t_q)`` layout the portable kernel
    writes."""
    from solattn import flash_attn_varlen_func
    lens_q, lens_k = [300, 0, 129, 700], [300, 17, 1, 650]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    leaves = [randn(sum(lens_q), 4, 128, dtype=torch.bfloat16)]
    leaves += [randn(sum(lens_k), 2, 128, dtype=torch.bfloat16) for _ in range(2)]
    leaves = [t.requires_grad_() for t in leaves]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    dout = randn(*out.shape, dtype=torch.bfloat16)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref, _ = attention_varlen_ref(*ref_leaves, cu_q, cu_k, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    lo_leaves = [t.detach().requires_grad_() for t in leaves]
    lo, _ = attention_varlen_ref(*lo_leaves, cu_q, cu_k, causal=causal, upcast=False)
    lo_grads = torch.autograd.grad(lo, lo_leaves, dout)
    for name, g, r, g_lo in zip(("dq", "dk", "dv"), grads, ref_grads, lo_grads):
        assert_close(name, g, r, g_lo)


@pytest.mark.gpu
@sm90
def test_dispatch_picks_hopper():
    from solattn.dispatch import FORWARD, selected
    q = randn(1, 128, 2, 128, dtype=torch.bfloat16)
    assert selected(FORWARD, q, q, q, make_params(q, q)) == "hopper"


@pytest.mark.parametrize("args,lpt", [
    # (causal, tiles, SMs, seqlen_k, head_dim, batch * KV heads)
    ((True, 512, 132, 4096, 256, 16), True),     # B2 H8 L4k D256: 4 MiB of K + V per head
    ((True, 528, 132, 8192, 128, 64), True),     # at the 4-tiles-per-SM bound
    ((True, 529, 132, 8192, 128, 64), False),    # one tile over it (256 MiB of K + V)
    ((True, 512, 132, 16384, 256, 4), False),    # B1 H4 L16k D256: 16 MiB per head
    ((True, 2048, 132, 4096, 128, 64), False),   # B4 H16 L4k D128: 15.5 tiles per SM, 128 MiB
    ((False, 512, 132, 4096, 128, 8), False),    # not causal: tiles of one length
    # more tiles, K + V of all heads in L2 (<= 32 MiB)
    ((True, 1024, 132, 4096, 64, 4), True),      # B1 Hq32 Hkv4 L4k D64: 4 MiB in all
    ((True, 2048, 132, 8192, 128, 8), True),     # B1 Hq32 Hkv8 L8k D128: 32 MiB, the bound
    ((True, 2048, 132, 8192, 128, 9), False),    # 36 MiB
    ((True, 1024, 132, 16384, 256, 1), False),   # one head's K + V over 8 MiB
])
def test_lpt_all_heads(args, lpt):
    """The host rule that sends causal problems of few tiles, or whose K and V stay in L2,
    through the longest-first order."""
    assert _hopper().lpt_all_heads(*args) is lpt


@pytest.mark.parametrize("args,kw,schedule", [
    # (head_dim, has_upper), keywords: the tiles' lengths and sizes decide
    ((128, False), dict(seqlen_k=512), "static-staged"),   # equal tiles at d=128: O staged
    ((128, False), dict(), "static-staged"),               # size unknown: long
    ((128, False), dict(dropout=True, seqlen_k=512), "static"),   # dropout: short keys
    ((128, False), dict(dropout=True, seqlen_k=2049), "tiles"),   # dropout: long
    ((128, True), dict(has_lower=True), "static-staged"),  # a causal sliding window
    ((128, True), dict(seqlen_k=2048), "dynamic-staged"),  # short causal d=128
    ((128, True), dict(seqlen_k=2049), "dynamic-staged-lpt"),  # longest first, head groups
    ((128, True), dict(seqlen_k=8192), "dynamic-staged-lpt"),
    ((128, True), dict(seqlen_k=8193), "tiles"),           # long causal d=128
    ((128, True), dict(), "tiles"),
    ((128, True), dict(seqlen_k=512, dropout=True), "tiles"),
    ((128, False), dict(seqlen_k=512, varlen=True), "dynamic"),
    ((128, True), dict(varlen=True), "dynamic"),
    ((64, False), dict(varlen=True), "dynamic"),
    ((64, False), dict(), "static"),
    ((64, True), dict(seqlen_k=4096), "dynamic"),          # short causal d=64
    ((64, True), dict(seqlen_k=4097), "tiles"),
    ((64, True), dict(), "tiles"),
    ((64, True), dict(has_lower=True), "static"),
    ((256, False), dict(seqlen_k=512), "tiles"),
    ((256, True), dict(varlen=True), "tiles"),
    ((256, True), dict(varlen=True, head_dim_v=128), "tiles"),
])
def test_schedule_rule(args, kw, schedule):
    """The host rule for the tile schedule: tiles of unequal lengths claimed dynamically
    (varlen, short causal at d=64 and d=128; at d=128 from 2049 to 8192 keys longest first in
    16 MiB head groups, "-lpt") or one CTA per tile (other causal), equal ones persistent (d=64,
    d=128); at d=128 without dropout O staged in its own tile ("-staged")."""
    cfg = _hopper().hopper_fwd_config(*args, **kw)
    got = "dynamic" if cfg.persistent and cfg.dynamic else (
        "static" if cfg.persistent else "tiles")
    if cfg.o_staging:
        got += "-staged"
        assert cfg.persistent and cfg.stages == 2
    if cfg.lpt:
        got += "-lpt"
        assert cfg.lpt == 16
    assert got == schedule


@pytest.mark.parametrize("triton,shape,causal,window,staged", [
    # (Triton, (batch, heads, seqlen_q, seqlen_k)): with 3.9 few equal tiles (at most 4 per
    # SM of 132) store O from registers; 3.6 stages them at every size
    ((3, 9), (1, 4, 4096, 16384), False, None, False),    # 128 tiles
    ((3, 9), (1, 8, 4096, 8192), False, None, False),     # 256 tiles (the headline row)
    ((3, 9), (1, 8, 8192, 8192), False, None, False),     # 512 tiles: 3.88 per SM
    ((3, 9), (1, 8, 8448, 8192), False, None, False),     # 528 tiles: 4 per SM, the bound
    ((3, 9), (1, 8, 8576, 8192), False, None, True),      # 536 tiles
    ((3, 9), (1, 9, 8192, 8192), False, None, True),      # 576 tiles: 4.4 per SM
    ((3, 9), (4, 16, 4096, 4096), False, None, True),     # 2048 tiles
    ((3, 9), (1, 4, 4096, 4096), False, (256, 256), True),  # a band: kept staged
    ((3, 9), (1, 4, 2048, 2048), True, None, True),       # short causal: claimed, staged
    ((3, 6), (1, 4, 4096, 16384), False, None, True),
    ((3, 6), (1, 8, 4096, 8192), False, None, True),
])
def test_few_tiles_store_o_from_registers(monkeypatch, triton, shape, causal, window, staged):
    """The launch plan of the d=128 forward: with Triton >= 3.9, a problem without a band of
    at most 4 tiles per SM runs the persistent grid with O from registers (few_tiles_config),
    keeping the staged config's two stages; every other d=128 problem without dropout keeps O
    staged."""
    import solattn.configs.hopper_forward as cf
    fp = _hopper()
    monkeypatch.setattr(cf, "triton_version", lambda: triton)
    monkeypatch.setattr(fp, "num_sms", lambda device: 132)
    b, h, s_q, s_k = shape
    q = torch.empty(b, s_q, h, 128, dtype=torch.bfloat16)
    k = torch.empty(b, s_k, h, 128, dtype=torch.bfloat16)
    kw = dict(window_size=window) if window else {}
    plan = fp._make_plan(q, k, k, make_params(q, k, causal=causal, **kw), True, None)
    flags = plan.launch.kwargs
    assert flags["O_STAGING"] is staged and flags["REGISTER_EPILOGUE"] is not staged
    assert flags["STAGES"] == 2 and plan.launch.grid[0] == min(132, b * h * -(-s_q // 128))


def test_schedule_rule_softcap_by_triton():
    """Softcap at d=128 stages O with Triton before 3.9; from 3.9 (64-key blocks) it keeps the
    register epilogue's schedule, whose ALiBi + window build does not spill."""
    from solattn.configs import triton_version
    hf = _hopper()
    staged = triton_version() < (3, 9)
    for kw in (dict(), dict(has_lower=True), dict(seqlen_k=1024)):
        cfg = hf.hopper_fwd_config(128, kw.get("has_lower", False), True, **kw)
        assert cfg.o_staging == staged, (kw, cfg)
        if not staged:
            assert cfg.stages == 3 and cfg.persistent == (kw != dict()), (kw, cfg)


@pytest.mark.parametrize("kw,ok", [
    (dict(head_dim=128, head_dim_v=128, varlen=False, has_alibi=False), True),
    (dict(head_dim=64, head_dim_v=64, varlen=False, has_alibi=False), True),
    (dict(head_dim=96, head_dim_v=96, varlen=False, has_alibi=False), True),
    (dict(head_dim=192, head_dim_v=192, varlen=False, has_alibi=False), True),
    (dict(head_dim=192, head_dim_v=128, varlen=True, has_alibi=True), True),
    (dict(head_dim=128, head_dim_v=64, varlen=False, has_alibi=False), False),
    (dict(head_dim=80, head_dim_v=80, varlen=False, has_alibi=False), False),
    (dict(head_dim=128, head_dim_v=128, varlen=True, has_alibi=False), True),
    (dict(head_dim=64, head_dim_v=64, varlen=True, has_alibi=False), True),
    (dict(head_dim=128, head_dim_v=128, varlen=False, has_alibi=True), True),
    (dict(head_dim=128, head_dim_v=128, varlen=False, has_alibi="strided"), False),
])
def test_covers(kw, ok):
    q = torch.empty(1, 1, 1, kw["head_dim"], dtype=torch.float16)
    v = torch.empty(1, 1, 1, kw["head_dim_v"], dtype=torch.float16)
    cu = torch.zeros(2, dtype=torch.int32) if kw["varlen"] else None
    slopes = None
    if kw["has_alibi"]:
        slopes = torch.ones(1, 4)[:, ::2] if kw["has_alibi"] == "strided" else torch.ones(1)
    p = make_params(q, q, alibi_slopes=slopes, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1,
                    max_seqlen_k=1)
    covered, reason = _hopper().covers(q, v, p)
    assert covered == ok and reason


@pytest.mark.parametrize("kw,default", [
    (dict(dims=(128, 128)), True),
    (dict(dims=(64, 64), varlen=True), False),
    (dict(dims=(128, 128), varlen=True), True),
    (dict(dims=(96, 96), varlen=True), True),
    (dict(dims=(128, 128), alibi=True), True),
    (dict(dims=(64, 64), alibi=True), False),
    (dict(dims=(256, 256), alibi=True), True),
    (dict(dims=(96, 96)), True),
    (dict(dims=(192, 192)), True),
    (dict(dims=(192, 128)), True),
])
def test_preferred(kw, default):
    """The measured defaults (forward_plan._MEASURED_DEFAULTS): covered calls sent to the portable
    kernel by default each name their reason."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    d, d_v = kw["dims"]
    q = torch.empty(1, 1, 2, d, dtype=torch.float16)
    v = torch.empty(1, 1, 2, d_v, dtype=torch.float16)
    cu = torch.zeros(2, dtype=torch.int32) if kw.get("varlen") else None
    p = make_params(q, q, alibi_slopes=torch.ones(2) if kw.get("alibi") else None,
                    cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1, max_seqlen_k=1)
    assert _hopper().covers(q, v, p)[0]
    ok, why = _hopper().preferred(q, v, p)
    assert ok == default and why.startswith("default" if default else "not the default")


def test_aot_compiles_for_sm90():
    """CI's check, on any machine: every Hopper forward config (16-bit and FP8) compiles for
    sm_90a with wgmma (HGMMA; QGMMA for FP8) and TMA in its SASS and no spills, but for a spill
    the config lists as measured and accepted; the FP8 V transpose compiles without spills (the
    Triton interpreter must be off for the compiler to run)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "solattn.cli", "aot", "--arch", "90",
                          "--only", "fwd_hopper"], capture_output=True, text=True, env=env,
                         timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if "fwd_hopper" in ln]
    assert res.returncode == 0 and lines, res.stdout + res.stderr
    assert any("fwd_hopper_fp8 " in ln for ln in lines), res.stdout
    for line in lines:
        kept = line.startswith("kept") and "spill accepted:" in line
        assert line.startswith("ok") or kept, line
        if "fwd_hopper_fp8_v " in line:
            continue
        mma = "QGMMA" if "fwd_hopper_fp8 " in line else "HGMMA"
        assert mma in line and "UTMALDG" in line, line


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k(causal):
    """``seqused_k`` caps each batch entry's keys (a KV cache): equals attention on the prefix."""
    q = randn(3, 77, 4, 128, dtype=torch.bfloat16)
    k = randn(3, 500, 4, 128, dtype=torch.bfloat16)
    v = randn(3, 500, 4, 128, dtype=torch.bfloat16)
    used = torch.tensor([500, 130, 1], dtype=torch.int32, device=q.device)
    p = make_params(q, k, causal=causal, seqused_k=used)
    out, lse = _hopper().attn_fwd(q, k, v, p, return_lse=True)
    for i, n in enumerate(used.tolist()):
        qi, ki, vi = q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n]
        ref, ref_lse = attention_ref(qi, ki, vi, causal=causal)
        ref_lo, _ = attention_ref(qi, ki, vi, causal=causal, upcast=False)
        assert_close("out", out[i:i + 1], ref, ref_lo)
        assert_lse_close(lse[i:i + 1], ref_lse.float())


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dynamic_varlen_and_counters(d, causal):
    """Dynamic tile claiming on packed sequences of mixed lengths (empty tiles of the short
    ones skipped by every partition alike), bitwise equal to one CTA per tile; three launches
    in a row on the kept workspace, whose counters each launch leaves at 0."""
    import dataclasses
    hf = _hopper()
    lens = [1, 700, 64, 2048, 300, 129, 1500, 17] * 3
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q = randn(total, 8, d, dtype=torch.bfloat16)
    k = randn(total, 2, d, dtype=torch.bfloat16)
    v = randn(total, 2, d, dtype=torch.bfloat16)
    p = make_params(q, k, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    base = hf.hopper_fwd_config(d, causal, varlen=True)
    tiles = dataclasses.replace(base, persistent=False)
    dynamic = dataclasses.replace(base, persistent=True, dynamic=True)
    out0, lse0 = hf.attn_fwd(q, k, v, p, return_lse=True, config=tiles)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu, cu, causal=causal)
    ref_lo, _ = attention_varlen_ref(q, k, v, cu, cu, causal=causal, upcast=False)
    assert_close("out", out0, ref, ref_lo)
    for _ in range(3):
        out, lse = hf.attn_fwd(q, k, v, p, return_lse=True, config=dynamic)
        torch.cuda.synchronize()
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
        assert hf.sched_workspace(q)[:2].tolist() == [0, 0]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("kept", [True, False])
def test_dynamic_in_cuda_graph(kept):
    """A dynamic launch captured in a CUDA graph replays correctly: with the stream's kept
    workspace (an eager call on the stream first) and with one allocated in the capture (a
    stream with none), and the kept workspace's counters are back at 0 after the replays."""
    hf = _hopper()
    lens = [300, 1, 777, 64, 1025] * 4
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q = randn(int(cu[-1]), 4, 128, dtype=torch.bfloat16)
    k = randn(int(cu[-1]), 2, 128, dtype=torch.bfloat16)
    v = randn(int(cu[-1]), 2, 128, dtype=torch.bfloat16)
    p = make_params(q, k, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    assert hf.hopper_fwd_config(128, True, varlen=True).dynamic
    ref, ref_lse = hf.attn_fwd(q, k, v, p, return_lse=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if kept:
            hf.attn_fwd(q, k, v, p, return_lse=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, lse = hf.attn_fwd(q, k, v, p, return_lse=True)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    if kept:
        with torch.cuda.stream(stream):
            assert hf.sched_workspace(q)[:2].tolist() == [0, 0]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("schedule", ["tiles", "persistent", "dynamic"])
@pytest.mark.parametrize("causal", [False, True])
def test_schedules(causal, schedule, consumers):
    """The launch modes on a problem with several tiles per SM (the persistent loops carry the
    K/V ring and the Q barriers' phases across tiles; dynamic: tiles claimed from a counter),
    whatever the default for the shape, with two consumer warpgroups (shipping) and one (the
    ladder's step)."""
    import dataclasses
    cfg = dataclasses.replace(_hopper().hopper_fwd_config(128, causal),
                              persistent=schedule != "tiles", dynamic=schedule == "dynamic",
                              consumers=consumers)
    q = randn(4, 2000, 8, 128, dtype=torch.bfloat16)
    k = randn(4, 2100, 2, 128, dtype=torch.bfloat16)
    v = randn(4, 2100, 2, 128, dtype=torch.bfloat16)
    check(q, k, v, causal=causal, config=cfg)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (192, 128)])
def test_o_staging(dims, causal, dynamic, dtype):
    """``HopperFwdConfig.o_staging``: persistent CTAs store O through a shared tile of its own,
    each TMA store left in flight while the next tile runs (several tiles per CTA here: 4 x 6
    heads x 8 row tiles on at most 132 CTAs), with a ragged last row tile (1000 rows: TMA stores
    nothing past the end), GQA, and MLA's narrower V: the tile widths whose shared memory holds
    the extra tile at two stages (d=256's does not: test_o_staging_refused)."""
    import dataclasses
    d, d_v = dims
    tiles = _hopper().HEAD_DIM_TILES[dims]
    cfg = dataclasses.replace(
        _hopper().hopper_fwd_config(tiles[0], causal, head_dim_v=tiles[1]), persistent=True,
        dynamic=dynamic, o_staging=True, stages=2)
    q = randn(4, 1000, 6, d, dtype=dtype)
    k = randn(4, 1100, 2, d, dtype=dtype)
    v = randn(4, 1100, 2, d_v, dtype=dtype)
    check(q, k, v, causal=causal, config=cfg)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lpt", [1, 16])
def test_claimed_staged_lpt(lpt, dtype):
    """The d=128 causal schedule of 2049 to 8192 keys (hopper_fwd_config): tiles claimed from a
    counter, longest first within head groups, O staged: 1 MiB groups hold one KV head's three
    query heads (8 groups), 16 MiB all 24 (batch, head) pairs. Several tiles per CTA, ragged
    rows, GQA."""
    import dataclasses
    cfg = _hopper().hopper_fwd_config(128, True, seqlen_k=4096)
    assert cfg.dynamic and cfg.o_staging and cfg.lpt == 16
    q = randn(4, 1000, 6, 128, dtype=dtype)
    k = randn(4, 1100, 2, 128, dtype=dtype)
    v = randn(4, 1100, 2, 128, dtype=dtype)
    check(q, k, v, causal=True, config=dataclasses.replace(cfg, lpt=lpt))


def test_o_staging_refused():
    """A config whose O staging tile would not fit the shared memory is refused on the host,
    naming the config and the bytes, before anything is launched."""
    import dataclasses
    hf = pytest.importorskip("solattn.kernels.hopper.forward_plan", reason="Gluon unavailable")
    cfg = dataclasses.replace(hf.hopper_fwd_config(256, False), persistent=True, o_staging=True)
    with pytest.raises(ValueError, match=r"o_staging.*262144 bytes.*232448"):
        hf.check_shared_memory(cfg, 256, 256, 2, o_tile=True)
    small = dataclasses.replace(hf.hopper_fwd_config(128, False), persistent=True,
                                o_staging=True, stages=2)
    hf.check_shared_memory(small, 128, 128, 2, o_tile=True)
    with pytest.raises(ValueError, match=r"stages=3.*o_staging"):
        hf.check_shared_memory(dataclasses.replace(small, stages=3), 128, 128, 2,
                               o_tile=True)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("lpt", [1, 4096])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_lpt_order(d, lpt, persistent):
    """``HopperFwdConfig.lpt``: causal tiles longest first within head groups. 1 MiB makes groups
    of 3 (d=256), 6 (d=128) or 12 query heads (d=64: the last group of the 18 (batch, head)
    pairs ragged, groups straddle the batch); 4096 MiB makes one group."""
    import dataclasses
    cfg = dataclasses.replace(_hopper().hopper_fwd_config(d, True), persistent=persistent,
                              lpt=lpt)
    q = randn(2, 1500, 9, d, dtype=torch.bfloat16)
    k = randn(2, 1000, 3, d, dtype=torch.bfloat16)
    v = randn(2, 1000, 3, d, dtype=torch.bfloat16)
    check(q, k, v, causal=True, config=cfg)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_three_consumers(causal, persistent):
    """Three consumer warpgroups (192-row tiles, 160 registers each) at d=64: ragged row tiles
    (1000 = 5 * 192 + 40), GQA, both launch modes."""
    import dataclasses
    cfg = dataclasses.replace(_hopper().hopper_fwd_config(64, causal), consumers=3,
                              consumer_regs=160, persistent=persistent)
    q = randn(2, 1000, 6, 64, dtype=torch.bfloat16)
    k = randn(2, 1100, 2, 64, dtype=torch.bfloat16)
    v = randn(2, 1100, 2, 64, dtype=torch.bfloat16)
    check(q, k, v, causal=causal, config=cfg)


def test_tma_ready_copies_what_tma_cannot_read():
    """The Hopper kernels' host check (forward and backward share it): an aligned tensor goes
    through as is; a contiguous view at an unaligned offset (``.contiguous()`` would return it
    unchanged) and a tensor with a strided last dim are copied."""
    pipeline = pytest.importorskip("solattn.kernels.hopper.pipeline", reason="Gluon unavailable")
    aligned = torch.zeros(2, 64, 4, 64, dtype=torch.float16)
    assert pipeline.tma_ready(aligned) is aligned
    base = torch.randn(1 + aligned.numel(), dtype=torch.float16)
    view = base[1:].view(2, 64, 4, 64)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    copy = pipeline.tma_ready(view)
    assert copy.data_ptr() % 16 == 0 and torch.equal(copy, view)
    strided = torch.randn(2, 64, 4, 128, dtype=torch.float16)[..., ::2]
    copy = pipeline.tma_ready(strided)
    assert copy.stride(-1) == 1 and torch.equal(copy, strided)
