"""Attention dropout on the Hopper (Gluon) kernels: the keep mask they draw is the documented
Philox scheme bit for bit (the portable kernels' mask, so forward and backward may run on either),
and outputs and gradients under it match the float64 oracle.

The mask functions (:func:`solattn.kernels.hopper.dropout.keep_mask` / ``keep_mask_t``) run in
a test kernel on the accumulator layouts the forward and the backward use, then through the
public API under ``forced_backend("hopper")`` against the oracle with the documented mask
(``test_dropout._documented_mask``).
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_close, assert_lse_close, randn, sm90
from test_backward import check_grads
from test_dropout import _documented_mask

from solattn import flash_attn_func, flash_attn_varlen_func
from solattn.dispatch import forced_backend
from solattn.dropout import draw_seed, keep_threshold
from solattn.reference import attention_ref, attention_varlen_ref

pytestmark = [pytest.mark.gpu, sm90]

SEED = 4321


def _mask_kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from solattn.kernels.hopper.dropout import keep_mask, keep_mask_t

    @gluon.jit
    def mask_kernel(SEED_PTR, OUT, b, h, threshold, row_start, col_start, ROWS: gl.constexpr,
                    COLS: gl.constexpr, WARPS: gl.constexpr, COL_WARPS: gl.constexpr,
                    TRANSPOSED: gl.constexpr):
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS // COL_WARPS, COL_WARPS],
            instr_shape=[16, COLS // COL_WARPS, 16])
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        drop = (gl.load(SEED_PTR), b, h, threshold, 1.0)
        if TRANSPOSED:  # rows are keys, columns queries
            keep = keep_mask_t(drop, row_start, col_start, ROWS, COLS, layout)
        else:
            keep = keep_mask(drop, row_start, col_start, ROWS, COLS, layout)
        gl.store(OUT + rows[:, None] * COLS + cols[None, :], keep.to(gl.int8))

    return mask_kernel


@pytest.mark.parametrize("transposed,rows,cols,warps,col_warps", [
    (False, 64, 128, 4, 1), (False, 64, 64, 4, 1), (False, 64, 32, 4, 1),
    (True, 128, 64, 8, 1), (True, 64, 64, 4, 1), (True, 64, 64, 8, 2),
], ids=str)
def test_keep_mask_is_the_documented_scheme(transposed, rows, cols, warps, col_warps):
    """Each element of the tile at an offset (queries from 192, keys from 320) is the
    documented draw's bit, in the forward's (rows = queries) and the backward's (rows = keys)
    orientation; ``col_warps`` 2: two warpgroups splitting the columns (the d=256 backward's
    64-key tiles)."""
    torch.manual_seed(SEED)
    seed = draw_seed(torch.device("cuda"))
    p, b, h = 0.37, 3, 5
    row_start, col_start = (320, 192) if transposed else (192, 320)
    out = torch.empty(rows, cols, dtype=torch.int8, device="cuda")
    _mask_kernel()[(1,)](seed, out, b, h, keep_threshold(p), row_start, col_start, rows, cols,
                         warps, col_warps, transposed, num_warps=warps)
    s_q, s_k = (col_start + cols, row_start + rows) if transposed else (row_start + rows,
                                                                          col_start + cols)
    doc = _documented_mask(int(seed.item()), b + 1, h + 1, s_q, s_k, p)[b, h]
    want = doc[col_start:, row_start:].T if transposed else doc[row_start:, col_start:]
    assert torch.equal(out.bool(), want)


def _forward_ref(q, k, v, p, seed_state, **kw):
    """The oracle's (out, lse) at full and low precision under the documented mask of the
    seed a call draws from ``seed_state``."""
    torch.manual_seed(seed_state)
    seed = int(draw_seed(q.device).item())
    b, s_q, h, _ = q.shape
    keep = _documented_mask(seed, b, h, s_q, k.shape[1], p)
    hi = attention_ref(q, k, v, dropout_mask=keep, dropout_p=p, **kw)
    lo = attention_ref(q, k, v, dropout_mask=keep, dropout_p=p, upcast=False, **kw)
    return keep, hi, lo


FORWARD_CASES = {
    "plain": ((2, 300, 300, 4, 4), dict()),
    "causal-gqa": ((1, 517, 700, 4, 2), dict(causal=True)),
    "window-softcap": ((1, 400, 400, 2, 1), dict(window_size=(100, 7), softcap=5.0)),
    "causal-softcap": ((1, 333, 333, 2, 2), dict(causal=True, softcap=5.0)),
    "alibi-causal": ((2, 200, 260, 2, 2), dict(causal=True, alibi_slopes="heads")),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward(case, d, dtype):
    """The Hopper forward with dropout against the oracle (96 and 192 on the padded tiles of
    128 and 256; ALiBi with dropout at the 256-wide tile runs the portable forward)."""
    (b, s_q, s_k, h, h_kv), kw = FORWARD_CASES[case]
    kw = dict(kw)
    if d > 128 and "alibi_slopes" in kw:
        pytest.skip("dropout with ALiBi at head_dim 256 runs the portable forward (covers)")
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = torch.rand(h, device="cuda") * 0.3
    p = 0.3
    q, k, v = (randn(b, s_q, h, d, dtype=dtype), randn(b, s_k, h_kv, d, dtype=dtype),
               randn(b, s_k, h_kv, d, dtype=dtype))
    _, (out_hi, lse_hi), (out_lo, _) = _forward_ref(q, k, v, p, SEED, **kw)
    torch.manual_seed(SEED)
    with forced_backend("hopper"):
        out, lse = flash_attn_func(q, k, v, p, return_lse=True, **kw)
    assert_close("out", out, out_hi, out_lo)
    assert_lse_close(lse, lse_hi)


def test_forward_varlen():
    """Varlen: each sequence's mask is keyed by its index (the batch entry of the scheme)."""
    lens = [130, 7, 0, 300]
    h, h_kv, d, p = 4, 2, 128, 0.25
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = randn(sum(lens), h, d), randn(sum(lens), h_kv, d), randn(sum(lens), h_kv, d)
    torch.manual_seed(SEED)
    seed = int(draw_seed(torch.device("cuda")).item())
    keep = _documented_mask(seed, len(lens), h, max(lens), max(lens), p)
    torch.manual_seed(SEED)
    with forced_backend("hopper"):
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), p, causal=True)
    kw = dict(causal=True, dropout_mask=keep, dropout_p=p)
    hi = attention_varlen_ref(q, k, v, cu, cu, **kw)[0]
    lo = attention_varlen_ref(q, k, v, cu, cu, upcast=False, **kw)[0]
    assert_close("out", out, hi, lo)


BACKWARD_CASES = {
    "plain": ((2, 300, 300, 4, 4), dict()),
    "causal-gqa": ((1, 517, 700, 4, 2), dict(causal=True)),
    "window": ((1, 400, 400, 2, 1), dict(window_size=(100, 7))),
    "softcap-alibi": ((1, 300, 300, 2, 2), dict(causal=True, softcap=5.0,
                                                  alibi_slopes="heads")),
}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_backward(case, d, deterministic):
    """Forward and backward on the Hopper kernels (with ALiBi at d=256 the forward on the
    portable one): output and dQ/dK/dV against the oracle under the documented mask. (Softcap
    / ALiBi with dropout run the 64-key tile at d=128, and at d=64 with Triton >= 3.9:
    configs.hopper_backward.dropout_scores_tile.)"""
    from solattn.kernels.hopper.backward_plan import deterministic_covered

    (b, s_q, s_k, h, h_kv), kw = BACKWARD_CASES[case]
    kw = dict(kw)
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = torch.rand(h, device="cuda") * 0.3
    band = kw.get("causal", False) or "window_size" in kw
    if deterministic and not deterministic_covered(d, band, "alibi_slopes" in kw):
        pytest.skip("the portable backward runs this case (deterministic_covered)")
    p = 0.2
    q, k, v = randn(b, s_q, h, d), randn(b, s_k, h_kv, d), randn(b, s_k, h_kv, d)
    keep, _, _ = _forward_ref(q, k, v, p, SEED, **kw)

    def fn(q, k, v):
        torch.manual_seed(SEED)
        with forced_backend("portable" if d == 256 and "alibi_slopes" in kw else "hopper"):
            return flash_attn_func(q, k, v, p, deterministic=deterministic, **kw)

    def ref_fn(q, k, v, upcast):
        return attention_ref(q, k, v, upcast=upcast, dropout_mask=keep, dropout_p=p, **kw)

    with forced_backend("hopper"):
        check_grads(fn, ref_fn, q, k, v, factor=3.0)


def test_hopper_forward_portable_backward():
    """The Hopper forward's mask and the portable backward's are the same function: the
    gradients of a Hopper forward, taken by the portable backward, match the oracle."""
    b, s, h, d, p = 1, 333, 4, 128, 0.2
    kw = dict(causal=True, softcap=5.0)
    q, k, v = randn(b, s, h, d), randn(b, s, h, d), randn(b, s, h, d)
    keep, _, _ = _forward_ref(q, k, v, p, SEED, **kw)

    def fn(q, k, v):
        torch.manual_seed(SEED)
        with forced_backend("hopper"):
            return flash_attn_func(q, k, v, p, **kw)

    def ref_fn(q, k, v, upcast):
        return attention_ref(q, k, v, upcast=upcast, dropout_mask=keep, dropout_p=p, **kw)

    with forced_backend("portable"):  # (the backward's backend: chosen when it runs)
        check_grads(fn, ref_fn, q, k, v, factor=3.0)


def test_dispatch():
    """Dropout runs the Hopper forward at every head dim (not with ALiBi at 256) and the Hopper
    backward at every head dim, with softcap too (d=128: the 64-key tile)."""
    from solattn.configs.hopper_backward import dropout_scores_tile
    from solattn.core import make_params
    from solattn.kernels.hopper import backward_plan, forward_plan

    for d, alibi, fwd in ((64, False, True), (128, False, True), (256, False, True),
                          (256, True, False)):
        q = randn(1, 64, 2, d)
        slopes = torch.ones(2, device=q.device) if alibi else None
        params = make_params(q, q, causal=True, dropout_p=0.1, alibi_slopes=slopes)
        assert forward_plan.covers(q, q, params)[0] is fwd, (d, alibi)
    for d in (64, 128, 256):
        for softcap in (0.0, 5.0):
            q = randn(1, 64, 2, d)
            params = make_params(q, q, causal=True, dropout_p=0.1, softcap=softcap)
            lse = torch.empty(1, 2, 64, device="cuda")
            assert backward_plan.covers(q, q, lse, params)[0], (d, softcap)
            block_n = backward_plan.config_of(d, params).block_n
            assert block_n == (64 if d == 256 or dropout_scores_tile(d, bool(softcap), True)
                               else 128)
